"""Which pipeline stages may run fsdp2's modules: fsdp2's own (``fsdp2.pipelining``), and
torch's where it drives them through public methods (torch 2.15 under ``fsdp2.patch``)."""

from __future__ import annotations

import os
from types import FrameType

from .._compat import stage_drives_fsdp_publicly


def refuse_foreign_stage(frame: FrameType | None) -> None:
    """Before torch 2.15, torch's pipeline stages reduce fsdp2's gradients on every
    micro-batch and lose the weight gradients of zero-bubble schedules' split backward;
    from 2.15 they drive FSDP modules through public methods, but only those that are
    instances of the ``FSDPModule`` they imported (fsdp2's under ``fsdp2.patch``). Refuse
    to run under a stage that does not drive fsdp2's modules (checked once, at the root's
    first forward, by the code objects on the stack from ``frame`` up; the stages of ``fsdp2.pipelining``
    mark their groups ``in_pipeline_stage``)."""
    for _ in range(40):
        if frame is None:
            return
        if frame.f_code.co_filename.endswith(_TORCH_STAGE_FILE):
            stage = frame.f_locals.get("self")
            drives = frame.f_globals.get("FSDPModule")
            if stage_drives_fsdp_publicly() and isinstance(drives, type) and isinstance(getattr(stage, "submod", None), drives):
                return  # torch 2.15's stage, with fsdp2's FSDPModule bound: it drives ours
            patched = isinstance(drives, type) and drives.__module__.startswith("fsdp2")
            why = (
                "reduces its gradients on every micro-batch and loses weight gradients in zero-bubble schedules"
                if not stage_drives_fsdp_publicly()
                else "drives only a stage module that fully_shard was applied to itself (apply it to the stage's "
                "module too, as its root)"
                if patched
                else "recognizes only torch's own FSDPModule (run under python -m fsdp2.patch, which gives it "
                "fsdp2's, or use fsdp2's stage)"
            )
            raise RuntimeError(
                "fsdp2: a fully_shard-ed module runs in a stage of torch.distributed.pipelining, which "
                f"{why}. Build the stage with fsdp2.pipelining.PipelineStage (same arguments), or "
                "adapt an existing one with fsdp2.pipelining.adapt_stage(stage)"
            )
        frame = frame.f_back


_TORCH_STAGE_FILE = os.path.join("torch", "distributed", "pipelining", "stage.py")
