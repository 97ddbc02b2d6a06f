"""tools/gpu_check.py: without CUDA it says so and exits 0; its checks run over gloo
(``--cpu --small``), where fsdp2 and torch's fully_shard must agree and it exits 0.
``run_tools`` runs tool commands as ``python tools/...`` would, several in one interpreter
(tests/test_docs.py's documented tool commands too)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.py")
ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # no CUDA
MARK = "@@run_tools "
# Each command as its script's ``__main__`` (runpy, with its folder first on sys.path, as
# ``python script`` puts it); after its output, its exit status on both streams.
_RUNNER = f"""
import json, os, runpy, sys, traceback
for argv in json.loads(sys.argv[1]):
    sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    for stream in (sys.stdout, sys.stderr):
        print({MARK!r} + json.dumps(rc), file=stream, flush=True)
"""


def run_tools(commands: list[list[str]], env: dict[str, str], timeout: float) -> list[tuple[int, str, str]]:
    """Each command (``[script, *args]``, the script's path from the repository root) run
    as ``python script args`` runs it, all in one fresh interpreter in the repository
    root (one import of torch, not one per command), under ``env`` added to this
    process's: (exit status, output, error output) of each, in order."""
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(commands)], check=False, cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    streams = [text.split(MARK) for text in (proc.stdout, proc.stderr)]
    assert proc.returncode == 0 and all(len(parts) == len(commands) + 1 for parts in streams), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    # Part i + 1 of a stream: command i's status line, then command i + 1's text.
    status = [int(part.partition("\n")[0]) for part in streams[0][1:]]
    out, err = ([parts[0], *(part.partition("\n")[2] for part in parts[1:-1])] for parts in streams)
    return list(zip(status, out, err))


@functools.cache
def _runs() -> list[tuple[int, str, str]]:
    """``gpu_check.py`` without CUDA, ``gpu_check.py --cpu --small`` (its ranks fork from
    that interpreter) and ``gpu_check.py --quant --cpu``, in one interpreter."""
    return run_tools([[SCRIPT], [SCRIPT, "--cpu", "--small"], [SCRIPT, "--quant", "--cpu"]], ENV, timeout=600)


def test_without_cuda_it_says_so_and_passes() -> None:
    rc, out, err = _runs()[0]
    assert rc == 0 and "no CUDA device here" in out, out + err


def test_checks_run_over_gloo() -> None:
    rc, out, err = _runs()[1]
    assert rc == 0, out + err[-3000:]
    rows = [line for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(rows) == 6 and all("| ok |" in row for row in rows), out
    assert "all parity checks passed" in out


def test_quant_check_runs_on_the_cpu() -> None:
    rc, out, err = _runs()[2]
    assert rc == 0, out + err[-3000:]
    assert "| quantize | reference | float32 | int8 |" in out and "| int8 gather+reduce, reference |" in out, out
    assert "fused kernels agree with the reference bit for bit" in out, out
