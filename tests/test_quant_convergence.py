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


def test_verdicts_follow_each_settings_target() -> None:
    """Gather alone within 1% of fp32, with a quantized reduce within 2%; a lower loss
    always meets it; a failed setting says why."""
    assert "| +0.90% | within 1% | yes |" in qc._row("gather-int8", _outcome(2.018), 2.0)
    assert "| +1.10% | within 1% | **no** |" in qc._row("gather-fp8", _outcome(2.022), 2.0)
    assert "| +1.90% | within 2% | yes |" in qc._row("both-int8", _outcome(2.038), 2.0)
    assert "| +2.10% | within 2% | **no** |" in qc._row("both-fp8", _outcome(2.042), 2.0)
    assert "| -5.00% | within 1% | yes |" in qc._row("gather-int8", _outcome(1.9), 2.0)
    assert "| reference |" in qc._row("fp32", _outcome(2.0), 2.0)
    failed = qc.Outcome(None, "SystemExit: no field")
    assert "failed: SystemExit: no field" in qc._row("both-fp8", failed, 2.0)


def test_full_precision_setting_end_to_end(tmp_path) -> None:  # noqa: ANN001
    md, js = str(tmp_path / "q.md"), str(tmp_path / "q.json")  # no --png: matplotlib is the tool's alone
    small = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "2"]
    rc = qc.main(["--settings", "fp32", "--steps", "4", "--ranks", "2", "--eval-every", "2",
                  "--eval-batches", "1", *small, "--md", md, "--png", "", "--json", js])
    assert rc == 0
    curves = json.loads((tmp_path / "q.json").read_text())["fp32"]
    assert list(curves["train"]) == ["0", "1", "2", "3"] and list(curves["heldout"]) == ["1", "3"], curves
    assert "| fp32 |" in (tmp_path / "q.md").read_text()
