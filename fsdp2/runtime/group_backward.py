"""Phases 3 and 4 of a group's step (see ``group.py`` for all five): its backward.

Phase 3 (``pre_backward``, at the first gradient reaching an output of its forward)
gathers the parameters again if they were resharded and prefetches the group whose
backward runs next; Phase 4 (``post_backward``, when the last of its forward calls'
backward completed) reshards, moves the leaves' gradients into the reduce input and
issues the reduce. ``ParamGroup`` takes these methods from ``GroupBackward``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..bucket.bucket import FlatBucket
from ..params.spmd_annotations import paused_typecheck, pausing_typecheck
from .calls import BackwardCalls
from .group_setup import ShardState, TrainingState

# Backward prefetches of in-place buckets start behind the reduce in storage still in
# flight (``RootContext.reduce_in_flight``); False lets both hold memory at once.
PREFETCH_BEHIND_REDUCE = True


class GroupBackward:
    """Mixin of ``ParamGroup``: its backward phases. The attributes declared below are
    ``ParamGroup``'s, and so are ``unshard``, ``wait_for_unshard`` and ``reshard``."""

    buckets: list[FlatBucket]
    calls: BackwardCalls
    ctx: Any  # its root's ``StepContext`` once lazily initialized
    training_state: TrainingState
    shard_state: ShardState
    direct: bool
    unshard_in_backward: bool
    reshard_after_backward: bool
    requires_gradient_sync: bool
    requires_all_reduce: bool
    gradient_divide_factor: float | None

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.calls.started += 1
        with paused_typecheck():
            self.pre_backward()

    def pre_backward(self) -> None:
        ctx = self.ctx
        if ctx is None:
            raise AssertionError("fsdp2 internal error: expected ctx is not None")
        ctx.on_backward_start()
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
            self.wait_for_unshard()
        for b in self.buckets:
            b.reduce.set_leaf_grad_dtypes(reduces=self.requires_gradient_sync)
        # Overlaps this group's backward compute; behind the reduce still in flight, so
        # its gathered parameters take the memory that reduce frees (fsdp2.comm.collectives).
        after = ctx.reduce_in_flight() if PREFETCH_BEHIND_REDUCE else None
        for target in ctx.backward_prefetch_targets(self):
            target.unshard(after)
        ctx.free_unreferenced(self)

    @pausing_typecheck
    def post_backward_node(self, counted: bool) -> None:
        """``_PostBackward.backward``: one forward call's backward is complete."""
        if self.ctx is not None:
            self.ctx.on_backward_start()
        if counted:
            self.calls.pending -= 1
            # With gradients that may come without a node, e.g. from code that used the
            # leaves before this call's forward (after ``unshard()``), autograd may still
            # run that code's backward after this node: Phase 5 does Phase 4.
            if not self.calls.awaiting:
                self.post_backward()

    @pausing_typecheck
    def post_backward(self) -> None:
        """Phase 4: reshard, move the unsharded gradients into the reduce input and issue
        this group's reduce-scatters. Without synchronization, gradients stay in the
        leaves, except those computed in a dtype other than the reduce's: they
        accumulate in the reduce input, in ``reduce_dtype`` (as torch accumulates
        them), not in ``param_dtype`` micro-batch after micro-batch."""
        self.forget_calls()
        sync = self.requires_gradient_sync and not self.direct
        self.finalize_pending = not sync and not self.direct  # reduced by a manual finalize
        if self.reshard_after_backward:
            if sync:
                for b in self.buckets:
                    b.lend_storage()
            self.reshard()
        self.training_state = TrainingState.IDLE
        buckets = [b for b in self.buckets if sync or b.reduce_dtype != b.compute_dtype]
        if self.direct or not buckets:
            return  # direct: the end of backward hands the gradients over
        if self.ctx is None:
            raise AssertionError("fsdp2 internal error: expected self.ctx is not None")
        self.ctx.make_room_for_reduce(self)  # frees buffers before ours is taken
        for b in buckets:
            b.reduce.deposit_unsharded_grads(sync)
        if not sync:
            return
        for b in buckets:
            if b.reduce.has_reduced_params():
                if self.reshard_after_backward:
                    # Every rank decides alike here, whatever gradients it deposited
                    # (which ones a rank computed can depend on its data).
                    b.lend_storage()
                b.reduce.start(self.divide_factor(b), self.requires_all_reduce)
                self.ctx.add_pending_reduce(self, b)

    def has_backward_left(self) -> bool:
        """At the end of a backward: Phase 4 has yet to run for forward calls whose node
        never ran, gradients that came without one (``BackwardCalls.reduce_at_finalize``),
        or gradients that reached a leaf after the reduce was issued (a use outside the
        module after its backward)."""
        late = self.requires_gradient_sync and self.has_unsharded_grads()
        return not self.direct and (self.calls.awaiting or late)

    def has_unsharded_grads(self) -> bool:
        return any(b.reduce.has_unsharded_grads() for b in self.buckets)

    def forget_calls(self) -> None:
        self.calls.forget()

    def divide_factor(self, bucket: FlatBucket) -> float:
        """What ``bucket``'s reduced gradients are divided by: the ranks of its mesh (as
        torch divides each per-parameter mesh's group), or the user's factor."""
        return float(self.gradient_divide_factor or bucket.comm.dp_size)
