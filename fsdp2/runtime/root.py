"""The root's step context: what every group under one root module shares for one
training step (lazy init, the forward order and prefetch targets, the reduces in
flight, the end-of-backward callback: Phase 5 of ``group.py``), and backward finalized
by the caller.

Manual finalization (``FSDPModule.set_manual_backward_finalization`` and
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

import functools
import sys
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable

from ..bucket.bucket import FlatBucket
from ..bucket.commit import run_post_accumulate_hooks
from ..params.shared import raise_deferred
from ..params.spmd_annotations import pausing_typecheck
from .adopt import adopt_reassigned
from .group import ParamGroup, ShardState, TrainingState
from .settings import PrefetchTarget
from .stages import refuse_foreign_stage

# Reduce-scatters allowed in flight before the oldest is waited for: bounds the
# pooled reduce buffers alive at once (each holds a full unsharded gradient) while
# the newest still overlaps the next group's backward. A group with several buckets
# (dtypes; meshes, with per-parameter meshes) issues them one after the other: each
# bucket's reduce overlaps the next one's issue and run, the last one the next group's
# backward. Waiting per group instead would keep every bucket's buffers through the
# next backward (+7% peak on tools/bench_moe.py's model, for no measured speed).
MAX_PENDING_REDUCES = 1


class GradientReductionHandle:
    """Returned by ``FSDPModule.finalize_backward(async_op=True)``: ``wait()`` waits for
    the gradient reduction, writes ``.grad`` and releases its buffers. Waiting twice is a
    no-op; waiting on a handle ``reset_iter_state()`` invalidated raises."""

    def __init__(self, ctx: RootContext | None = None) -> None:
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


class RootContext:
    """State shared by every group under one root module for one training step."""

    def __init__(self, root: ParamGroup, groups: list[ParamGroup]) -> None:
        self.root = root
        self.groups = groups
        self.in_backward = False
        # The mode the current backward iteration runs in, fixed when its first backward
        # starts (``None`` between iterations): the user's choice applies from the next one.
        self.manual_active: bool | None = None
        self.reduction: GradientReductionHandle | None = None  # an asynchronous finalize not waited for yet
        self.needs_reset = False  # a forward raised: reset at the next root forward
        self.active_forwards = 0  # pre_forwards without their post_forward yet
        self.open_methods = 0  # registered methods running (``FSDPState.call_registered``)
        self.forward_order: list[ParamGroup] = []
        self.position: dict[ParamGroup, int] = {}  # each group's index in ``forward_order``
        self.order_frozen = False
        self.pending_reduces: deque[tuple[ParamGroup, FlatBucket]] = deque()

    @staticmethod
    def lazy_init(root: ParamGroup, module: nn.Module) -> RootContext:
        """The first module to run forward is the root: it adopts every group below it."""
        if not root.in_pipeline_stage:
            refuse_foreign_stage(sys._getframe(1))
        groups: list[ParamGroup] = []
        for sub in module.modules():
            sub_state = sub.__dict__.get("_fsdp2_state")
            if sub_state is not None and sub_state.group not in groups and sub_state.group.ctx is None:
                groups.append(sub_state.group)
        raise_deferred([c for g in groups for c in g.shared_elsewhere], module)
        for g in groups:
            if g.settings.manual_finalization and g is not root:
                raise RuntimeError(
                    "set_manual_backward_finalization must be called on the root module (the outermost "
                    f"module fully_shard was applied to, here {type(module).__name__}), not on an inner one"
                )
        for g in groups:
            adopt_reassigned(g)
        ctx = RootContext(root, groups)
        ctx.watch_root_modules()
        fqns = {id(m): name for name, m in module.named_modules()}
        for g in groups:
            g.attach(ctx, [fqns.get(id(m)) or "" for m in g.modules])
        return ctx

    def watch_root_modules(self) -> None:
        """Modules that own the root's parameters below it get a forward pre-hook: one run
        in backward (an activation checkpoint's recompute) after the root was freed early
        (``free_unreferenced``) gathers it again (``regather_root``)."""
        hosts = {id(m) for m in self.root.modules}
        seen: set[int] = set()
        me = weakref.ref(self)
        for p in self.root.params:
            for module, _ in p.owners:
                if id(module) not in hosts and id(module) not in seen:
                    seen.add(id(module))
                    module.register_forward_pre_hook(functools.partial(_regather_root, me))

    def regather_root(self) -> None:
        root = self.root
        if self.in_backward and root.training_state is TrainingState.PRE_BACKWARD and root.shard_state is ShardState.SHARDED:
            root.unshard()  # every rank recomputes alike: the same all-gather
            root.wait_for_unshard()

    # ---------------------------------------------------------------- forward
    def start_iteration(self) -> None:
        """At the root's pre_forward: if the last forward or backward raised, start clean."""
        if self.in_backward:
            if _backward_interrupted(self):
                self.reset()
        elif self.active_forwards or self.needs_reset:
            self.reset()

    def record_forward(self, group: ParamGroup) -> None:
        if not self.order_frozen and group not in self.position:
            self.position[group] = len(self.forward_order)
            self.forward_order.append(group)

    def end_forward(self) -> None:
        """After the root's forward: the order is known; free prefetched, unused groups."""
        self.order_frozen = True
        for g in self.groups:
            if (
                g is not self.root
                and g.training_state is TrainingState.IDLE
                and g.frees_after_forward()
                and g.shard_state is not ShardState.SHARDED
            ):
                g.reshard()

    def forward_prefetch_targets(self, group: ParamGroup) -> Sequence[PrefetchTarget]:
        if group.settings.forward_prefetch is not None:
            return group.settings.forward_prefetch
        i = self.position.get(group, -1)
        if not self.order_frozen or i < 0 or i + 1 >= len(self.forward_order):
            return []
        return [self.forward_order[i + 1]]

    def backward_prefetch_targets(self, group: ParamGroup) -> Sequence[PrefetchTarget]:
        # Never one whose backward already started (the root): it was gathered then, and
        # if it was freed since (``free_unreferenced``), nothing needs it again.
        if group.settings.backward_prefetch is not None:
            return [
                t
                for t in group.settings.backward_prefetch
                if t.training_state is not TrainingState.PRE_BACKWARD and t.settings.unshard_in_backward
            ]
        i = self.position.get(group, -1)
        if i <= 0 or not self.order_frozen:
            return []
        target = self.forward_order[i - 1]
        waiting = target.calls.awaiting and target.settings.unshard_in_backward
        return [target] if waiting and target.training_state is not TrainingState.PRE_BACKWARD else []

    # --------------------------------------------------------------- backward
    def on_backward_start(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self.start_manual_iteration()
            Variable._execution_engine.queue_callback(pausing_typecheck(self.end_backward))

    def keeps_for_backward(self, group: ParamGroup) -> bool:
        """With the default ``reshard_after_forward=None``, the last group to run forward
        (not the root) keeps its parameters: its backward comes first, right after the
        loss, and would gather them straight back (torchtitan does the same by hand)."""
        return self.order_frozen and group is not self.root and self.forward_order[-1] is group

    def free_unreferenced(self, current: ParamGroup) -> None:
        """At each group's pre_backward: free the root, kept gathered, once nothing can
        read its parameters any more, instead of holding them until its own gradients
        arrive at the end."""
        if self.root is not current and self._root_unreferenced():
            self.root.reshard()

    def _root_unreferenced(self) -> bool:
        """The root (whose gradients wait for the end of backward) is still gathered, every
        forward call's backward started, and nothing can read its parameters any more:
        no tensor autograd saved or a custom Function kept refers to a leaf, and no view
        of the storage exists outside the buckets; e.g. after the output layer's
        backward, while every block's backward lies ahead. Not after a forward under
        saved-tensor hooks (activation checkpointing, offloading: autograd holds nothing
        now that a recompute will need); a root-owned module recomputed later gathers
        the root again (``regather_root``)."""
        root = self.root
        return (
            root.training_state is TrainingState.PRE_BACKWARD
            and root.calls.all_started  # no pre_backward to come
            and not root.calls.saved_by_hooks
            and root.shard_state is ShardState.UNSHARDED
            and root.reshard_after_backward
            and all(b.is_unsharded_unreferenced() for b in root.buckets)
            and all(p.is_unheld() for p in root.params)
        )

    def add_pending_reduce(self, group: ParamGroup, bucket: FlatBucket) -> None:
        self.pending_reduces.append((group, bucket))
        while len(self.pending_reduces) > MAX_PENDING_REDUCES:
            self._finish_oldest_reduce()

    def make_room_for_reduce(self, group: ParamGroup) -> None:
        """Before ``group`` deposits gradients: finish its own reduce-scatter still in flight
        (from an earlier backward with ``set_is_last_backward(False)``: it reads the buffer
        the deposit writes), and those beyond the allowed number in flight."""
        self.finish_reduces_of(group)
        while self.root.is_last_backward and len(self.pending_reduces) >= MAX_PENDING_REDUCES:
            self._finish_oldest_reduce()

    def reduce_in_flight(self) -> torch.futures.Future | None:
        """The newest reduce in storage still running, if any."""
        for _, b in reversed(self.pending_reduces):
            running = b.in_place.in_flight() if b.in_place is not None else None
            if running is not None:
                return running
        return None

    def finish_reduces_of(self, group: ParamGroup) -> None:
        """Wait for ``group``'s reduce-scatters in flight (and the older ones before them)."""
        while any(g is group for g, _ in self.pending_reduces):
            self._finish_oldest_reduce()

    def _finish_oldest_reduce(self) -> None:
        _, b = self.pending_reduces.popleft()
        b.reduce.finish()

    def end_backward(self) -> None:
        """Phase 5: runs once at the end of each backward over the root's graph (in
        manual mode only what does not reduce: ``defer_to_finalize``)."""
        if self.manual_active:
            self.defer_to_finalize()
            return
        for g in self.groups:
            if g.has_backward_left():
                g.post_backward()
        self._commit()
        self.in_backward = False
        self.manual_active = None

    def reduce_accumulated(self) -> None:
        """End of a gradient accumulation without synchronization driven from outside a
        backward (``fsdp2.pipelining``: after the last micro-batch): every group reduces
        what its leaves accumulated, as the end of a backward would, and reshards."""
        for g in self.groups:
            g.override_for_step(requires_gradient_sync=True, reshard_after_backward=True)
            if not g.direct:
                g.post_backward()  # every group on every rank: the same collectives
        self.root.override_for_step(is_last_backward=True)
        self._commit()
        for g in self.groups:
            g.end_overrides()  # the user's settings hold again

    def complete_backward(self) -> None:
        """The end of a manually finalized iteration: wait for every reduce, write ``.grad``."""
        try:
            self._commit(wait=True)
        except BaseException:
            self.needs_reset = True  # the next forward starts clean
            raise
        self.manual_active = None

    @pausing_typecheck
    def _commit(self, wait: bool = False) -> None:
        """Wait for the reduces (unless more backwards accumulate first), write ``.grad``."""
        if self.root.is_last_backward or wait:
            while self.pending_reduces:
                self._finish_oldest_reduce()
        given: list = []  # parameters given a gradient: their post-accumulate hooks run last
        for g in self.groups:
            if g.direct:
                g.forget_calls()
                if g.requires_gradient_sync:
                    ran = g.training_state is TrainingState.PRE_BACKWARD
                    for b in g.buckets:
                        given += b.commit.commit_direct(g.divide_factor(b), ran)
            for b in g.buckets:
                given += b.commit.commit()
            g.end_backward()
        run_post_accumulate_hooks(given)

    # ------------------------------------------------- manual finalization
    @property
    def manual(self) -> bool:
        """The mode of the backward under way, else the one the root asks for."""
        return self.root.settings.manual_finalization if self.manual_active is None else self.manual_active

    def start_manual_iteration(self) -> None:
        if self.manual_active is None:
            self.manual_active = self.root.settings.manual_finalization

    def check_no_reduction_pending(self, what: str) -> None:
        if self.reduction is not None:
            raise RuntimeError(f"The previous gradient reduction must be waited on before {what}")

    def defer_to_finalize(self) -> None:
        """Phase 1, at the end of each backward in manual mode. (A group on one rank
        without a dtype change, ``direct``, keeps its state: the commit reads it.)"""
        for g in self.groups:
            if not g.direct:
                g.defer_to_finalize()
        self.in_backward = False

    @pausing_typecheck
    def finalize(self, async_op: bool) -> GradientReductionHandle | None:
        """Phases 2 and 3 (``FSDPModule.finalize_backward``)."""
        self.check_no_reduction_pending("finalizing backward again")
        self._check_finalizable()
        try:
            for g in reversed(self.groups):
                if not g.direct:
                    g.finalize()
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
            pending = g.finalize_pending and g.requires_gradient_sync and not g.settings.requires_all_reduce
            if any(b.reduce.holds_partial() or (pending and b.comm.is_hsdp) for b in g.buckets):
                raise RuntimeError(
                    f"manual backward finalization does not support partial gradient reductions (HSDP with "
                    f"set_requires_all_reduce(False)) for the group {g.name!r}: call set_requires_all_reduce(True) "
                    "before the backward, or use automatic finalization"
                )

    def reset(self, clear_grads: bool = False) -> None:
        """Back to a clean step after an exception in forward or backward (``clear_grads``:
        the sharded and unsharded ``.grad`` go too, ``reset_iter_state()`` on torch 2.15)."""
        self.pending_reduces.clear()
        for g in self.groups:
            g.reset(clear_grads)
        self.in_backward = False
        self.needs_reset = False
        self.active_forwards = 0
        self.manual_active = None
        self.reduction = None  # a handle not waited for is invalid now


@torch.compiler.disable
def _regather_root(ctx_ref: weakref.ref, module: nn.Module, args: Any) -> None:
    ctx = ctx_ref()
    if ctx is not None:
        ctx.regather_root()


def _backward_interrupted(ctx: RootContext) -> bool:
    """True when a backward started but its end-of-backward callback never ran."""
    if not ctx.in_backward:
        return False
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is None or graph_task_id() == -1
