"""``FSDPModule``: the mixin every module ``fully_shard`` was applied to gains (its
methods tune the module's group: unshard/reshard, gradient sync, resharding, prefetch,
division), ``UnshardHandle``, ``register_fsdp_forward_method`` and ``share_comm_ctx``."""

from __future__ import annotations

import functools
import numbers
import sys
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch import nn

from . import _classes
from ._compat import TORCH
from ._validate import (
    check_bool,
    check_comm,
    check_not_quantized,
    check_one_mesh,
    cuda_event_types,
)
from .params.state_dict import validate_state_dict
from .runtime.adopt import rebind
from .runtime.group import ParamGroup, ShardState
from .runtime.root import GradientReductionHandle, RootContext
from .runtime.settings import check_reshard_after_forward
from .runtime.state import FSDPState

if TYPE_CHECKING:
    from .bucket.user_comm import AllGatherComm, ReduceScatterComm
    # For the checker, the mixin is what it always is mixed into (``fsdp_class``): a module.
    _MixedInto = nn.Module
else:
    _MixedInto = object


class FSDPModule(_MixedInto):
    """Mixin of every module ``fully_shard`` was applied to. Its methods below are grouped
    by what they tune: gathering, gradients, memory, the collectives themselves (torch
    2.13's names and signatures: some change what fsdp2 does, the rest tune how an
    accelerator's collectives are issued where fsdp2 issues every collective on the
    current stream from one flat buffer per group, or describe what it always does; those
    check their arguments and change nothing, each docstring says why), and state."""

    _fsdp2_state: FSDPState

    # ------------------------------------------------ construction and copying
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing a generated ``FSDP<Name>`` class (e.g. ``nn.Sequential``'s slicing,
        ``model[:2]``, builds ``type(self)(...)``) makes the original class: a new module
        fully_shard was not applied to, holding the same (sharded) children."""
        original = next(c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
        module = original.__new__(original)
        original.__init__(module, *args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise TypeError(
            "a fully_shard-ed module cannot be deep-copied: its parameters are shards tied to "
            "process groups; deepcopy the model before calling fully_shard"
        )

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            "a fully_shard-ed module cannot be pickled; save its state_dict() "
            "(e.g. with torch.distributed.checkpoint) instead"
        )

    # ------------------------------------------ gathering: unshard, reshard, recovery
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters; with ``async_op`` return a handle to wait on.

        Once gathered, the modules show the unsharded ``nn.Parameter``s. Called outside
        any forward, this opens a window for the caller's own computations: the
        parameters stay gathered (the module's forward does not free them) until
        ``reshard()`` or the end of the next backward, code may call inner modules
        directly, and the gradients it computes on them are reduced at the end of that
        backward. Called during a forward (to prefetch), the module's forward and
        backward free and reduce as usual."""
        async_op = check_bool("unshard(async_op=...)", async_op)
        group = self._fsdp2_state.group
        ctx = group.ctx  # None before the first forward (which makes the root)
        group.unshard()
        if ctx is None or not (ctx.active_forwards or ctx.in_backward):
            group.open_user_window()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters (a no-op when already sharded); ends the window
        an ``unshard()`` outside a forward opened."""
        group = self._fsdp2_state.group
        group.reshard()
        group.close_user_window()

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward: reshard everything and drop
        this iteration's gradients and pending communication; a ``GradientReductionHandle``
        not waited for becomes invalid. On torch 2.15, as torch's, the parameters' ``.grad``
        are dropped too (``fsdp2/_compat.py``)."""
        group = self._fsdp2_state.group
        clear = TORCH.reset_clears_grads
        if group.ctx is not None:
            group.ctx.reset(clear)  # resets every group under the root
            return
        for g in groups_under(self):  # before the first forward: no root context yet
            g.reset(clear)

    # ------------------------------------- gradients: when and how they are reduced
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. When ``False``,
        its reduce-scatters stay in flight and finish at the next last backward."""
        is_last_backward = check_bool("set_is_last_backward", is_last_backward)
        group = self._fsdp2_state.group
        # After the first forward any module of the model may say it (torch's state is
        # shared by the root's modules): it is the root's.
        (group.ctx.root if group.ctx is not None else group).settings.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root module: ``True`` makes the caller finalize backward. Groups still
        reduce during backward where they synchronize, but the end of a backward neither
        waits for those reduces nor writes ``.grad``, and groups whose gradients wait
        (accumulated without synchronization, or come without a node) stay pending;
        ``finalize_backward()``, called after all the backwards of one logical step,
        reduces those (per the current ``set_requires_gradient_sync`` /
        ``set_reshard_after_backward``), waits and writes ``.grad``. Supersedes
        ``set_is_last_backward``. Takes effect from the next backward; changing it during
        backward or between a backward and its finalize raises."""
        enabled = check_bool("set_manual_backward_finalization", enabled)
        group = self._fsdp2_state.group
        ctx = cast("RootContext | None", group.ctx)  # the root's (``RootContext.lazy_init``)
        if ctx is not None and ctx.root is not group:
            raise RuntimeError(
                "set_manual_backward_finalization must be called on the root module (the outermost module "
                f"fully_shard was applied to), not on {type(self).__name__}"
            )
        if ctx is not None and enabled != ctx.manual:
            if ctx.in_backward and torch._C._current_graph_task_id() != -1:
                raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
            if ctx.manual_active is not None:
                raise RuntimeError(
                    "set_manual_backward_finalization cannot change mode after backward started: call "
                    "finalize_backward() (or reset_iter_state()) first"
                )
        group.settings.manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """With manual finalization (``set_manual_backward_finalization(True)``), after
        all backwards of one step: reduce the gradients that wait, reshard, and (unless
        ``async_op``) wait and write ``.grad``. With ``async_op=True`` return a
        ``GradientReductionHandle`` whose ``wait()`` does the last part; call it before
        the next forward, finalize, or any use of the gradients. A no-op before the
        root's first forward; on the root module only."""
        async_op = check_bool("finalize_backward(async_op=...)", async_op)
        group = self._fsdp2_state.group
        ctx = cast("RootContext | None", group.ctx)  # the root's (``RootContext.lazy_init``)
        if ctx is None:
            return GradientReductionHandle() if async_op else None
        if ctx.root is not group:
            raise RuntimeError(
                "finalize_backward must be called on the root module (the outermost module fully_shard "
                f"was applied to), not on {type(self).__name__}"
            )
        return ctx.finalize(async_op)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False`` accumulates unsharded gradients locally without communication
        (gradient accumulation); the next backward with ``True`` reduces the sum."""
        requires_gradient_sync = check_bool("set_requires_gradient_sync", requires_gradient_sync)
        for g in self._target_groups(recurse):
            g.settings.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters gradients within the shard group but does not
        all-reduce them over the replicas; the sums wait, and the next backward with
        ``True`` all-reduces them together (gradient accumulation with less traffic).
        Nothing to do on a 1D mesh."""
        requires_all_reduce = check_bool("set_requires_all_reduce", requires_all_reduce)
        for g in self._target_groups(recurse):
            g.settings.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float | None) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of its mesh's size
        (each mesh's with per-parameter meshes); ``None`` goes back to that default. Only
        this module's, as torch's: call it on every ``FSDPModule`` (``for m in
        model.modules()``) to change them all."""
        if factor is not None:
            value = float(factor) if _is_real_number(factor) else None
            if value is None or not value > 0:
                raise ValueError(
                    f"set_gradient_divide_factor expects a positive number (or None: the mesh size), got {factor!r}"
                )
            factor = value
        self._fsdp2_state.group.settings.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    # ------------------------------- memory: when parameters are freed and gathered
    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (see ``fully_shard``) for later forwards."""
        if reshard_after_forward is None:
            raise ValueError("set_reshard_after_forward expects a bool or an int, got None")
        groups = self._target_groups(recurse)
        # Checked against every group's meshes before anything changes.
        values = []
        for g in groups:  # a loop, not a comprehension: warnings point at the caller (stacklevel)
            values.append(check_reshard_after_forward(reshard_after_forward, tuple(m.shard_size for m in g.meshes)))
        for g, value in zip(groups, values):
            g.set_reshard_after_forward(value)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps parameters unsharded after backward (saves the next forward's
        all-gather during gradient accumulation, at the cost of memory)."""
        reshard_after_backward = check_bool("set_reshard_after_backward", reshard_after_backward)
        for g in self._target_groups(recurse):
            g.settings.reshard_after_backward = reshard_after_backward

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """``True`` keeps the unsharded parameters' storage when resharding: the next
        unshard gathers into the same memory, so its data pointers stay the same across
        steps (what CUDA graph capture needs), at the cost of holding the full
        parameters. ``False`` (the default) frees it at each reshard, and frees now what
        a resharded group kept. (Parameters with an all-gather extension gather into
        their own tensors: those are not kept.)"""
        keep = check_bool("set_keep_unsharded_storage", keep)
        for g in self._target_groups(recurse):
            g.settings.collectives.keep_unsharded_storage = keep
            if not keep and g.shard_state in (ShardState.SHARDED, ShardState.PARTIAL):
                for b in g.buckets:
                    b.free_unsharded()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's parameters are not all-gathered for backward, for
        modules whose backward does not read them (e.g. an embedding: its weight's
        gradient needs only the indices). Gradients are reduced as usual."""
        unshard_in_backward = check_bool("set_unshard_in_backward", unshard_in_backward)
        self._fsdp2_state.group.settings.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in forward."""
        self._fsdp2_state.group.settings.forward_prefetch = _prefetch_groups("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in backward."""
        self._fsdp2_state.group.settings.backward_prefetch = _prefetch_groups("set_modules_to_backward_prefetch", modules)

    # ------------------------------------ collectives: hooks, custom collectives
    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None] | None, *, stream: Any = None) -> None:
        """Call ``hook(reduce_output)`` on this module's reduced gradients: after the
        reduce-scatter (1D mesh) or after the all-reduce over the replicas (HSDP), before
        they are written to ``.grad``. ``reduce_output`` is this rank's reduced row in the
        reduce dtype, modified in place by the hook (e.g. an all-reduce over another
        process group): the sharded gradients, then those of 0-dim parameters. It holds
        sums: fsdp2 divides afterwards (torch's NCCL path may average first; a linear
        hook gives the same result either way). With a hook, parameters no rank used get
        zero gradients (as with torch) rather than None. ``stream``: accepted on
        accelerators without native HSDP (fsdp2 runs the hook on the current stream);
        must be None on CPU. ``None`` removes the hook. Set it before training starts."""
        if hook is not None and not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable (or None: no hook), got {type(hook).__name__}")
        group = self._fsdp2_state.group
        check_one_mesh("set_all_reduce_hook", group, "hook")
        mesh = group.meshes[0]  # the one its parameters use (maybe not the call's own)
        if stream is not None:
            if mesh.is_hsdp:
                raise ValueError("set_all_reduce_hook(stream=...) cannot be set with native HSDP (a 2D mesh)")
            if mesh.device_type == "cpu":
                raise ValueError("set_all_reduce_hook(stream=...): streams exist on accelerators only; pass None on CPU")
        group.settings.collectives.all_reduce_hook = hook
        for b in group.buckets:
            b.update_direct()  # one rank without a dtype change: reduce (a copy) all the same

    def set_custom_all_gather(self, comm: AllGatherComm) -> None:
        """All-gather this module's parameters with ``comm`` (torch's ``AllGather``
        protocol: ``comm.allocate(size, dtype=..., device=...)`` for the output and
        ``comm(output_tensor, input_tensor, group, async_op=True)`` returning a work
        handle), instead of fsdp2's own gathers."""
        check_comm("set_custom_all_gather", comm)
        check_one_mesh("set_custom_all_gather", self._fsdp2_state.group, "collective")
        check_not_quantized("set_custom_all_gather", comm, self._fsdp2_state.group, "gather")
        self._fsdp2_state.group.settings.collectives.all_gather = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatterComm) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (torch's
        ``ReduceScatter`` protocol: ``comm.allocate(...)`` for the output and
        ``comm(output_tensor, input_tensor, group, op, async_op=True)``), called with
        ``ReduceOp.SUM`` on fsdp2's reduce input (each rank's row: gradients, "used"
        flags, 0-dim parameters' gradients). 0-dim parameters stay equal across ranks
        only if ``comm`` sums every element in the same rank order."""
        check_comm("set_custom_reduce_scatter", comm)
        check_one_mesh("set_custom_reduce_scatter", self._fsdp2_state.group, "collective")
        check_not_quantized("set_custom_reduce_scatter", comm, self._fsdp2_state.group, "reduce")
        group = self._fsdp2_state.group
        group.settings.collectives.reduce_scatter = comm
        for b in group.buckets:
            b.update_direct()

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """fsdp2 always reduces with ``ReduceOp.SUM`` and divides afterwards (no
        ``AVG`` or pre-scaling), so this changes nothing; checked for a bool."""
        check_bool("set_force_sum_reduction_for_comms", enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """``True``: trainable parameters that no rank computed a gradient for in a
        backward of their module get zero gradients instead of ``None`` (some optimizers
        and clipping code expect every parameter to have one). fsdp2 reduces unused
        parameters either way (as zeros with a zero "used" flag), so every rank issues the
        same collectives whatever its control flow, which is what torch needs this knob
        for; here it only decides ``None`` or zeros."""
        zero_unused = check_bool("set_reduce_scatter_unused_params", reduce_scatter_unused_params)
        for g in self._target_groups(recurse):
            g.settings.collectives.zero_unused = zero_unused

    def set_post_optim_event(self, event: torch.Event | None) -> None:
        """An event recorded after the optimizer step for the all-gather streams to wait
        on. fsdp2 issues its all-gathers on the current stream, after the step in stream
        order, so there is nothing to wait for: checked and dropped."""
        if event is not None and not isinstance(event, (torch.Event, *cuda_event_types())):
            raise TypeError(f"set_post_optim_event expects a torch.Event (or None), got {type(event).__name__}")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce inputs may be in flight at once. fsdp2 takes them from one pool
        shared by every group and keeps one reduce in flight while the next group's
        backward runs, which this knob does not change; checked for a positive int."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """A second communicator for reduce-scatters, so they overlap all-gathers on NCCL.
        fsdp2 issues both on the shard group; on gloo each collective already runs on its
        own thread. Checked for a bool; changes nothing."""
        check_bool("set_separate_reduce_scatter_group", enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory staging buffers for NCCL's all-gather. fsdp2 gathers from its
        own pooled buffers; checked (only ``"NCCL"``), changes nothing."""
        if not isinstance(backend, str) or backend.upper() != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Staging buffers from the process group's allocator (NCCL zero-copy). fsdp2's
        buffers come from its own pool; checked for a bool, changes nothing."""
        check_bool("set_allocate_memory_from_process_group_for_comm", enable)

    # ---------------------------------------------------- state: loading, _apply
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` that accepts sharded DTensors or full tensors, and
        checks the whole dict (keys, shapes, dtypes) before loading anything."""
        validate_state_dict(self, state_dict, strict)
        groups = groups_under(self)
        for g in groups:
            g.reshard()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:  # the dict's tensors replaced ours: copy them into our storage
            for g in groups:
                rebind(g)
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, reaching the sharded parameters' gradients also while
        the module shows its unsharded parameters (still gathered after a forward whose
        backward never ran: ``reshard_after_forward=False``, forward-mode AD). There
        ``parameters()`` lists the unsharded ones, and the sharded gradients would stay
        and take the next step's on top (torch's ``fully_shard`` does so)."""
        super().zero_grad(set_to_none)
        for group in groups_under(self):
            for p in group.params:
                grad = None if p.sharded is None else p.sharded.grad
                if grad is None:
                    continue
                if set_to_none:
                    p.sharded.grad = None  # type: ignore[union-attr]
                else:
                    grad.detach_() if grad.grad_fn is not None else grad.requires_grad_(False)
                    grad.zero_()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``to_empty``/``to``/``double`` replace parameter data: re-point it at our storage.
        group = self._fsdp2_state.group
        group.reshard()
        out = super()._apply(*args, **kwargs)
        rebind(group)
        return out

    def _get_fsdp_state(self) -> FSDPState:
        """torch 2.15's schedules (``defer_reduce_grad_wait``) tell stages apart by
        ``_get_fsdp_state()._comm_ctx``: this module's state, whose ``_comm_ctx`` is its
        own (fsdp2's roots share no communication context that could clash)."""
        return self._fsdp2_state

    def _target_groups(self, recurse: bool) -> list[ParamGroup]:
        return groups_under(self) if recurse else [self._fsdp2_state.group]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, group: ParamGroup | None = None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None and self._group.shard_state is ShardState.GATHERING:
            self._group.wait_for_unshard()
        self._group = None


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` inside the same unshard/reshard hooks as ``forward``
    (e.g. ``generate``). A no-op for modules ``fully_shard`` was not applied to."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register")
    state = module._fsdp2_state
    method = getattr(module, method_name)  # bound to ``module``, or a function set on it (a partial)

    @functools.wraps(getattr(method, "__func__", method))  # the signature as it was
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return state.call_registered(method, args, kwargs)

    setattr(module, method_name, types.MethodType(wrapped, module))


def groups_under(module: nn.Module) -> list[ParamGroup]:
    groups: list[ParamGroup] = []
    for sub in module.modules():
        state = sub.__dict__.get("_fsdp2_state")
        if state is not None and state.group not in groups:
            groups.append(state.group)
    return groups


def _prefetch_groups(method: str, modules: object) -> list[ParamGroup]:
    modules = _module_list(method, modules)
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{method} expects modules that fully_shard was applied to, got {type(m).__name__}; "
                "call fully_shard on it first or leave it out"
            )
    return [m._fsdp2_state.group for m in cast("list[FSDPModule]", modules)]  # each checked above


def fsdp_class(cls: type) -> type:
    """The generated ``FSDP<Name>`` subclass of ``(FSDPModule, cls)``, one per class,
    registered in ``fsdp2._classes`` so that it has an importable name."""
    if issubclass(cls, FSDPModule):
        return cls
    cached = _classes.generated.get(cls)
    if cached is not None:
        return cached
    name = f"FSDP{cls.__name__}"
    unique, n = name, 1
    while hasattr(_classes, unique):
        n += 1
        unique = f"{name}_{n}"
    new_cls = type(name, (FSDPModule, cls), {"__module__": _classes.__name__, "__qualname__": unique})
    setattr(sys.modules[_classes.__name__], unique, new_cls)
    _classes.generated[cls] = new_cls
    return new_cls


def share_comm_ctx(modules: Iterable[object]) -> None:
    """Share communication streams among several roots (pipeline stages). fsdp2's roots
    already share everything such a context holds (one buffer pool per device, the
    current stream), so this only checks that ``modules`` are fully_shard-ed."""
    for m in _module_list("share_comm_ctx", modules, ordered=False):
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx expects a list of FSDPModules, got {type(m).__name__}")


def _module_list(method: str, modules: object, ordered: bool = True) -> list[object]:
    """``modules`` as a list: any iterable of them (a list, a tuple, an ``nn.ModuleList``,
    a generator). Where the order matters (``ordered``: prefetch targets, gathered in
    it) a set is refused: its order differs between ranks, and so would the collectives."""
    if ordered and isinstance(modules, (set, frozenset)):
        raise TypeError(f"{method} got a set, whose order differs between ranks; pass a list of FSDPModule")
    if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList) or not isinstance(modules, Iterable):
        raise TypeError(f"{method} expects a list of FSDPModule, got {type(modules).__name__}")
    return list(modules)


def _is_real_number(value: object) -> bool:
    """A Python or NumPy real number, or a tensor of one element (not a bool)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool
    return isinstance(value, numbers.Real)
