"""One ``fully_shard`` call's parameters: unshard, reshard, and the hooks' work.

Visibility follows the shard state: while a group is unsharded (in forward, in
backward, after an explicit ``unshard()``, or kept gathered after forward) its modules
register the unsharded leaf ``nn.Parameter``s; once resharded, the sharded DTensors.
Whatever computes with the leaves (the module's forward, an activation checkpoint's
recompute outside fsdp2's hooks, a direct call of an inner module) accumulates into
their ``.grad``; the group moves those gradients into its reduce, once.

Lifecycle of a group in one training step:

  Phase 1  pre_forward   all-gather (maybe already prefetched), prefetch the next
                         group; the inputs pass through ``_PostBackward``.
  Phase 2  post_forward  reshard per ``reshard_after_forward``, hook the outputs for
                         pre_backward.
  Phase 3  pre_backward  (first output gradient) all-gather again if resharded,
                         prefetch the group that runs backward next.
  Phase 4  post_backward (``_PostBackward.backward`` of its last pending forward
                         call: every op of that call was created after the node, so
                         autograd has run them all and accumulated the parameters'
                         gradients) reshard, move the unsharded gradients into the
                         reduce input and issue the reduce-scatter.
  Phase 5  finalize      (root's end-of-backward callback) run Phase 4 for groups whose
                         gradients came without a node (no input needing grad, a
                         reentrant recompute, a direct call), wait for reduce-scatters,
                         write ``.grad``.

On one rank without a dtype change (``direct``) the leaves alias the shards: nothing is
gathered or reduced, no node of ours enters the graph, and Phase 5 moves the leaves'
gradients into ``.grad``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from enum import Enum, auto
from typing import Any, Protocol

import torch
import torch.nn as nn

from ..api import MixedPrecisionPolicy, OffloadPolicy
from ..bucket.bucket import FlatBucket
from ..comm.mesh import MeshInfo
from ..params.param import FSDPParam
from ..params.shared import SharedParam
from ..params.spmd_annotations import paused_typecheck, pausing_typecheck
from .calls import BackwardCalls, saved_tensor_hooks_active, settle_async_inputs
from .gathered import GatheredBlock
from .group_setup import UnshardChecks, build_buckets
from .settings import GroupSettings, PrefetchTarget, StepOverrides
from .tree import cast_floating

# Backward prefetches of in-place buckets start behind the reduce in storage still in
# flight (``RootContext.reduce_in_flight``); False lets both hold memory at once.
PREFETCH_BEHIND_REDUCE = True


class TrainingState(Enum):
    IDLE = auto()  # outside forward and backward
    FORWARD = auto()  # between pre_forward and post_forward of one of its modules
    PRE_BACKWARD = auto()  # gathered for backward; gradients not all computed yet


class ShardState(Enum):
    SHARDED = auto()  # only the sharded flat buffers hold data; modules show the DTensors
    GATHERING = auto()  # all-gather issued, not waited for yet; modules show the DTensors
    UNSHARDED = auto()  # unsharded flat buffers hold the full parameters; modules show the leaves
    PARTIAL = auto()  # after forward with an int reshard: W/N of the rows kept; the DTensors


class StepContext(Protocol):
    """What a group asks of the step context its root made at lazy init
    (``state.RootContext``, one layer up: it is handed to the group, not imported)."""

    root: ParamGroup
    in_backward: bool
    active_forwards: int
    needs_reset: bool  # a forward raised: reset at the next root forward

    def record_forward(self, group: ParamGroup) -> None: ...
    def forward_prefetch_targets(self, group: ParamGroup) -> Sequence[PrefetchTarget]: ...
    def backward_prefetch_targets(self, group: ParamGroup) -> Sequence[PrefetchTarget]: ...
    def on_backward_start(self) -> None: ...
    def keeps_for_backward(self, group: ParamGroup) -> bool: ...
    def free_unreferenced(self, current: ParamGroup) -> None: ...
    def add_pending_reduce(self, group: ParamGroup, bucket: FlatBucket) -> None: ...
    def make_room_for_reduce(self, group: ParamGroup) -> None: ...
    def reduce_in_flight(self) -> torch.futures.Future | None: ...
    def finish_reduces_of(self, group: ParamGroup) -> None: ...
    def reset(self, clear_grads: bool = False) -> None: ...


class ParamGroup:
    """The parameters of one ``fully_shard`` call, bucketed by dtype."""

    def __init__(
        self,
        params: list[FSDPParam],
        originals: list[torch.Tensor],
        modules: list[nn.Module],
        comm: MeshInfo,
        device: torch.device,
        settings: GroupSettings,
        shared_elsewhere: list[SharedParam] | None = None,
    ) -> None:
        self.params = params
        for p in params:
            p.group = weakref.ref(self)
        # Parameters typed with spmd_types, and their types (restored at each pre_forward).
        self.typed_params = [(p, p.annotation) for p in params if p.annotation is not None]
        self.modules = modules
        self.comm = comm
        self.settings = settings  # the user's choices, as given (``runtime/settings.py``)
        self.overrides = StepOverrides()  # a pipeline schedule's, while it drives the step
        self.buckets = build_buckets(
            params, originals, comm, device, settings.mp_policy, settings.offload_policy, settings.collectives
        )
        self.set_name(type(modules[0]).__name__)
        self._param_prefix = ""  # what parameter names are prefixed with in messages (at lazy init)
        self.set_reshard_after_forward(settings.reshard_after_forward)
        # Whether this group waits for the caller's finalize to reduce (manual finalization).
        self.finalize_pending = False
        self.training_state = TrainingState.IDLE
        self.shard_state = ShardState.SHARDED
        self.calls = BackwardCalls()
        # Gathered by an explicit ``unshard()``: code may compute with the leaves before,
        # between and after this group's forwards, so it stays gathered (and its reduce
        # waits) until the end of the next backward or ``reshard()``.
        self.held_by_user = False
        # An open ``fsdp2.gathered`` block over this group: the groups it admits stay
        # gathered after their forwards until it ends (``runtime/gathered.py``).
        self.gathered_block: GatheredBlock | None = None
        self.in_pipeline_stage = False  # run by an ``fsdp2.pipelining`` stage
        self.ctx: StepContext | None = None
        self._forwarded: set[int] = set()  # modules of the group done with forward this round
        self.checks = UnshardChecks()
        # Weak refs to optimizers whose fast-path step over this group is not undone yet
        # (it raised): the root's next forward undoes it (``optim.local_step``).
        self.unfinished_steps: list[weakref.ref] = []
        # Parameters an earlier call on a sibling module manages: raised at lazy init.
        self.shared_elsewhere: list[SharedParam] = shared_elsewhere or []

    # ------------------------------------------------- settings, as the step reads them
    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        return self.settings.mp_policy

    @property
    def offload_policy(self) -> OffloadPolicy | None:
        return self.settings.offload_policy

    @property
    def is_root(self) -> bool:
        """The group of the module whose forward ran first (known once lazy init made its
        step context)."""
        return self.ctx is not None and self.ctx.root is self

    @property
    def reshard_after_forward(self) -> bool | int:
        """The user's value as the step applies it: ``None`` frees the parameters after
        forward except on the root (the root context may keep the last group too:
        ``frees_after_forward``)."""
        value = self.settings.reshard_after_forward
        return (not self.is_root) if value is None else value

    @property
    def requires_gradient_sync(self) -> bool:
        value = self.overrides.requires_gradient_sync
        return self.settings.requires_gradient_sync if value is None else value

    @property
    def reshard_after_backward(self) -> bool:
        value = self.overrides.reshard_after_backward
        return self.settings.reshard_after_backward if value is None else value

    @property
    def is_last_backward(self) -> bool:
        value = self.overrides.is_last_backward
        return self.settings.is_last_backward if value is None else value

    def override_for_step(
        self,
        *,
        requires_gradient_sync: bool | None = None,
        reshard_after_backward: bool | None = None,
        is_last_backward: bool | None = None,
    ) -> None:
        """A driver of the step (a pipeline schedule) decides the values given here until
        ``end_overrides``; the user's settings stay as they were."""
        o = self.overrides
        if requires_gradient_sync is not None:
            o.requires_gradient_sync = requires_gradient_sync
        if reshard_after_backward is not None:
            o.reshard_after_backward = reshard_after_backward
        if is_last_backward is not None:
            o.is_last_backward = is_last_backward

    def end_overrides(self) -> None:
        self.overrides.clear()

    def set_reshard_after_forward(self, value: bool | int | None) -> None:
        """``value`` as ``check_reshard_after_forward`` returned it for every mesh of the
        group; an int's process groups are made now, by every rank alike."""
        self.settings.reshard_after_forward = value
        factor = value if isinstance(value, int) and not isinstance(value, bool) else None
        for b in self.buckets:
            b.gather.set_partial_factor(factor)

    def attach(self, ctx: StepContext, fqns: list[str]) -> None:
        """Lazy init: ``ctx`` (its root's) adopts the group, named after its modules."""
        self.ctx = ctx
        self.set_name(", ".join(fqn or "<root>" for fqn in fqns))
        # One module below the root: its parameters are named by their FQNs in messages.
        self._param_prefix = fqns[0] if len(fqns) == 1 and fqns[0] else ""

    def replace_buckets(self, buckets: list[FlatBucket]) -> None:
        """Buckets built anew (``adopt.py``: parameters that gained all-gather hooks)."""
        self.buckets = buckets
        self.set_name(self.name)

    def mark_driven_by_stage(self) -> None:
        self.in_pipeline_stage = True

    def note_unfinished_step(self, optimizer_ref: weakref.ref) -> None:
        self.unfinished_steps.append(optimizer_ref)

    def keep_unfinished_steps(self, keep: Callable[[weakref.ref], bool]) -> None:
        self.unfinished_steps = [r for r in self.unfinished_steps if keep(r)]

    @property
    def meshes(self) -> list[MeshInfo]:
        """The meshes its buckets shard over: one, or one per mesh that
        ``shard_placement_fn`` named (per-parameter meshes)."""
        return list({id(b.comm): b.comm for b in self.buckets}.values()) or [self.comm]

    def set_name(self, name: str) -> None:
        """Name used in messages: the module's FQN under the root, once known."""
        self.name = name
        for b in self.buckets:
            b.name = f"group '{name}' [{b.dtype}]"

    # ------------------------------------------------------------ unshard/reshard
    def unshard(self, after: torch.futures.Future | None = None) -> None:
        """Issue the all-gather (async); ``wait_for_unshard`` finishes it. Gathers in place
        start only once ``after`` (a reduce in storage) completed."""
        if self.shard_state in (ShardState.GATHERING, ShardState.UNSHARDED):
            return
        self.checks.run(self.buckets, self.params, self.comm.mesh.device_type, self.name, self._param_prefix)
        if self.ctx is not None and any(b.storage_lent for b in self.buckets):
            self.ctx.finish_reduces_of(self)  # its storage still holds the gradients
        from_partial = self.shard_state is ShardState.PARTIAL
        for b in self.buckets:
            b.start_all_gather(from_partial, after)
        self.shard_state = ShardState.GATHERING

    def wait_for_unshard(self) -> None:
        """Finish the all-gather; from now on the modules show the unsharded leaves."""
        if self.shard_state is ShardState.GATHERING:
            for b in self.buckets:
                b.finish_all_gather()
            self.shard_state = ShardState.UNSHARDED
            for p in self.params:
                leaf = p.unsharded
                if leaf is None or p.sharded is None or leaf.requires_grad != p.sharded.requires_grad:
                    p.register_unsharded()  # checks, and settles a changed requires_grad
                else:
                    for module, name in p.owners:  # ``register``, inlined: every param, every unshard
                        module._parameters[name] = leaf
        elif self.shard_state is not ShardState.UNSHARDED:
            raise AssertionError(f"fsdp2 internal error: wait_for_unshard in state {self.shard_state}")

    def reshard(self) -> None:
        if self.shard_state is ShardState.SHARDED:
            return
        for b in self.buckets:
            b.reshard()
        self._show_sharded(ShardState.SHARDED)

    def hold_gathered(self) -> None:
        """Gather now and stay gathered (forwards do not free) until the next reshard."""
        self.unshard()
        self.wait_for_unshard()
        self.held_by_user = True

    def reshard_if_idle(self) -> None:
        """Reshard a group left gathered between steps (kept after a forward no backward
        followed, after backward, or by ``unshard()``) before the shards change or are
        saved, so nobody sees a stale gathered copy; a no-op during forward or backward."""
        in_step = self.ctx is not None and (self.ctx.in_backward or self.ctx.active_forwards)
        if self.training_state is TrainingState.IDLE and not in_step:
            self.reshard()

    def open_gathered_block(self, block: GatheredBlock) -> None:
        self.gathered_block = block

    def close_gathered_block(self) -> None:
        self.gathered_block = None

    def gathered_bytes(self) -> int:
        """Bytes its unsharded parameters take while gathered (none where the gathered
        parameters are the shards themselves: one rank, no dtype change)."""
        return sum(
            0 if b.gather_is_identity else b.unsharded_flat.numel() * b.unsharded_flat.element_size()
            for b in self.buckets
        )

    def end_of_gathered_block(self) -> None:
        """Reshard what a ``gathered`` block kept, once its own forward is done: also when
        the block ends inside a forward still running (a registered ``generate`` inside
        ``register_fsdp_forward_method``'s hooks; a later backward gathers it again) and
        after a forward that raised inside the block. Not during a backward, not a group
        whose gather is still in flight (after an exception the recovery at the next
        forward drops it, rather than this waiting on it), not one ``unshard()`` holds."""
        ctx = self.ctx
        if self.held_by_user or self.shard_state is ShardState.GATHERING:
            return
        raised = ctx is not None and ctx.needs_reset
        in_backward = ctx is not None and ctx.in_backward
        if (self.training_state is TrainingState.IDLE or raised) and not in_backward:
            self.reshard()

    def _kept_by_block(self) -> bool:
        """At the end of a forward: an open ``gathered`` block keeps this group gathered
        (decided at its first forward in the block)."""
        return self.gathered_block is not None and self.gathered_block.keeps(self)

    def _show_sharded(self, state: ShardState) -> None:
        self.held_by_user = False
        self.shard_state = state
        for p in self.params:
            p.register_sharded()

    def frees_after_forward(self) -> bool:
        """Its gathered parameters are freed once its forward is done."""
        return (
            self.reshard_after_forward is True
            and not self.held_by_user
            and not (self.gathered_block is not None and self.gathered_block.has_admitted(self))
            and not (
                self.settings.reshard_after_forward is None and self.ctx is not None and self.ctx.keeps_for_backward(self)
            )
        )

    @property
    def direct(self) -> bool:
        """One rank, no dtype change: the leaves alias the shards (see
        ``FlatBucket.direct``), with no autograd node or copy of ours in backward."""
        return all(b.direct for b in self.buckets)

    # -------------------------------------------------------------------- forward
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = self.ctx
        if ctx is None:
            raise AssertionError("fsdp2 internal error: forward before lazy init")
        recompute = ctx.in_backward  # activation checkpointing re-runs forward in backward
        with paused_typecheck():  # our gathers and copies; the model's tensors stay typed
            self._gather_for_forward(module, ctx, recompute)
        for p, annotation in self.typed_params:
            annotation.restore(p.unsharded)
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = settle_async_inputs(args, kwargs)
        if self.direct or not torch.is_grad_enabled() or not any(b.reduce.has_reduced_params() for b in self.buckets):
            return args, kwargs
        if recompute:
            # A reentrant checkpoint's recompute, whose forward ran without grad: its
            # gradients reach the leaves inside this backward, with no node counted.
            # (A non-reentrant recompute only refills saved tensors: its group has nodes.)
            self.calls.reduce_at_finalize = self.calls.reduce_at_finalize or self.calls.pending == 0
            return args, kwargs
        return self.calls.route_inputs(self, args, kwargs)

    def _gather_for_forward(self, module: nn.Module, ctx: StepContext, recompute: bool) -> None:
        """Gather the parameters (afresh if the shards changed while they were kept) and
        prefetch the next groups' on the first of the group's modules."""
        # The group's forward begins (not a later module of the same group forward, e.g.
        # the head of [final norm, embedding, head]: its next group ran and was freed).
        begins = self.training_state is not TrainingState.FORWARD or id(module) in self._forwarded
        if not recompute:
            self.training_state = TrainingState.FORWARD
            ctx.record_forward(self)
            self.calls.saved_by_hooks = self.calls.saved_by_hooks or saved_tensor_hooks_active()
            for b in self.buckets:
                b.reduce.refresh_layout()
            if self.shard_state in (ShardState.UNSHARDED, ShardState.PARTIAL) and any(
                b.kept.is_stale() for b in self.buckets
            ):
                # Still gathered from a forward whose backward never ran (the root, the
                # kept last block, reshard_after_forward=False or int) and the shards
                # changed since, e.g. an optimizer step: gather them afresh.
                self.reshard()
        self.unshard()
        self.wait_for_unshard()
        # Issued after our wait: the gather queue was busy with ours until now anyway,
        # and the prefetch can take the buffer ours just released.
        if not recompute and begins:  # a recompute runs backward's order: the next layer is done
            for target in ctx.forward_prefetch_targets(self):
                target.unshard()

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        ctx = self.ctx
        if ctx is None:
            raise AssertionError("fsdp2 internal error: expected ctx is not None")
        if ctx.in_backward:  # recompute: backward still needs the unsharded parameters
            return self._cast_output(output)
        self._forwarded.add(id(module))
        if len(self._forwarded) == len(self.modules):
            self._forwarded.clear()
            with paused_typecheck():
                self._end_forward()
        if torch.is_grad_enabled():
            with paused_typecheck():  # registering hooks computes nothing on the model's values
                self.calls.hook_outputs(output, self._pre_backward_hook)
        return self._cast_output(output)

    def _end_forward(self) -> None:
        """The last of the group's modules ran forward: reshard or keep the parameters."""
        value = self.reshard_after_forward
        if self.held_by_user or self._kept_by_block():
            pass  # gathered by unshard() for the caller's own computations, or a gathered block: kept
        elif value is True:
            if self.frees_after_forward() or not torch.is_grad_enabled():
                self.reshard()  # without grad no backward follows: the kept last block is not kept
        elif value is not False and self.shard_state is ShardState.UNSHARDED:
            # An int keeps ``value`` ranks' rows. False (the root's default) keeps all: also
            # across no-grad forwards (every token of a generation) until the next
            # backward, reshard() or optimizer step.
            for b in self.buckets:
                b.reshard_partial(value)
            self._show_sharded(ShardState.PARTIAL)
        if self.shard_state is not ShardState.SHARDED and not self.held_by_user:
            for b in self.buckets:
                b.kept.remember_shards_version()  # checked at the next forward (``pre_forward``)
        self.training_state = TrainingState.IDLE

    def _cast_output(self, output: Any) -> Any:
        """Cast as the policy says, in forward and in a checkpoint's recompute alike."""
        if self.mp_policy.output_dtype is not None:
            return cast_floating(output, self.mp_policy.output_dtype)
        return output

    # ------------------------------------------------------------------- backward
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
        if self.settings.unshard_in_backward:
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
                b.reduce.start(self.divide_factor(b), self.settings.requires_all_reduce)
                self.ctx.add_pending_reduce(self, b)

    def end_backward(self) -> None:
        """After the commit at the end of a backward: an ``unshard()`` window ends with it;
        reshard per ``reshard_after_backward``."""
        self.held_by_user = False
        if self.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def defer_to_finalize(self) -> None:
        """Manual finalization, at the end of each backward (``RootContext.defer_to_finalize``):
        what would reduce waits for the caller's finalize; what accumulates does."""
        if self.has_backward_left():
            if self.requires_gradient_sync:
                self.forget_calls()
                self.finalize_pending = True
            else:
                self.post_backward()  # accumulates, and marks itself pending
        self.training_state = TrainingState.IDLE

    def finalize(self) -> None:
        """Manual finalization, at the caller's ``finalize_backward()``: reduce what
        waits, or reshard per ``reshard_after_backward``."""
        if self.finalize_pending and self.requires_gradient_sync:
            self.post_backward()
        elif self.reshard_after_backward and not self.held_by_user:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def open_user_window(self) -> None:
        """``unshard()`` outside a forward: the parameters stay gathered for the caller's
        own computations, whose gradients may come without a forward of ours."""
        self.held_by_user = True
        self.calls.reduce_at_finalize = True

    def close_user_window(self) -> None:
        """``reshard()`` outside a step: gradients no longer come without a forward."""
        if self.training_state is TrainingState.IDLE and not (self.ctx is not None and self.ctx.in_backward):
            self.calls.reduce_at_finalize = False

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
        return float(self.settings.gradient_divide_factor or bucket.comm.dp_size)

    def reset(self, clear_grads: bool = False) -> None:
        """Forget this iteration: reshard, drop deposited gradients and pending work (and
        with ``clear_grads`` every ``.grad`` of its parameters)."""
        for b in self.buckets:
            b.drop_state()
        if self.shard_state is ShardState.GATHERING:
            self.shard_state = ShardState.UNSHARDED
        self.reshard()
        self.forget_calls()
        self._forwarded.clear()
        self.finalize_pending = False
        self.training_state = TrainingState.IDLE
        if clear_grads:
            for p in self.params:
                p.clear_grads()


