"""examples/train.py: a run resumed from its checkpoints, and a rank killed mid-training
under torchrun's ``--max-restarts=1``, end with the parameters of an uninterrupted run;
activation checkpointing, meta-device init, pipeline, compile, bf16, tensor parallel and
HSDP runs train like the plain one; real text data (``--data text``) trains and reports a
held-out loss. Runs of one world size share a set of ranks (``run_example``)."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed.fsdp
from _dist import run_scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "16", "--batch-size", "2"]
FLAG_RUN = ["--steps", "3", "--layers", "4"]  # the flag runs: 3 steps of 4 layers (pipeline stages of 2 blocks)
# The flag runs of test_checkpointing_pipeline_compile_and_bf16_flags_train_like_the_plain_run:
# name -> (ranks, flags).
FLAG_RUNS: dict[str, tuple[int, list[str]]] = {
    "ac full, meta-init": (2, ["--ac", "full", "--meta-init"]),
    "ac selective": (2, ["--ac", "selective"]),
    "pp 1F1B, ac selective": (4, ["--pp", "2", "--microbatches", "2", "--ac", "selective"]),
    # The compiled runs use aot_eager (graph capture and AOTAutograd, eager kernels): what
    # composes with the schedule's split backward (each compiled backward run twice,
    # donated buffers off) and with TP's in-flight inputs is AOTAutograd, as in
    # tests/test_tensor_parallel.py. Inductor's code generation is tests/test_compile.py's
    # (at float64 parity): with a cold cache it costs each rank that compiles tens of
    # seconds of CPU, ~200 s at load ~14 for any world here (see ``compiled_runs``).
    "pp ZBVZeroBubble, ac full, compile aot_eager": (
        4, ["--pp", "2", "--microbatches", "2", "--pp-schedule", "ZBVZeroBubble", "--ac", "full",
            "--compile", "aot_eager"]
    ),
    # torchtitan's order: TP plan, checkpoint wrapper, per-block compile, fully_shard.
    "compile aot_eager, tp 2, ac full": (4, ["--compile", "aot_eager", "--tp", "2", "--ac", "full"]),
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
    runs = [([], False), (CHECKPOINTED, False), (CHECKPOINTED, True), (MUON, False), ([*MUON, *CHECKPOINTED], False)]
    runs += [(flags, False) for _, flags in FLAG_RUNS.values()]
    runs += [(flags, False) for flags in TP_RUNS.values()]
    runs += [(flags, False) for _, flags in MUON_RUNS.values()]
    runs += [(MOE, False), ([*MOE, *CHECKPOINTED], False)] + [(flags, False) for _, flags in MOE_RUNS.values()]
    runs += [([*TEXT, *EVAL], False), (TEXT, False)]
    from test_train_example_quant import QUANT, QUANT_RUNS

    runs += [(flags, False) for _, flags in QUANT_RUNS.values()] + [([*flags, *QUANT], False) for _, flags in QUANT_RUNS.values()]
    return runs


tested_flag_sets.__test__ = False  # a helper whose name starts with "test": not a test for pytest


def run_example(nproc: int, runs: dict[str, list[str]]) -> dict[str, str]:
    """Runs of examples/train.py (``SMALL`` and each run's flags) one after the other in
    one set of ``nproc`` ranks, forked from the test helper's server, which has torch
    imported already (torchrun's fresh interpreters would import torch and fsdp2 again:
    seconds of CPU per rank, more than a 3-step run); each calls ``main(argv)`` in the
    ranks' (gloo) process group. Each run's log: its ranks' output."""
    scenarios = {name: (_example_rank, ([*SMALL, *argv],)) for name, argv in runs.items()}
    logs = run_scenarios(nproc, scenarios, timeout=300)
    return {name: "".join(logs[name]) for name in runs}


def _torchrun_restarted(*args: str, fail_at: int) -> str:
    """examples/train.py on 2 ranks under torchrun ``--max-restarts=1``, rank 1 killed at
    step ``fail_at`` (``FSDP2_EXAMPLE_FAIL_AT``): its ranks' output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts=1", os.path.join(ROOT, "examples", "train.py"), *SMALL, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "FSDP2_EXAMPLE_FAIL_AT": str(fail_at)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
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


# The flag and checkpoint runs, in four sets of ranks (module fixtures: each test takes
# the logs it checks). The plain 2-rank run (its final parameters in "plain.pt") and the other 2-rank flag runs.
@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> tuple[dict[str, str], pathlib.Path]:  # noqa: ANN001
    out = tmp_path_factory.mktemp("two_ranks")
    runs = {"plain": [*FLAG_RUN, "--final-params", str(out / "plain.pt")], "muon": [*FLAG_RUN, *MUON]}
    runs |= {name: [*FLAG_RUN, *flags] for name, (nproc, flags) in FLAG_RUNS.items() if nproc == 2 and "--compile" not in flags}
    return run_example(2, runs), out


# The 4-rank runs without --compile: pipeline, tensor parallel (final parameters in
# "<name>.pt"), HSDP, Muon across them.
@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> tuple[dict[str, str], pathlib.Path]:  # noqa: ANN001
    out = tmp_path_factory.mktemp("four_ranks")
    runs = {name: [*FLAG_RUN, *flags] for name, (nproc, flags) in FLAG_RUNS.items() if nproc == 4 and "--compile" not in flags}
    runs |= {name: [*FLAG_RUN, *flags, "--final-params", str(out / f"{name}.pt")] for name, flags in TP_RUNS.items()}
    runs |= {f"muon, {name}": [*FLAG_RUN, *flags] for name, (_, flags) in MUON_RUNS.items()}
    return run_example(4, runs), out


# The compiled runs (4 ranks), each in a set of ranks of its own: a cold inductor cache
# makes each compile tens of seconds of CPU, and together in one world they came near its
# timeout on a loaded machine (the zero-bubble one also turns off torch's donated buffers
# for its processes). With inductor, at load ~14 and a cold cache, the zero-bubble one
# took 193 s of its 300 and the TP one 222 s (a 2-rank one 197 s, without ``--ac``); with
# aot_eager 76 s and 26 s.
@pytest.fixture(scope="module")
def compiled_runs() -> dict[str, str]:
    compiled = [name for name, (_, flags) in FLAG_RUNS.items() if "--compile" in flags]
    logs: dict[str, str] = {}
    for name in compiled:
        logs |= run_example(FLAG_RUNS[name][0], {name: [*FLAG_RUN, *FLAG_RUNS[name][1]]})
    return logs


# Checkpoints, 2 ranks: uninterrupted 7-step runs ("<name> clean", final parameters in
# "<name>-clean.pt"), and runs that save every 2 steps, then resume: "<name> first" stops
# (its last step is not a save point), "<name> resumed" continues from its latest
# checkpoint to step 7 (final parameters in "<name>-resumed.pt"); name "adamw", "muon".
@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory) -> tuple[dict[str, str], pathlib.Path]:  # noqa: ANN001
    out = tmp_path_factory.mktemp("checkpoints")
    runs = {}
    # "muon first" stops after step 4: a job whose rank is killed at step 5 has run as far
    # (test_killed_rank_restarts_and_matches_uninterrupted kills one, with AdamW).
    for name, flags, first in (("adamw", [], 4), ("muon", MUON, 5)):
        saving = ["--ckpt-dir", str(out / f"{name}-ckpt"), "--save-every", "2"]
        runs[f"{name} clean"] = ["--steps", "7", *flags, "--final-params", str(out / f"{name}-clean.pt")]
        runs[f"{name} first"] = ["--steps", str(first), *flags, *saving]
        runs[f"{name} resumed"] = ["--steps", "7", *flags, *saving, "--final-params", str(out / f"{name}-resumed.pt")]
    return run_example(2, runs), out


def _same(a: str, b: str) -> None:
    pa, pb = torch.load(a), torch.load(b)
    assert list(pa) == list(pb)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_killed_rank_restarts_and_matches_uninterrupted(tmp_path, checkpoint_runs) -> None:  # noqa: ANN001
    ckpt, crashed = str(tmp_path / "ckpt"), str(tmp_path / "crashed.pt")
    log = _torchrun_restarted("--steps", "7", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", crashed,
                              fail_at=5)
    assert "simulated failure at step 5" in log
    assert "resumed from" in log and "step-000003" in log
    _same(str(checkpoint_runs[1] / "adamw-clean.pt"), crashed)
    assert not [d for d in os.listdir(ckpt) if d.startswith(".tmp")]


def test_resume_from_latest_checkpoint(checkpoint_runs) -> None:  # noqa: ANN001
    logs, out = checkpoint_runs
    assert "at step 4" in logs["adamw resumed"]
    _same(str(out / "adamw-clean.pt"), str(out / "adamw-resumed.pt"))


def _losses(log: str) -> dict[tuple[int, int], float]:
    """(data rank, step) -> loss, from the ranks that print one."""
    found = re.findall(r"data (\d+) step +(\d+) loss +([0-9.]+)", log)
    return {(int(d), int(s)): float(v) for d, s, v in found}


def test_checkpointing_pipeline_compile_and_bf16_flags_train_like_the_plain_run(
    two_rank_runs, four_rank_runs, compiled_runs  # noqa: ANN001
) -> None:
    """``--ac full --meta-init``, ``--ac selective``, ``--pp 2`` (4 ranks: pp 2 x dp 2, two
    schedules, the zero-bubble one compiled with aot_eager), ``--compile aot_eager --tp 2
    --ac full`` (4 ranks: dp 2 x tp 2) and ``--bf16`` print the plain run's losses: same
    data per data-parallel rank, same initial weights, the same training."""
    plain = _losses(two_rank_runs[0]["plain"])
    assert len(plain) == 6, plain
    runs = {**two_rank_runs[0], **four_rank_runs[0], **compiled_runs}
    # aot_eager runs eager kernels: the compiled runs print the plain run's losses; bf16
    # compute (fp32 reduce and master weights) within bf16's rounding.
    tolerance = {"bf16": 5e-3}
    for name in FLAG_RUNS:
        got = _losses(runs[name])
        assert got.keys() == plain.keys(), (name, got)
        for key, loss in plain.items():
            assert abs(got[key] - loss) < tolerance.get(name, 1e-5), (name, key, got[key], loss)


def test_tensor_parallel_and_hsdp_train_like_the_plain_run(two_rank_runs, four_rank_runs) -> None:  # noqa: ANN001
    """At 4 ranks, ``--tp 2`` (dp 2 x tp 2: each tp pair trains on its dp rank's data)
    and ``--tp 2 --hsdp 2`` (2 replicas x 1 shard x tp 2) print the losses of a plain run
    on 2 ranks and end with its full parameters: equal up to float32 rounding, as the
    reductions add in another order (tp's partial sums, HSDP's reduce-scatter then
    all-reduce). HSDP alone is tested against local training in tests/test_nd_meshes.py."""
    want = _losses(two_rank_runs[0]["plain"])
    want_params = torch.load(two_rank_runs[1] / "plain.pt")
    logs, out = four_rank_runs
    for name in TP_RUNS:
        assert f"world size 4, pp 1, {name}," in logs[name]
        got = _losses(logs[name])
        assert got.keys() == want.keys(), (name, got)
        for key, loss in want.items():
            assert abs(got[key] - loss) < 1.5e-4, (name, key, got[key], loss)  # printed to 1e-4
        got_params = torch.load(out / f"{name}.pt")
        assert list(got_params) == list(want_params)
        for k, v in want_params.items():
            torch.testing.assert_close(
                got_params[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k, name=name: f"{name}: {k}: {m}"
            )


def test_muon_and_clipping_across_layouts_and_a_resume(two_rank_runs, four_rank_runs, checkpoint_runs) -> None:  # noqa: ANN001
    """``--optim muon --clip 0.5`` (fsdp2.optim.Muon on the blocks' matrices, AdamW on the
    rest, fsdp2.clip_grad_norm_): ``--tp 2 --hsdp 2`` (2 replicas x 1 shard x tp 2, the
    norm across two meshes) and ``--pp 2`` (the norm across stages) print the 2-rank run's
    losses; a run stopped after step 4 resumes from the step-3 checkpoint (Muon's momentum
    with it) and ends with the uninterrupted run's parameters, bit for bit (as the job of
    a rank killed at step 5 would: the kill and restart themselves are
    test_killed_rank_restarts_and_matches_uninterrupted's)."""
    plain = _losses(two_rank_runs[0]["muon"])
    assert len(plain) == 6, plain
    for name in MUON_RUNS:
        log = four_rank_runs[0][f"muon, {name}"]
        assert "optim muon, clip 0.5" in log
        got = _losses(log)
        assert got.keys() == plain.keys(), (name, got)
        for key, loss in plain.items():
            assert abs(got[key] - loss) < 5e-4, (name, key, got[key], loss)
    logs, out = checkpoint_runs
    assert "resumed from" in logs["muon resumed"] and "step-000003" in logs["muon resumed"]
    _same(str(out / "muon-clean.pt"), str(out / "muon-resumed.pt"))


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
