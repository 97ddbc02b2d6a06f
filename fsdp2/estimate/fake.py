"""The torchrun environment of one rank of a large job, on this CPU: the fake process
group (collectives cost nothing and move no data, delivering as if every rank held this
one's data) and pipeline stages that agree on shapes without exchanging objects."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..memory.symmetric import symmetric_collectives


def fake_distributed(rank: int, world: int, local_world: int) -> Callable[[], None]:
    """The torchrun environment of ``rank`` (no GPU: the run is on this CPU), and
    ``init_process_group`` starting the fake process group whatever backend or store the
    script asks for. Returns what undoes all that."""
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved_env = dict(os.environ)
    saved = (dist.init_process_group, getattr(PipelineStage, "_warmup_backward_result", None),
             torch.cuda.is_available, torch.cuda.device_count)
    # Hidden twice: the variable for what starts CUDA later, the functions for a process
    # whose CUDA runtime already counted its devices (it reads the variable only once).
    torch.cuda.is_available = lambda: False
    torch.cuda.device_count = lambda: 0
    os.environ.update({
        "CUDA_VISIBLE_DEVICES": "",
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local_world),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world),
        "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
    })
    os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        original("fake", store=FakeStore(), rank=rank, world_size=world)

    def undo() -> None:
        """Every patch restored first, whatever tearing the process group down raises."""
        try:
            undo_collectives()
            os.environ.clear()
            os.environ.update(saved_env)
            dist.init_process_group = distributed_c10d.init_process_group = saved[0]
            torch.cuda.is_available, torch.cuda.device_count = saved[2], saved[3]
            if saved[1] is not None:
                PipelineStage._warmup_backward_result = saved[1]  # type: ignore[method-assign, attr-defined, unused-ignore]  # torch 2.13 and 2.15 differ here
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    dist.init_process_group = distributed_c10d.init_process_group = init_process_group
    undo_collectives = symmetric_collectives()
    try:
        _static_pipeline_stages()
    except BaseException:
        undo()
        raise
    return undo


def _static_pipeline_stages() -> None:
    """Pipeline stages agree on their shapes by a vote and, unless every stage was given
    them (``input_args``/``output_args``), by exchanging them as objects, which the fake
    process group cannot deliver. Here each stage takes its own vote as the result (a
    script gives its stages alike) and one without shapes stops with the reason. (Torch
    before 2.13 has no such vote: nothing to replace.)"""
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "_warmup_backward_result"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(self: Any, received_result: Any = None) -> torch.Tensor:
        if InferenceMode.needs_dynamic(self._user_meta, True):
            raise RuntimeError(
                f"pipeline stage {self.stage_index} was built without its shapes; under fsdp2.estimate "
                "give PipelineStage input_args= and output_args= (meta tensors of one micro-batch), "
                "since stages otherwise exchange them as objects, which the fake process group cannot deliver"
            )
        return torch.ones(1, dtype=torch.int32, device=self.device)

    PipelineStage._warmup_backward_result = vote  # type: ignore[method-assign, attr-defined, unused-ignore]  # torch 2.13 and 2.15 differ here
