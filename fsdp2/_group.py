"""One ``fully_shard`` call's parameters: unshard, reshard, and the hooks' work.

Lifecycle of a group in one training step:

  Phase 1  pre_forward   all-gather (maybe already prefetched), prefetch the next
                         group, register unsharded views through ``_UnshardedParams``.
  Phase 2  post_forward  register the sharded parameters again, reshard per
                         ``reshard_after_forward``, hook the outputs for pre_backward.
  Phase 3  pre_backward  (first output gradient) all-gather again if resharded,
                         prefetch the group that runs backward next.
  Phase 4  post_backward (``_UnshardedParams.backward``, once every parameter and
                         input gradient of the forward call is computed) deposit the
                         gradients; after the last pending call: reshard and issue
                         the reduce-scatter.
  Phase 5  finalize      (root's end-of-backward callback) flush what never reached
                         Phase 4, wait for reduce-scatters, write ``.grad``.

On one rank without a dtype change (``direct``) there is nothing to gather or reduce:
Phase 1 registers leaf aliases of the shards, autograd accumulates their gradients, no
Phase 4 runs, and Phase 5 moves the gradients into ``.grad``.
"""

from __future__ import annotations

import operator
import weakref
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ._bucket import CommContext, FlatBucket
from ._param import FSDPParam
from ._tree import cast_floating, collect_tensors, map_tensors
from .api import MixedPrecisionPolicy

if TYPE_CHECKING:
    from ._state import RootContext


# Backward prefetches of in-place buckets start behind the reduce in storage still in
# flight (``RootContext.reduce_in_flight``); False lets both hold memory at once.
PREFETCH_BEHIND_REDUCE = True


class TrainingState(Enum):
    IDLE = auto()  # outside forward and backward
    FORWARD = auto()  # between pre_forward and post_forward of one of its modules
    PRE_BACKWARD = auto()  # gathered for backward; gradients not all computed yet


class ShardState(Enum):
    SHARDED = auto()  # only the sharded flat buffers hold data
    GATHERING = auto()  # all-gather issued, not waited for yet
    UNSHARDED = auto()  # unsharded flat buffers hold the full parameters
    PARTIAL = auto()  # after forward with an int reshard: W/N of the rows kept


class ParamGroup:
    """The parameters of one ``fully_shard`` call, bucketed by dtype."""

    def __init__(
        self,
        params: list[FSDPParam],
        originals: list[torch.Tensor],
        modules: list[nn.Module],
        comm: CommContext,
        device: torch.device,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | int | None,
    ) -> None:
        self.params = params
        self.modules = modules
        self.comm = comm
        self.mp_policy = mp_policy
        self.buckets: list[FlatBucket] = []
        self._bucket_of: dict[int, FlatBucket] = {}
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            compute = mp_policy.param_dtype if (mp_policy.param_dtype and dtype.is_floating_point) else dtype
            reduce = mp_policy.reduce_dtype if (mp_policy.reduce_dtype and dtype.is_floating_point) else compute
            bucket = FlatBucket(
                [params[i] for i in idx], [originals[i] for i in idx], comm, device, compute, reduce
            )
            self.buckets.append(bucket)
            for i in idx:
                self._bucket_of[id(params[i])] = bucket
        # Parameters each module of the group registers, for its own autograd node.
        self.module_params: dict[int, list[FSDPParam]] = {}
        for m in modules:
            inside = {id(sub) for sub in m.modules()}
            self.module_params[id(m)] = [
                p for p in params if any(id(owner) in inside for owner, _ in p.owners)
            ]
        self.set_name(type(modules[0]).__name__)
        self.reshard_after_forward_arg = reshard_after_forward  # None: decided at lazy init
        self.reshard_after_forward: bool | int = True if reshard_after_forward is None else reshard_after_forward
        self.partial_group: dist.ProcessGroup | None = None
        self.partial_index = 0
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None
        self.is_last_backward = True
        self.forward_prefetch: list[ParamGroup] | None = None  # explicit, overrides implicit
        self.backward_prefetch: list[ParamGroup] | None = None
        self.training_state = TrainingState.IDLE
        self.shard_state = ShardState.SHARDED
        self.pending_nodes = 0  # forward calls whose _UnshardedParams.backward has not run
        self.generation = 0  # bumped when pending_nodes restarts: older nodes no longer count
        # Forward calls whose outputs carry a pre_backward hook, and how many fired so far.
        self.hooked_calls = 0
        self.started_backward_calls = 0
        # A forward call ran under saved-tensor hooks (activation checkpointing, offloading):
        # autograd may not hold the parameters it needs, so the storage count proves nothing.
        self.saved_by_hooks = False
        self.order_index = -1  # position in the root's recorded forward order
        self.ctx: RootContext | None = None
        self._forwarded: set[int] = set()  # modules of the group done with forward this round
        self._checked_flats: list[torch.Tensor] = []  # sharded flats found materialized
        self._anchor = torch.empty(0, device=device if device.type != "meta" else "cpu", requires_grad=True)

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
        self._check_materialized()
        if self.ctx is not None and any(b.reduces_in_storage for b in self.buckets):
            self.ctx.finish_reduces_of(self)  # its storage still holds the gradients
        partial = self.partial_group if self.shard_state is ShardState.PARTIAL else None
        for b in self.buckets:
            b.start_all_gather(partial, after)
        self.shard_state = ShardState.GATHERING

    def wait_for_unshard(self) -> None:
        if self.shard_state is ShardState.GATHERING:
            for b in self.buckets:
                b.finish_all_gather()
            self.shard_state = ShardState.UNSHARDED
        elif self.shard_state is not ShardState.UNSHARDED:
            raise AssertionError(f"fsdp2 internal error: wait_for_unshard in state {self.shard_state}")

    def reshard(self) -> None:
        if self.shard_state is ShardState.SHARDED:
            return
        for b in self.buckets:
            b.reshard()
        self.shard_state = ShardState.SHARDED

    def _reshard_after_forward(self) -> None:
        value = self.reshard_after_forward
        if value is True:
            if self.frees_after_forward():
                self.reshard()
        elif value is not False and self.shard_state is ShardState.UNSHARDED:
            for b in self.buckets:
                b.reshard_partial(value, self.partial_index)
            self.shard_state = ShardState.PARTIAL

    def frees_after_forward(self) -> bool:
        """Its gathered parameters are freed once its forward is done."""
        return self.reshard_after_forward is True and not self.is_kept_for_backward()

    def is_kept_for_backward(self) -> bool:
        """With the default ``reshard_after_forward=None``, the last group to run forward
        (not the root) keeps its parameters: its backward comes first, right after the
        loss, and would gather them straight back (torchtitan does the same by hand)."""
        ctx = self.ctx
        return (
            self.reshard_after_forward_arg is None
            and ctx is not None
            and ctx.order_frozen
            and self is not ctx.root
            and ctx.forward_order[-1] is self
        )

    @property
    def direct(self) -> bool:
        """One rank, no dtype change: gradients accumulate in leaf aliases of the shards
        (see ``FlatBucket.direct``) with no autograd node or copy of ours in backward."""
        return all(b.direct for b in self.buckets)

    def _check_materialized(self) -> None:
        flats = [b.sharded_flat for b in self.buckets]
        if len(flats) == len(self._checked_flats) and all(map(operator.is_, flats, self._checked_flats)):
            return
        mesh_type = self.comm.mesh.device_type
        for b in self.buckets:
            device = b.sharded_flat.device
            if device.type not in ("meta", mesh_type):
                raise RuntimeError(
                    f"fsdp2: parameters of group '{self.name}' are on {device} but its mesh is on "
                    f"{mesh_type}; move the model with model.to({mesh_type!r}) or build the mesh "
                    f"for {device.type}"
                )
            if device.type == "meta":
                fqns = ", ".join(p.fqn for p in b.params[:3])
                raise RuntimeError(
                    f"fsdp2: parameters ({fqns}, ...) are still on the meta device at forward; "
                    "materialize them first with model.to_empty(device=...) and initialize them "
                    "(e.g. reset_parameters() or load_state_dict)"
                )
        self._checked_flats = flats

    def rebind(self) -> None:
        """After ``module._apply``: adopt the new parameter data, once every module of the
        group has been converted (``to_empty`` reaches the modules of a list one by one)."""
        self.reshard()
        self._checked_flats = []
        current = [p.owners[0][0]._parameters[p.owners[0][1]] for p in self.params]
        if len({(t.device, t.dtype if t.is_floating_point() else None) for t in current}) > 1:
            return  # another module's _apply will finish the conversion
        for b in self.buckets:
            b.rebind()

    # -------------------------------------------------------------------- forward
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = self.ctx
        assert ctx is not None, "fsdp2 internal error: forward before lazy init"
        recompute = ctx.in_backward  # activation checkpointing re-runs forward in backward
        if not recompute:
            self.training_state = TrainingState.FORWARD
            ctx.record_forward(self)
            self.saved_by_hooks = self.saved_by_hooks or _saved_tensor_hooks_active()
            for b in self.buckets:
                b.refresh_reduce_layout()
            if self.shard_state in (ShardState.UNSHARDED, ShardState.PARTIAL) and any(
                b.is_stale() for b in self.buckets
            ):
                # Still gathered from a forward whose backward never ran (the root, the
                # kept last block, reshard_after_forward=False or int) and the shards
                # changed since, e.g. an optimizer step: gather them afresh.
                self.reshard()
        self.unshard()
        self.wait_for_unshard()
        # Issued after our wait: the gather queue was busy with ours until now anyway,
        # and the prefetch can take the buffer ours just released.
        if not recompute:  # a recompute runs backward's order: the next layer is done
            for target in ctx.forward_prefetch_targets(self):
                target.unshard()
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return self._register_unsharded(module, args, kwargs, counted=not recompute)

    def _register_unsharded(
        self, module: nn.Module, args: tuple, kwargs: dict, counted: bool
    ) -> tuple[tuple, dict]:
        params = self.module_params[id(module)]
        if self.direct:
            for p in params:
                leaf = self._bucket_of[id(p)].direct_leaves[p.bucket_index]
                if leaf.requires_grad != p.sharded.requires_grad:  # type: ignore[union-attr]
                    leaf.requires_grad_(p.sharded.requires_grad)  # type: ignore[union-attr]
                p.register(leaf)
            return args, kwargs
        inputs = collect_tensors((args, kwargs), _requires_grad) if torch.is_grad_enabled() else []
        trainable = torch.is_grad_enabled() and any(p.sharded.requires_grad for p in params)  # type: ignore[union-attr]
        if not (inputs or trainable):
            # Fresh view objects when autograd may save them: a saved parameter must add a
            # reference to the storage, or ``is_unreferenced_in_backward`` would miss it.
            grad = torch.is_grad_enabled()
            for p in params:
                view = self._unsharded_view(p)
                p.register(view.view(view.shape) if grad else view)
            return args, kwargs
        outs = _UnshardedParams.apply(self, id(module), counted, self._anchor, *inputs)
        if counted:
            self.pending_nodes += 1
        for p, view in zip(params, outs):
            p.register(view)
        if inputs:
            routed = dict(zip(map(id, inputs), outs[len(params) :]))
            args, kwargs = map_tensors((args, kwargs), lambda t: routed.get(id(t), t))
        return args, kwargs

    def fresh_unsharded_views(self, module_key: int) -> list[torch.Tensor]:
        """New view objects of the unsharded parameters, for one autograd node's outputs."""
        return [v.view(v.shape) for v in map(self._unsharded_view, self.module_params[module_key])]

    def _unsharded_view(self, p: FSDPParam) -> torch.Tensor:
        """The persistent view of ``p`` in its bucket's unsharded flat buffer."""
        return self._bucket_of[id(p)].unsharded_views[p.bucket_index]

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        ctx = self.ctx
        assert ctx is not None
        for p in self.module_params[id(module)]:
            p.register_sharded()
        if ctx.in_backward:  # recompute: backward still needs the unsharded parameters
            return output
        self._forwarded.add(id(module))
        if len(self._forwarded) == len(self.modules):
            self._forwarded.clear()
            if torch.is_grad_enabled():
                self._reshard_after_forward()
                if self.shard_state is not ShardState.SHARDED:
                    for b in self.buckets:
                        b.note_kept()  # checked at the next forward (``pre_forward``)
            else:
                self.reshard()  # no backward follows a no-grad forward: keep nothing
            self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            tensors = collect_tensors(output, _requires_grad)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
                self.hooked_calls += 1
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        return output

    # ------------------------------------------------------------------- backward
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.started_backward_calls += 1
        self.pre_backward()

    def pre_backward(self) -> None:
        ctx = self.ctx
        assert ctx is not None
        ctx.on_backward_start()
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        self.wait_for_unshard()
        # Overlaps this group's backward compute; behind the reduce still in flight, so
        # its gathered parameters take the memory that reduce frees (fsdp2._collectives).
        after = ctx.reduce_in_flight() if PREFETCH_BEHIND_REDUCE else None
        for target in ctx.backward_prefetch_targets(self):
            target.unshard(after)
        ctx.free_unreferenced(self)

    def post_backward_node(self, module_key: int, grads: tuple, counted: bool) -> None:
        """``_UnshardedParams.backward``: gradients of one forward call are complete."""
        if self.ctx is not None:
            self.ctx.on_backward_start()
        if counted and self.pending_nodes <= 1 and self.reshard_after_backward:
            # Nothing reads the parameters now: free them before the copy-in, or sum the
            # gradients in their place.
            if self.requires_gradient_sync:
                for b in self.buckets:
                    b.lend_storage_for_reduce()
            self.reshard()
        if self.ctx is not None:
            self.ctx.make_room_for_reduce(self)  # frees buffers before ours is taken
        with torch.no_grad():
            for p, g in zip(self.module_params[module_key], grads):
                if g is not None:
                    self._bucket_of[id(p)].deposit(p, g)
        if counted:
            self.pending_nodes -= 1
            if self.pending_nodes <= 0:
                self.post_backward()

    def node_dropped(self, generation: int) -> None:
        """A counted node was freed without its backward running (a grad-enabled forward
        whose output was never backpropagated): stop waiting for it."""
        if generation == self.generation and self.pending_nodes > 0:
            self.pending_nodes -= 1

    def post_backward(self) -> None:
        """Phase 4's end: reshard and issue this group's reduce-scatters."""
        self.forget_calls()
        if self.reshard_after_backward:
            self.reshard()
        self.training_state = TrainingState.IDLE
        if not self.requires_gradient_sync:
            return
        for b in self.buckets:
            if b.has_reduced_params():
                if self.reshard_after_backward:
                    # Every rank decides alike here, whether or not its last node lent
                    # the storage already (which nodes ran can depend on the data).
                    b.lend_storage_for_reduce()
                b.start_reduce(self.divide_factor())
                assert self.ctx is not None
                self.ctx.add_pending_reduce(self, b)

    def forget_calls(self) -> None:
        """Start counting forward calls afresh; older nodes no longer count."""
        self.pending_nodes = 0
        self.generation += 1
        self.saved_by_hooks = False
        self.hooked_calls = self.started_backward_calls = 0

    def is_unreferenced_in_backward(self) -> bool:
        """Every forward call's backward started, its parameters are still gathered, and
        no tensor outside the group (nothing autograd saved) shares them any more: e.g. the
        root after the output layer's backward, while every block's backward lies ahead.
        Not after a forward under saved-tensor hooks: a checkpoint recompute would need
        the parameters again without holding them now."""
        return (
            self.training_state is TrainingState.PRE_BACKWARD
            and self.started_backward_calls >= self.hooked_calls  # no pre_backward to come
            and not self.saved_by_hooks
            and self.shard_state is ShardState.UNSHARDED
            and self.reshard_after_backward
            and all(b.is_unsharded_unreferenced() for b in self.buckets)
        )

    def divide_factor(self) -> float:
        return float(self.gradient_divide_factor or self.comm.world)

    def reset(self) -> None:
        """Forget this iteration: reshard, drop deposited gradients and pending work."""
        for b in self.buckets:
            b.drop_reduce_state()
        self.shard_state = ShardState.UNSHARDED if self.shard_state is ShardState.GATHERING else self.shard_state
        self.reshard()
        for p in self.params:
            p.register_sharded()
        self.forget_calls()
        self._forwarded.clear()
        self.training_state = TrainingState.IDLE


def _saved_tensor_hooks_active() -> bool:
    """Whether tensors autograd saves now go through ``saved_tensors_hooks`` (True when
    this build of torch cannot tell: the caller then stays conservative)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


def _node_freed(group: ParamGroup, count: list) -> None:
    if count[0]:
        count[0] = False
        group.node_dropped(count[1])


class _UnshardedParams(torch.autograd.Function):
    """Autograd node between the sharded world and one forward call of a module.

    Outputs: fresh views of the unsharded parameters (frozen ones non-differentiable),
    then the forward's inputs that require grad, passed through. Its backward runs once
    all of them have their gradients, i.e. after the module's whole backward: no op of
    the call can still read the unsharded parameters, so the group may reshard.
    """

    @staticmethod
    def forward(ctx: Any, group: ParamGroup, module_key: int, counted: bool, anchor: torch.Tensor, *inputs: torch.Tensor) -> tuple:  # type: ignore[override]
        ctx.group, ctx.module_key, ctx.n_inputs = group, module_key, len(inputs)
        ctx.set_materialize_grads(False)
        # [still counted, generation]; cleared when backward runs, else the finalizer
        # tells the group when the graph is freed without a backward.
        ctx.count = [counted, group.generation]
        if counted:
            weakref.finalize(ctx, _node_freed, group, ctx.count)
        views = group.fresh_unsharded_views(module_key)
        frozen = [v for v, p in zip(views, group.module_params[module_key]) if not p.sharded.requires_grad]  # type: ignore[union-attr]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return (*views, *inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        n_params = len(grads) - ctx.n_inputs
        counted = ctx.count[0] and ctx.count[1] == ctx.group.generation
        ctx.count[0] = False
        ctx.group.post_backward_node(ctx.module_key, grads[:n_params], counted)
        return (None, None, None, None, *grads[n_params:])
