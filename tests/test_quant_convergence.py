"""tools/quant_convergence.py: its verdicts (each setting's held-out gap to fp32 against
its target) and a small end-to-end run of the full-precision setting at 2 ranks. The
quantized settings need fsdp2's quantized communication; their runs are the tool's job."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))  # by name: the ranks unpickle the tool's rank function
import quant_convergence as qc  # noqa: E402


def _outcome(heldout: float) -> qc.Outcome:
    return qc.Outcome(qc.Curves({0: 5.0, 1: 4.0}, {1: heldout}, 10.0, 1.0), "")


def _row(name: str, *finals: float) -> str:
    """The row of ``name`` whose seeds end at ``finals`` against fp32 ending at 2.0 on each."""
    results = {"fp32": {s: _outcome(2.0) for s in range(len(finals))}, name: {s: _outcome(f) for s, f in enumerate(finals)}}
    return qc._row(results, name)


def test_verdicts_follow_each_settings_target() -> None:
    """Gather alone within 1% of fp32, with a quantized reduce within 2%, on the mean of the
    per-seed gaps; a lower loss always meets it; a failed setting says why."""
    assert "| +0.90% | +0.90% | within 1% | yes |" in _row("gather-int8", 2.018)
    assert "| +1.10% | within 1% | **no** |" in _row("gather-fp8", 2.022)
    assert "| +1.90% | within 2% | yes |" in _row("both-int8", 2.038)
    assert "| +2.10% | within 2% | **no** |" in _row("both-fp8", 2.042)
    assert "| -5.00% | -5.00% | within 1% | yes |" in _row("gather-int8", 1.9)
    assert "| +1.50%, -0.50% | +0.50% | within 1% | yes |" in _row("gather-int8", 2.03, 1.99)
    assert "| reference |" in _row("fp32", 2.0)
    failed = {"fp32": {0: _outcome(2.0)}, "both-fp8": {0: qc.Outcome(None, "SystemExit: no field")}}
    assert "failed: SystemExit: no field" in qc._row(failed, "both-fp8")


def test_full_precision_setting_end_to_end(tmp_path) -> None:  # noqa: ANN001
    md, js = str(tmp_path / "q.md"), str(tmp_path / "q.json")  # no --png: matplotlib is the tool's alone
    small = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "2"]
    rc = qc.main(["--settings", "fp32", "--seeds", "0", "--steps", "4", "--ranks", "2", "--eval-every", "2",
                  "--eval-batches", "1", *small, "--md", md, "--png", "", "--json", js])
    assert rc == 0
    curves = json.loads((tmp_path / "q.json").read_text())["fp32"]["0"]
    assert list(curves["train"]) == ["0", "1", "2", "3"] and list(curves["heldout"]) == ["1", "3"], curves
    assert "| fp32 |" in (tmp_path / "q.md").read_text()
