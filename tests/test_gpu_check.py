"""tools/gpu_check.py: without CUDA it says so and exits 0; its checks run over gloo
(``--cpu --small``), where fsdp2 and torch's fully_shard must agree and it exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600)


def test_without_cuda_it_says_so_and_passes() -> None:
    proc = _run()
    assert proc.returncode == 0 and "no CUDA device here" in proc.stdout, proc.stdout + proc.stderr


def test_checks_run_over_gloo() -> None:
    proc = _run("--cpu", "--small")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 6 and all("| ok |" in row for row in rows), proc.stdout
    assert "all parity checks passed" in proc.stdout


def test_quant_check_runs_on_the_cpu() -> None:
    proc = _run("--quant", "--cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "| quantize | reference | float32 | int8 |" in out and "| int8 gather+reduce, reference |" in out, out
    assert "fused kernels agree with the reference bit for bit" in out, out
