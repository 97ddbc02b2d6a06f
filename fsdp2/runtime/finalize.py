"""Backward finalized by the caller (``FSDPModule.set_manual_backward_finalization`` and
``finalize_backward``, torch 2.15's API): the root's end-of-backward callback stops short
of the reduces, which run when the caller says, possibly after several backwards.

In manual mode a step runs:

  Phase 1  backwards      each backward's end-of-backward callback runs the groups
                          whose gradients came without a node only where they do not
                          synchronize; those that would reduce, and those that
                          accumulated without synchronization, wait (``finalize_pending``).
                          Nothing is written to ``.grad``.
  Phase 2  finalize       ``finalize_backward()``: the waiting groups reduce what their
                          leaves accumulated (per their current settings), the others
                          reshard per ``reshard_after_backward``.
  Phase 3  wait           at once, or at ``GradientReductionHandle.wait()`` with
                          ``async_op=True``: wait for the reduces, write ``.grad``, end
                          the iteration. Forward and another finalize refuse to run
                          before it; ``reset_iter_state()`` invalidates the handle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..params.spmd_annotations import pausing_typecheck
from .group_setup import TrainingState

if TYPE_CHECKING:
    from .group import ParamGroup


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: ``wait()`` waits for
    the gradient reduction, writes ``.grad`` and releases its buffers. Waiting twice is a
    no-op; waiting on a handle ``reset_iter_state()`` invalidated raises."""

    def __init__(self, ctx: ManualFinalization | None = None) -> None:
        self._ctx = ctx

    @pausing_typecheck
    def wait(self) -> None:
        ctx = self._ctx
        if ctx is None:
            return  # waited for already, or nothing to wait for
        if ctx.reduction is not self:
            raise RuntimeError(
                "This gradient reduction handle was invalidated (reset_iter_state() ran after "
                "finalize_backward(async_op=True)); its gradients were dropped"
            )
        self._ctx = None
        ctx.reduction = None
        ctx.complete_backward()


GradientReductionHandle.__module__ = "fsdp2"


class ManualFinalization:
    """The root context's side of manual finalization (a mixin of ``RootContext``)."""

    root: ParamGroup
    groups: list[ParamGroup]
    in_backward: bool
    # The mode the current backward iteration runs in, fixed when its first backward
    # starts (``None`` between iterations): the user's choice applies from the next one.
    manual_active: bool | None
    reduction: GradientReductionHandle | None  # an asynchronous finalize not waited for yet
    needs_reset: bool  # the next forward starts clean

    def complete_backward(self) -> None: ...  # RootContext: wait for reduces, write .grad

    @property
    def manual(self) -> bool:
        """The mode of the backward under way, else the one the root asks for."""
        return self.root.manual_finalization if self.manual_active is None else self.manual_active

    def start_manual_iteration(self) -> None:
        if self.manual_active is None:
            self.manual_active = self.root.manual_finalization

    def check_no_reduction_pending(self, what: str) -> None:
        if self.reduction is not None:
            raise RuntimeError(f"The previous gradient reduction must be waited on before {what}")

    def defer_to_finalize(self) -> None:
        """Phase 1, at the end of each backward in manual mode. (A group on one rank
        without a dtype change, ``direct``, keeps its state: the commit reads it.)"""
        for g in self.groups:
            if g.direct:
                continue
            if g.has_backward_left():
                if g.requires_gradient_sync:
                    g.forget_calls()
                    g.finalize_pending = True
                else:
                    g.post_backward()  # accumulates, and marks itself pending
            g.training_state = TrainingState.IDLE
        self.in_backward = False

    @pausing_typecheck
    def finalize(self, async_op: bool) -> GradientReductionHandle | None:
        """Phases 2 and 3 (``FSDPModule.finalize_backward``)."""
        self.check_no_reduction_pending("finalizing backward again")
        self._check_finalizable()
        try:
            for g in reversed(self.groups):
                if g.direct:
                    continue
                if g.finalize_pending and g.requires_gradient_sync:
                    g.post_backward()
                elif g.reshard_after_backward and not g.held_by_user:
                    g.reshard()
                g.training_state = TrainingState.IDLE
            if not async_op:
                self.complete_backward()
                return None
        except BaseException:
            self.needs_reset = True  # the next forward starts clean (its reset ends this iteration)
            raise
        self.reduction = GradientReductionHandle(self)
        return self.reduction

    def _check_finalizable(self) -> None:
        if not self.manual:
            raise RuntimeError(
                "finalize_backward requires manual backward finalization: call "
                "set_manual_backward_finalization(True) on the root module before forward"
            )
        if self.in_backward:
            during = torch._C._current_graph_task_id() != -1
            raise RuntimeError(
                "finalize_backward must be called after backward completes, not during it"
                if during
                else "finalize_backward: the last backward did not complete (it raised); call reset_iter_state()"
            )
        for g in self.groups:
            pending = g.finalize_pending and g.requires_gradient_sync and not g.requires_all_reduce
            if any(b.reduce.holds_partial() or (pending and b.comm.is_hsdp) for b in g.buckets):
                raise RuntimeError(
                    f"manual backward finalization does not support partial gradient reductions (HSDP with "
                    f"set_requires_all_reduce(False)) for the group {g.name!r}: call set_requires_all_reduce(True) "
                    "before the backward, or use automatic finalization"
                )
