"""Pipeline parallelism with ``torch.distributed.pipelining`` on fsdp2-sharded stages.

torch's pipeline stages special-case torch's own ``FSDPModule``: they accumulate the
micro-batches' gradients without synchronization and reduce them once per step. This
module's ``PipelineStage`` does the same for fsdp2's modules; use it in place of torch's
(the schedules stay torch's)::

    from fsdp2 import fully_shard
    from fsdp2.pipelining import PipelineStage            # was: torch.distributed.pipelining
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    for block in stage_module.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=mesh["pp"].get_group())

Per step, on each stage:

  Phase 1  micro-batches   each backward accumulates into the unsharded parameters'
                           gradients; nothing is reduced, and parameters gathered for
                           backward stay gathered for the next micro-batch (forwards
                           still free them per ``reshard_after_forward``). The split
                           backward of zero-bubble schedules (input gradients first,
                           weight gradients later) keeps the stage gathered from its
                           first input backward on, so the weight pass finds the same
                           parameters the input pass saw.
  Phase 2  reduce          after the last micro-batch (the schedule's reduce step): one
                           reduce-scatter per group, gradients written to the sharded
                           parameters, every group resharded; then the schedule's
                           gradient scaling.

``adapt_stage(stage)`` does the same for a stage built another way (``build_stage``).
The stage may be built before its module is sharded (torchtitan's ``pipeline_llm`` builds
each stage on the unsharded chunk, then applies ``fully_shard``): it looks its groups up
at each call until they have all run a forward, then keeps them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage
from torch.distributed.pipelining.stage import _PipelineStageBase

from ._module import groups_under
from .runtime.group import ParamGroup

__all__ = ["PipelineStage", "adapt_stage"]


class _Fsdp2Stage(_PipelineStageBase):
    """The stage methods torch's schedules call, for stages holding fsdp2 modules. A
    subclass of the stages' common base, so ``adapt_stage`` can swap an instance's class
    (Python refuses a mixin from outside the hierarchy)."""

    submod: nn.Module

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fsdp2_groups()

    def _fsdp2_groups(self) -> list[ParamGroup]:
        """The groups under the stage's module, each marked as driven by this stage (else
        its first forward refuses to run). Looked up at every call until they have all
        run a forward, then kept: a stage may be built, or given its module, before the
        module is sharded (torchtitan's ``pipeline_llm`` shards each chunk after building
        its stage, then reassigns ``stage.submod``)."""
        kept = self.__dict__.get("_fsdp2_kept")
        if kept is not None and kept[0] is self.submod:
            return kept[1]
        groups = groups_under(self.submod)
        for g in groups:
            g.mark_driven_by_stage()
        if groups and all(g.ctx is not None for g in groups):
            self.__dict__["_fsdp2_kept"] = (self.submod, groups)
        return groups

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        self._fsdp2_groups()  # sharded after the stage was built (torchtitan's pipeline_llm)
        return super().forward_maybe_with_nosync(*args, **kwargs)

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """The schedule's first call: shape inference runs a real forward."""
        self._fsdp2_groups()
        return super()._prepare_forward_infra(*args, **kwargs)  # type: ignore[safe-super]

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        groups = self._fsdp2_groups()
        for g in groups:  # Phase 1
            g.override_for_step(requires_gradient_sync=False, reshard_after_backward=False)
            if g.ctx is not None:
                g.ctx.root.override_for_step(is_last_backward=False)
            if backward_type != "full" and not g.held_by_user:
                # ``submod.parameters()`` must list the unsharded parameters autograd saw.
                g.hold_gathered()
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        for ctx in _contexts(self._fsdp2_groups()):  # Phase 2
            ctx.reduce_accumulated()
        super().perform_reduce_grad(grad_scale_factor)

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        """Shape inference runs a real backward: nothing of it is reduced."""
        for g in self._fsdp2_groups():
            g.override_for_step(requires_gradient_sync=False)
        return super()._prepare_backward_infra(*args, **kwargs)  # type: ignore[safe-super]

    def _post_metadata_inference_cleanup(self) -> None:
        """Shape inference ran a real forward and backward: forget all of it."""
        super()._post_metadata_inference_cleanup()  # type: ignore[misc]
        groups = self._fsdp2_groups()
        for ctx in _contexts(groups):
            ctx.reset()
        for g in groups:
            for p in g.params:
                p.sharded.grad = None  # type: ignore[union-attr]


class PipelineStage(_Fsdp2Stage, _TorchPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` for stages sharded with fsdp2: same
    arguments, same schedules; gradients are reduced once per step (see the module doc)."""


def adapt_stage(stage: Any) -> Any:
    """Give an existing pipeline stage (e.g. from ``build_stage``) fsdp2's behaviour, in place."""
    cls = type(stage)
    if not issubclass(cls, _Fsdp2Stage):
        stage.__class__ = type(f"Fsdp2{cls.__name__}", (_Fsdp2Stage, cls), {"__module__": __name__})
    stage._fsdp2_groups()
    return stage


def _contexts(groups: list[ParamGroup]) -> list[Any]:
    seen: list[Any] = []
    for g in groups:
        if g.ctx is not None and g.ctx not in seen:
            seen.append(g.ctx)
    return seen
