"""examples/train.py under torchrun: checkpoints, resume, and a rank killed mid-training
under ``--max-restarts=1`` all end with the parameters of an uninterrupted run; activation
checkpointing, pipeline, tensor parallel and HSDP runs train like the plain one."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--seq-len", "16", "--batch-size", "2"]


def _torchrun(*args: str, env: dict[str, str] | None = None, restarts: int = 0, nproc: int = 2) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           f"--max-restarts={restarts}", os.path.join(ROOT, "examples", "train.py"), *SMALL, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, **(env or {})}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _same(a: str, b: str) -> None:
    pa, pb = torch.load(a), torch.load(b)
    assert list(pa) == list(pb)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def test_killed_rank_restarts_and_matches_uninterrupted(tmp_path) -> None:  # noqa: ANN001
    clean = str(tmp_path / "clean.pt")
    _torchrun("--steps", "8", "--final-params", clean)

    ckpt, crashed = str(tmp_path / "ckpt"), str(tmp_path / "crashed.pt")
    log = _torchrun(
        "--steps", "8", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", crashed,
        env={"FSDP2_EXAMPLE_FAIL_AT": "5"}, restarts=1,
    )
    assert "simulated failure at step 5" in log
    assert "resumed from" in log and "step-000003" in log
    _same(clean, crashed)
    assert not [d for d in os.listdir(ckpt) if d.startswith(".tmp")]


def test_resume_from_latest_checkpoint(tmp_path) -> None:  # noqa: ANN001
    ckpt = str(tmp_path / "ckpt")
    first, resumed, clean = (str(tmp_path / f"{n}.pt") for n in ("first", "resumed", "clean"))
    _torchrun("--steps", "4", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", first)
    log = _torchrun("--steps", "7", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", resumed)
    assert "at step 4" in log
    _torchrun("--steps", "7", "--final-params", clean)
    _same(clean, resumed)


def _losses(log: str) -> dict[tuple[int, int], float]:
    """(data rank, step) -> loss, from the ranks that print one."""
    found = re.findall(r"data (\d+) step +(\d+) loss +([0-9.]+)", log)
    return {(int(d), int(s)): float(v) for d, s, v in found}


def test_checkpointing_and_pipeline_flags_train_like_the_plain_run() -> None:
    """``--ac full``, ``--ac selective``, ``--pp 2`` (4 ranks: pp 2 x dp 2, two
    schedules) and ``--compile --ac full`` print the plain run's losses: same data per data-parallel rank, same
    initial weights, the same training."""
    steps = ["--steps", "3", "--layers", "4"]
    plain = _losses(_torchrun(*steps))
    assert len(plain) == 6, plain
    runs = {
        "ac full": _torchrun(*steps, "--ac", "full"),
        "ac selective": _torchrun(*steps, "--ac", "selective"),
        "pp 1F1B, ac selective": _torchrun(*steps, "--pp", "2", "--microbatches", "2", "--ac", "selective", nproc=4),
        "pp ZBVZeroBubble, ac full": _torchrun(
            *steps, "--pp", "2", "--microbatches", "2", "--pp-schedule", "ZBVZeroBubble", "--ac", "full", nproc=4
        ),
    }
    # Per-block compile with activation checkpointing (torchtitan's order): inductor's
    # float32 kernels round differently from eager ones, so the printed losses agree to
    # a few units of their last digit.
    runs["compile, ac full"] = _torchrun(*steps, "--compile", "--ac", "full")
    for name, log in runs.items():
        got = _losses(log)
        assert got.keys() == plain.keys(), (name, got)
        for key, loss in plain.items():
            assert abs(got[key] - loss) < (5e-4 if "compile" in name else 1e-5), (name, key, got[key], loss)


def test_tensor_parallel_and_hsdp_train_like_the_plain_run(tmp_path) -> None:  # noqa: ANN001
    """At 4 ranks, ``--tp 2`` (dp 2 x tp 2: each tp pair trains on its dp rank's data)
    and ``--tp 2 --hsdp 2`` (2 replicas x 1 shard x tp 2) print the losses of a plain run
    on 2 ranks and end with its full parameters: equal up to float32 rounding, as the
    reductions add in another order (tp's partial sums, HSDP's reduce-scatter then
    all-reduce). HSDP alone is tested against local training in tests/test_nd_meshes.py."""
    steps = ["--steps", "3"]
    want_path = str(tmp_path / "plain2.pt")
    want = _losses(_torchrun(*steps, "--final-params", want_path, nproc=2))
    assert len(want) == 6, want
    want_params = torch.load(want_path)
    for name, flags in (("tp 2, hsdp 1", ["--tp", "2"]), ("tp 2, hsdp 2", ["--tp", "2", "--hsdp", "2"])):
        got_path = str(tmp_path / f"{name.replace(', ', '_').replace(' ', '')}.pt")
        got_log = _torchrun(*steps, *flags, "--final-params", got_path, nproc=4)
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
