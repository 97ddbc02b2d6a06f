"""examples/train.py under torchrun: checkpoints, resume, and a rank killed mid-training
under ``--max-restarts=1`` all end with the parameters of an uninterrupted run; activation
checkpointing, meta-device init, pipeline, compile, bf16, tensor parallel and HSDP runs
train like the plain one; real text data (``--data text``) trains and reports a held-out loss."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.fsdp
from _dist import run_ranks, run_scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "16", "--batch-size", "2"]
FLAG_RUN = ["--steps", "3", "--layers", "4"]  # the flag runs: 3 steps of 4 layers (pipeline stages of 2 blocks)
# The flag runs of test_checkpointing_pipeline_compile_and_bf16_flags_train_like_the_plain_run:
# name -> (ranks, flags).
FLAG_RUNS: dict[str, tuple[int, list[str]]] = {
    "ac full, meta-init": (2, ["--ac", "full", "--meta-init"]),
    "ac selective": (2, ["--ac", "selective"]),
    "pp 1F1B, ac selective": (4, ["--pp", "2", "--microbatches", "2", "--ac", "selective"]),
    "pp ZBVZeroBubble, ac full, compile": (
        4, ["--pp", "2", "--microbatches", "2", "--pp-schedule", "ZBVZeroBubble", "--ac", "full", "--compile"]
    ),
    # torchtitan's order: TP plan, checkpoint wrapper, per-block compile, fully_shard.
    "compile, tp 2, ac full": (4, ["--compile", "--tp", "2", "--ac", "full"]),
    "bf16": (2, ["--bf16"]),
}
TP_RUNS = {"tp 2, hsdp 1": ["--tp", "2"], "tp 2, hsdp 2": ["--tp", "2", "--hsdp", "2"]}  # on 4 ranks
MUON = ["--optim", "muon", "--clip", "0.5"]
MUON_RUNS = {"tp 2, hsdp 2": (4, [*MUON, "--tp", "2", "--hsdp", "2"]), "pp 2": (4, [*MUON, "--pp", "2", "--microbatches", "2"])}
# --data text: the bytes of the standard library's source (vocab 256, so no --vocab).
TEXT_SMALL = [f for f in SMALL if f not in ("--vocab", "64")]
TEXT = ["--data", "text"]
EVAL = ["--eval-every", "10", "--eval-batches", "2"]
CHECKPOINTED = ["--ckpt-dir", "CKPT", "--save-every", "2"]  # resumed, and restarted under --max-restarts=1
MOE = ["--moe", "--ep", "2"]
# name -> (ranks, flags), each against the 4-rank --moe --ep 2 run (the pipeline and
# tensor-parallel ones against the same flags on 2 ranks: they train on world/2 ranks' data).
MOE_RUNS: dict[str, tuple[int, list[str]]] = {
    "impl torch": (4, [*MOE, "--impl", "torch"]),
    "hsdp 2, ac full, bf16": (4, [*MOE, "--hsdp", "2", "--ac", "full", "--bf16"]),
    "pp 2, muon, clip": (4, [*MOE, "--pp", "2", "--microbatches", "2", *MUON]),
    "tp 2, muon, clip": (4, [*MOE, "--tp", "2", *MUON]),
    "muon, clip": (2, [*MOE, *MUON]),
}


def tested_flag_sets() -> list[tuple[list[str], bool]]:
    """Every configuration of the example these tests run: (flags, restarted). The
    documented commands (tests/test_docs.py) must each be one of them."""
    runs = [([], False), (CHECKPOINTED, False), (CHECKPOINTED, True), (MUON, False), ([*MUON, *CHECKPOINTED], True)]
    runs += [(flags, False) for _, flags in FLAG_RUNS.values()]
    runs += [(flags, False) for flags in TP_RUNS.values()]
    runs += [(flags, False) for _, flags in MUON_RUNS.values()]
    runs += [(MOE, False), ([*MOE, *CHECKPOINTED], True)] + [(flags, False) for _, flags in MOE_RUNS.values()]
    runs += [([*TEXT, *EVAL], False), (TEXT, False)]
    from test_train_example_quant import QUANT, QUANT_RUNS

    runs += [(flags, False) for _, flags in QUANT_RUNS.values()] + [([*flags, *QUANT], False) for _, flags in QUANT_RUNS.values()]
    return runs


tested_flag_sets.__test__ = False  # a helper whose name starts with "test": not a test for pytest


def _torchrun(*args: str, env: dict[str, str] | None = None, restarts: int = 0, nproc: int = 2) -> str:
    """examples/train.py on ``nproc`` ranks: its ranks' output. Under torchrun when it must
    restart a rank or set the environment; otherwise ``main(argv)`` in ranks forked from
    the test helper's server, which has torch imported already (torchrun's fresh
    interpreters import torch and fsdp2 again: seconds of CPU per rank, most of a run)."""
    if restarts == 0 and env is None:
        return "".join(run_ranks(_example_rank, nproc, [*SMALL, *args], timeout=300))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           f"--max-restarts={restarts}", os.path.join(ROOT, "examples", "train.py"), *SMALL, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _example_rank(rank: int, world: int, argv: list[str]) -> str:
    """One rank of the example, in this process's (gloo) process group; what it printed."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(argv)
    return out.getvalue()


@pytest.fixture(scope="module")
def clean_7_steps(tmp_path_factory) -> str:  # noqa: ANN001
    """The final parameters of an uninterrupted 7-step run (shared: each run costs seconds;
    the runs below save every 2 steps, so their last step is not a save point)."""
    path = str(tmp_path_factory.mktemp("clean") / "clean.pt")
    _torchrun("--steps", "7", "--final-params", path)
    return path


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> tuple[str, str]:  # noqa: ANN001
    """A plain 3-step run of 4 layers on 2 ranks: its log and its final parameters."""
    path = str(tmp_path_factory.mktemp("plain") / "plain.pt")
    return _torchrun(*FLAG_RUN, "--final-params", path), path


def _same(a: str, b: str) -> None:
    pa, pb = torch.load(a), torch.load(b)
    assert list(pa) == list(pb)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_killed_rank_restarts_and_matches_uninterrupted(tmp_path, clean_7_steps) -> None:  # noqa: ANN001
    ckpt, crashed = str(tmp_path / "ckpt"), str(tmp_path / "crashed.pt")
    log = _torchrun(
        "--steps", "7", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", crashed,
        env={"FSDP2_EXAMPLE_FAIL_AT": "5"}, restarts=1,
    )
    assert "simulated failure at step 5" in log
    assert "resumed from" in log and "step-000003" in log
    _same(clean_7_steps, crashed)
    assert not [d for d in os.listdir(ckpt) if d.startswith(".tmp")]


def test_resume_from_latest_checkpoint(tmp_path, clean_7_steps) -> None:  # noqa: ANN001
    ckpt = str(tmp_path / "ckpt")
    first, resumed = (str(tmp_path / f"{n}.pt") for n in ("first", "resumed"))
    _torchrun("--steps", "4", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", first)
    log = _torchrun("--steps", "7", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", resumed)
    assert "at step 4" in log
    _same(clean_7_steps, resumed)


def _losses(log: str) -> dict[tuple[int, int], float]:
    """(data rank, step) -> loss, from the ranks that print one."""
    found = re.findall(r"data (\d+) step +(\d+) loss +([0-9.]+)", log)
    return {(int(d), int(s)): float(v) for d, s, v in found}


def test_checkpointing_pipeline_compile_and_bf16_flags_train_like_the_plain_run(plain_run) -> None:  # noqa: ANN001
    """``--ac full --meta-init``, ``--ac selective``, ``--pp 2`` (4 ranks: pp 2 x dp 2, two
    schedules, the zero-bubble one compiled), ``--compile --tp 2 --ac full`` (4 ranks: dp 2
    x tp 2) and ``--bf16`` print the plain run's losses: same data per data-parallel rank, same
    initial weights, the same training."""
    plain = _losses(plain_run[0])
    assert len(plain) == 6, plain
    runs = {name: _torchrun(*FLAG_RUN, *flags, nproc=nproc) for name, (nproc, flags) in FLAG_RUNS.items()}
    # Inductor's float32 kernels round differently from eager ones, so the compiled runs'
    # printed losses agree to a few units of their last digit (compile alone is tested at
    # float64 parity in tests/test_compile.py); bf16 compute (fp32 reduce and master
    # weights) within bf16's rounding.
    tolerance = {"compile, tp 2, ac full": 5e-4, "pp ZBVZeroBubble, ac full, compile": 5e-4, "bf16": 5e-3}
    for name, log in runs.items():
        got = _losses(log)
        assert got.keys() == plain.keys(), (name, got)
        for key, loss in plain.items():
            assert abs(got[key] - loss) < tolerance.get(name, 1e-5), (name, key, got[key], loss)


def test_tensor_parallel_and_hsdp_train_like_the_plain_run(tmp_path, plain_run) -> None:  # noqa: ANN001
    """At 4 ranks, ``--tp 2`` (dp 2 x tp 2: each tp pair trains on its dp rank's data)
    and ``--tp 2 --hsdp 2`` (2 replicas x 1 shard x tp 2) print the losses of a plain run
    on 2 ranks and end with its full parameters: equal up to float32 rounding, as the
    reductions add in another order (tp's partial sums, HSDP's reduce-scatter then
    all-reduce). HSDP alone is tested against local training in tests/test_nd_meshes.py."""
    want = _losses(plain_run[0])
    want_params = torch.load(plain_run[1])
    for name, flags in TP_RUNS.items():
        got_path = str(tmp_path / f"{name.replace(', ', '_').replace(' ', '')}.pt")
        got_log = _torchrun(*FLAG_RUN, *flags, "--final-params", got_path, nproc=4)
        assert f"world size 4, pp 1, {name}," in got_log
        got = _losses(got_log)
        assert got.keys() == want.keys(), (name, got)
        for key, loss in want.items():
            assert abs(got[key] - loss) < 1.5e-4, (name, key, got[key], loss)  # printed to 1e-4
        got_params = torch.load(got_path)
        assert list(got_params) == list(want_params)
        for k, v in want_params.items():
            torch.testing.assert_close(
                got_params[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k, name=name: f"{name}: {k}: {m}"
            )


def test_muon_and_clipping_across_layouts_and_a_restart(tmp_path) -> None:  # noqa: ANN001
    """``--optim muon --clip 0.5`` (fsdp2.optim.Muon on the blocks' matrices, AdamW on the
    rest, fsdp2.clip_grad_norm_): ``--tp 2 --hsdp 2`` (2 replicas x 1 shard x tp 2, the
    norm across two meshes) and ``--pp 2`` (the norm across stages) print the 2-rank run's
    losses; a rank killed at step 5 restarts from the step-3 checkpoint (Muon's momentum
    with it) and ends with the uninterrupted run's parameters, bit for bit."""
    plain = _losses(_torchrun(*FLAG_RUN, *MUON))
    assert len(plain) == 6, plain
    runs = {name: _torchrun(*FLAG_RUN, *flags, nproc=nproc) for name, (nproc, flags) in MUON_RUNS.items()}
    for name, log in runs.items():
        assert "optim muon, clip 0.5" in log
        got = _losses(log)
        assert got.keys() == plain.keys(), (name, got)
        for key, loss in plain.items():
            assert abs(got[key] - loss) < 5e-4, (name, key, got[key], loss)
    clean, crashed, ckpt = (str(tmp_path / n) for n in ("clean.pt", "crashed.pt", "ckpt"))
    _torchrun("--steps", "7", *MUON, "--final-params", clean)
    log = _torchrun(
        "--steps", "7", *MUON, "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", crashed,
        env={"FSDP2_EXAMPLE_FAIL_AT": "5"}, restarts=1,
    )
    assert "resumed from" in log and "step-000003" in log
    _same(clean, crashed)


def test_text_data_trains_and_reports_heldout_loss() -> None:
    """``--data text`` at 2 ranks: the training loss falls from about ln(256) (bytes), the
    held-out loss printed after steps 9 and 19 is finite and falls too, and the held-out
    forwards leave training alone (the same run without them prints the same losses)."""
    argv = ["--steps", "20", *TEXT_SMALL, *TEXT]
    runs = run_scenarios(2, {"eval": (_example_rank, ([*argv, *EVAL],)), "plain": (_example_rank, (argv,))},
                         timeout=300)
    log, plain = "".join(runs["eval"]), "".join(runs["plain"])
    assert "data text, quantize gather None reduce None" in log
    losses = _losses(log)
    assert losses == _losses(plain) and len(losses) == 40, losses
    first = (losses[0, 0] + losses[1, 0]) / 2
    last = sum(losses[d, s] for d in (0, 1) for s in (17, 18, 19)) / 6
    assert abs(first - math.log(256)) < 0.3 and last < first - 1.0, (first, last)
    heldout = {int(s): float(v) for s, v in re.findall(r"eval step (\d+) heldout_loss ([0-9.]+)", log)}
    assert list(heldout) == [9, 19] and all(math.isfinite(v) for v in heldout.values()), heldout
    assert heldout[19] < heldout[9] < math.log(256), heldout


def test_data_and_quantization_flags_refuse_what_cannot_run(capsys) -> None:  # noqa: ANN001
    """A vocab other than 256 with ``--data text``, held-out evaluation with ``--pp``,
    ``--quantize-*`` with torch's fully_shard, and ``--quantize-*`` where the policy has no
    such field: each a SystemExit that says why."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train

    assert train.parse_args(["--data", "text"]).vocab == 256
    assert train.parse_args([]).vocab == 512
    for argv, fragment in [
        (["--data", "text", "--vocab", "64"], "vocab of 256"),
        (["--pp", "2", "--microbatches", "2", "--eval-every", "5"], "--eval-every cannot run with --pp"),
        (["--impl", "torch", "--quantize-gather", "int8"], "torch's fully_shard has no quantized"),
    ]:
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert fragment in capsys.readouterr().err, argv
    args = train.parse_args(["--quantize-gather", "fp8", "--quantize-reduce", "int8"])
    with pytest.raises(SystemExit, match="has no quantize_gather, quantize_reduce field"):
        train.precision_policy(args, torch.distributed.fsdp)  # a policy without those fields
