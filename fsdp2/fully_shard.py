"""``fully_shard``: validate -> collect parameters -> build the group -> hooks -> swap class.

Also the ``FSDPModule`` mixin that the swapped class gains, ``UnshardHandle`` and
``register_fsdp_forward_method``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _classes
from ._group import ParamGroup, ShardState, TrainingState
from ._knobs import CommKnobs, check_bool
from ._mesh import MeshInfo, SpmdDims, mesh_device, shard_size
from ._param import FSDPParam, sharded_owner, unsharded_owner
from ._state import FSDPState
from ._shared import SharedParam, find_under, shared_error
from ._state_dict import register_state_dict_hooks, validate_state_dict
from .optim import local_step
from .api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

# id(original parameter) -> (weak refs to it and to the FSDPParam that replaced it): an
# optimizer still holding one was created too early (checked at optimizer.step()).
_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[FSDPParam]]] = {}


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters over ``mesh`` in place and return ``module``.

    Parameters under ``module`` that no earlier (bottom-up) call manages form one
    group: they are all-gathered in one collective before the module's forward and
    their gradients reduce-scattered in one collective after its backward. Each
    becomes an ``nn.Parameter`` holding a DTensor sharded on dim 0 (or the dim
    ``shard_placement_fn`` gives; 0-dim ones ``Replicate()``) under its original name;
    a tensor-parallel DTensor parameter lives on the data-parallel and TP dims together.
    ``module``'s class is swapped to a subclass of ``FSDPModule`` and of its original class.

    Args:
        module: a module, or a list of modules sharing one group.
        mesh: 1D DeviceMesh (FSDP) or 2D DeviceMesh (HSDP), whose dims are
            ``(replicate, shard)`` in this order, named or not; ``None`` means the
            default process group on the default device type.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward
            (re-gathered in backward), ``False`` keeps them, an int ``N`` keeps
            ``1/N`` of them so the backward all-gather runs over ``N`` ranks (a
            divisor of the shard size other than 1 and the size). ``None``: ``True``,
            except ``False`` for the root module and for the last module to run
            forward, whose backward comes first.
        shard_placement_fn: may return ``None`` (dim 0) or ``Shard(d)`` per parameter,
            any dim, negative too; sizes need not divide the shard count.
        mp_policy: mixed precision, see ``MixedPrecisionPolicy``.
        offload_policy: ``OffloadPolicy()`` or ``CPUOffloadPolicy()``.
        ignored_params: parameters left plain: not sharded, not synchronized.
        dp_mesh_dims: with ``mesh`` the full SPMD mesh (e.g. ``('dp', 'tp')``) whose
            parameters are already DTensors on it, replicated over the dims named here:
            ``shard`` (one name, or several flattened into one) and optionally
            ``replicate`` (HSDP). Their shards stay DTensors on that mesh (``Shard`` or
            ``_StridedShard`` on the shard dim); gradient placements on the data-parallel
            dims (e.g. ``Partial`` from a batch sharded there) are left to the reduce.
    """
    modules = _validate_modules(module)
    mesh = _default_mesh() if mesh is None else mesh
    spmd: SpmdDims | None = None
    if dp_mesh_dims is not None:
        mesh, spmd = SpmdDims.split(mesh, _validate_dp_mesh_dims(dp_mesh_dims, mesh))
    _validate_mesh(mesh)
    reshard_after_forward = _reshard_after_forward_value(reshard_after_forward, shard_size(mesh, spmd))
    mp_policy, offload_policy = _validate_policies(mp_policy, offload_policy, mesh)
    ignored = _validate_ignored(ignored_params)
    owners, fqns, shared = _collect_params(modules, ignored)
    params = list(owners)
    if spmd is not None:
        _validate_spmd_params(params, fqns, spmd)
    dims = _shard_dims(params, fqns, shard_placement_fn, mesh, spmd is None)

    device = mesh_device(mesh)
    info = MeshInfo.from_mesh(mesh, spmd)
    fsdp_params = [FSDPParam(fqns[p], owners[p], p, info, dim) for p, dim in zip(params, dims)]
    shard_device = torch.device("meta") if any(p.device.type == "meta" for p in params) else device
    group = ParamGroup(
        fsdp_params, params, modules, info, shard_device, mp_policy, reshard_after_forward, offload_policy
    )
    group.shared_elsewhere = shared
    _move_buffers(modules, device)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        group.partial_group, group.partial_index = info.partial_group(reshard_after_forward)
    for fp, original in zip(fsdp_params, params):
        fp.register_sharded()
        _remember(_REPLACED, id(original), (weakref.ref(original), weakref.ref(fp)))
    register_state_dict_hooks(fsdp_params)
    local_step.install_hooks(_pre_optimizer_step)
    for m in modules:
        m.__dict__["_fsdp2_state"] = FSDPState(m, group)
        m.register_state_dict_pre_hook(functools.partial(_show_sharded_for_state_dict, weakref.ref(group)))
        m.register_state_dict_post_hook(functools.partial(_show_current_after_state_dict, weakref.ref(group)))
        m.__class__ = _fsdp_class(type(m))
    return module


# ---------------------------------------------------------------------- FSDPModule
class FSDPModule(CommKnobs):
    """Mixin of every module ``fully_shard`` was applied to."""

    _fsdp2_state: FSDPState

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Constructing a generated ``FSDP<Name>`` class (e.g. ``nn.Sequential``'s slicing,
        ``model[:2]``, builds ``type(self)(...)``) makes the original class: a new module
        fully_shard was not applied to, holding the same (sharded) children."""
        original = next(c for c in cls.__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
        module = original.__new__(original)
        module.__init__(*args, **kwargs)
        return module

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            "a fully_shard-ed module cannot be deep-copied: its parameters are shards tied to "
            "process groups; deepcopy the model before calling fully_shard"
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "a fully_shard-ed module cannot be pickled; save its state_dict() "
            "(e.g. with torch.distributed.checkpoint) instead"
        )

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters; with ``async_op`` return a handle to wait on.

        Once gathered, the modules show the unsharded ``nn.Parameter``s. Called outside
        any forward, this opens a window for the caller's own computations: the
        parameters stay gathered (the module's forward does not free them) until
        ``reshard()`` or the end of the next backward, code may call inner modules
        directly, and the gradients it computes on them are reduced at the end of that
        backward. Called during a forward (to prefetch), the module's forward and
        backward free and reduce as usual."""
        if not isinstance(async_op, bool):
            raise TypeError(f"unshard(async_op=...) expects a bool, got {type(async_op).__name__}")
        group = self._fsdp2_state.group
        ctx = group.ctx  # None before the first forward (which makes the root)
        group.unshard()
        if ctx is None or not (ctx.active_forwards or ctx.in_backward):
            group.held_by_user = True
            group.calls.reduce_at_finalize = True  # gradients may come without a forward of ours
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
        if group.training_state is TrainingState.IDLE and not (group.ctx is not None and group.ctx.in_backward):
            group.calls.reduce_at_finalize = False

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward: reshard everything and drop
        this iteration's gradients and pending communication."""
        group = self._fsdp2_state.group
        if group.ctx is not None:
            group.ctx.reset()  # resets every group under the root
            return
        for g in _groups_under(self):  # before the first forward: no root context yet
            g.reset()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. When ``False``,
        its reduce-scatters stay in flight and finish at the next last backward."""
        check_bool("set_is_last_backward", is_last_backward)
        group = self._fsdp2_state.group
        if group.ctx is not None and group.ctx.root is not group:
            raise RuntimeError(
                "set_is_last_backward must be called on the root module (the outermost module "
                f"fully_shard was applied to), not on {type(self).__name__}"
            )
        group.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False`` accumulates unsharded gradients locally without communication
        (gradient accumulation); the next backward with ``True`` reduces the sum."""
        check_bool("set_requires_gradient_sync", requires_gradient_sync)
        for g in self._target_groups(recurse):
            g.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters gradients within the shard group but does not
        all-reduce them over the replicas; the sums wait, and the next backward with
        ``True`` all-reduces them together (gradient accumulation with less traffic).
        Nothing to do on a 1D mesh."""
        check_bool("set_requires_all_reduce", requires_all_reduce)
        for g in self._target_groups(recurse):
            g.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (see ``fully_shard``) for later forwards."""
        group = self._fsdp2_state.group
        reshard_after_forward = _reshard_after_forward_value(reshard_after_forward, group.comm.shard_size)
        if reshard_after_forward is None:
            raise ValueError("set_reshard_after_forward expects a bool or an int, got None")
        partial = None
        if not isinstance(reshard_after_forward, bool):
            partial = group.comm.partial_group(reshard_after_forward)
        for g in self._target_groups(recurse):
            g.reshard_after_forward = reshard_after_forward
            g.reshard_after_forward_arg = reshard_after_forward
            if partial is not None:
                g.partial_group, g.partial_index = partial

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps parameters unsharded after backward (saves the next forward's
        all-gather during gradient accumulation, at the cost of memory)."""
        check_bool("set_reshard_after_backward", reshard_after_backward)
        for g in self._target_groups(recurse):
            g.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's parameters are not all-gathered for backward, for
        modules whose backward does not read them (e.g. an embedding: its weight's
        gradient needs only the indices). Gradients are reduced as usual."""
        check_bool("set_unshard_in_backward", unshard_in_backward)
        self._fsdp2_state.group.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in forward."""
        self._fsdp2_state.group.forward_prefetch = _prefetch_groups("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters right after this module's, in backward."""
        self._fsdp2_state.group.backward_prefetch = _prefetch_groups("set_modules_to_backward_prefetch", modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the mesh size."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive number, got {factor!r}")
        for g in self._target_groups(True):
            g.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` that accepts sharded DTensors or full tensors, and
        checks the whole dict (keys, shapes, dtypes) before loading anything."""
        validate_state_dict(self, state_dict, strict)  # type: ignore[arg-type]
        groups = _groups_under(self)  # type: ignore[arg-type]
        for g in groups:
            g.reshard()
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
        if assign:  # the dict's tensors replaced ours: copy them into our storage
            for g in groups:
                g.rebind()
        return result

    def _target_groups(self, recurse: bool) -> list[ParamGroup]:
        return _groups_under(self) if recurse else [self._fsdp2_state.group]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``to_empty``/``to``/``double`` replace parameter data: re-point it at our storage.
        group = self._fsdp2_state.group
        group.reshard()
        out = super()._apply(*args, **kwargs)  # type: ignore[misc]
        group.rebind()
        return out


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
    original = getattr(module, method_name).__func__

    @functools.wraps(original)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(args, kwargs)
        try:
            output = original(self, *args, **kwargs)
        except BaseException:
            state.on_forward_exception()
            raise
        return state.post_forward(output)

    setattr(module, method_name, types.MethodType(wrapped, module))


# --------------------------------------------------------------------- validation
def _validate_modules(module: Any) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard expects a module or a non-empty list of modules, got an empty list")
    seen: set[int] = set()
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard expects nn.Module (or a list of them), got {type(m).__name__}")
        if id(m) in seen:
            raise ValueError(f"fully_shard got the same {type(m).__name__} twice in its list; pass each module once")
        seen.add(id(m))
        if "_fsdp2_state" in m.__dict__:
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module, "
                "bottom-up (blocks first, then the root)"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard got a {type(m).__name__}, a container without forward: fsdp2 gathers a "
                "module's parameters when its forward runs, and this one never runs. Apply fully_shard "
                "to each child, or pass the children as one group: fully_shard(list(container"
                + (".values()" if isinstance(m, nn.ModuleDict) else "") + "))"
            )
    return modules


def _validate_mesh(mesh: Any) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard(mesh=...) expects a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D mesh (FSDP) or a 2D (replicate, shard) mesh (HSDP), got a "
            f"{mesh.ndim}D mesh {tuple(mesh.mesh.shape)}; for tensor parallel, parallelize the model over "
            "mesh['tp'] first and pass the data-parallel part, e.g. mesh['dp'] or mesh['dp_replicate', 'dp_shard']"
        )
    if mesh.device_type not in ("cpu", "meta"):
        module = getattr(torch, mesh.device_type, None)
        if module is None or not module.is_available():
            raise ValueError(
                f"fully_shard got a mesh of device type {mesh.device_type!r}, which is not available "
                "here; build the mesh with init_device_mesh('cpu', ...) for gloo"
            )
    if mesh.device_type != "meta" and mesh.get_coordinate() is None:
        raise ValueError("this rank is not part of the mesh passed to fully_shard")


def _reshard_after_forward_value(value: Any, world: int) -> bool | int | None:
    """``value`` checked against the shard size ``world``, an int that means a bool turned
    into it: 1 (keep all of them, reshard to one rank's worth) is ``False`` and the
    shard size is ``True``."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward expects a bool, an int or None, got {type(value).__name__}")
    if not (1 <= value <= world and world % value == 0):
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard size {world} (the data-parallel "
            "dim parameters are sharded over); "
            "use True (free all) or False (keep all) otherwise"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) keeps the whole parameters after forward, as "
            "reshard_after_forward=False does; pass True to free them",
            stacklevel=3,
        )
        return False
    return True if value == world else value


def _validate_policies(mp_policy: Any, offload_policy: Any, mesh: DeviceMesh) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as fsdp2's own classes: torch's equal dataclasses are taken over field by
    field, so a script (or a library such as accelerate) that builds them from
    ``torch.distributed.fsdp`` and calls fsdp2's ``fully_shard`` runs unchanged."""
    mp_policy = _from_torch(mp_policy, (MixedPrecisionPolicy,))
    offload_policy = _from_torch(offload_policy, (CPUOffloadPolicy, OffloadPolicy))
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy expects a MixedPrecisionPolicy, got {_described(mp_policy)}; pass e.g. "
            "fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy expects an OffloadPolicy or CPUOffloadPolicy, got {_described(offload_policy)}; "
            "pass fsdp2.OffloadPolicy() or fsdp2.CPUOffloadPolicy()"
        )
    return mp_policy, offload_policy


def _from_torch(policy: Any, ours: tuple[type, ...]) -> Any:
    """fsdp2's class for a policy of torch's own class of the same name and fields."""
    if isinstance(policy, ours) or isinstance(policy, type) or not dataclasses.is_dataclass(policy):
        return policy
    if not type(policy).__module__.startswith("torch.distributed"):
        return policy
    for cls in ours:
        if type(policy).__name__ == cls.__name__:
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            theirs = {f.name for f in dataclasses.fields(policy) if f.init}
            if names != theirs:
                raise TypeError(
                    f"torch's {cls.__name__} has the fields {sorted(theirs)}, fsdp2's {sorted(names)}: this torch "
                    f"is newer than fsdp2 knows; build fsdp2.{cls.__name__}(...) instead"
                )
            return cls(**{n: getattr(policy, n) for n in names})
    return policy


def _described(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__} (call it: {obj.__qualname__}(...))"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _validate_ignored(ignored_params: Any) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)):
        raise TypeError(f"ignored_params expects a set of parameters, got {type(ignored_params).__name__}")
    return {id(p) for p in ignored_params}


def _shard_dims(
    params: list[torch.Tensor], fqns: dict, placement_fn: Callable | None, mesh: DeviceMesh, check_tp: bool
) -> list[int]:
    """The dim each parameter shards on (0 unless ``shard_placement_fn`` says otherwise),
    checking that tensor-parallel parameters can compose with ``mesh``."""
    dims = []
    for p in params:
        local = p._local_tensor if isinstance(p, DTensor) else p
        if isinstance(p, DTensor) and check_tp:
            _validate_tp_param(p, fqns[p], mesh)
        placement = placement_fn(p) if placement_fn is not None else None
        if placement is None:
            dims.append(0)
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"shard_placement_fn returned {placement!r} for {fqns[p]}; it may return None or Shard(dim)"
            )
        dim = placement.dim
        if local.dim() == 0 or not -local.dim() <= dim < local.dim():
            raise ValueError(
                f"shard_placement_fn returned Shard({dim}) for {fqns[p]} of shape {tuple(local.shape)}: "
                + ("a 0-dim parameter is replicated, return None for it" if local.dim() == 0
                   else f"the dim must lie in [{-local.dim()}, {local.dim() - 1}]")
            )
        dims.append(dim % local.dim())
    return dims


def _validate_tp_param(p: DTensor, fqn: str, mesh: DeviceMesh) -> None:
    if p.device_mesh.device_type != mesh.device_type:
        raise ValueError(
            f"parameter {fqn} is a DTensor on a {p.device_mesh.device_type} mesh but fully_shard got a "
            f"{mesh.device_type} mesh; build both from one init_device_mesh"
        )
    _check_placement_kinds(p, fqn)
    overlap = set(_mesh_ranks(p.device_mesh)) & set(_mesh_ranks(mesh))
    if overlap != {dist.get_rank()} and mesh.device_type != "meta":
        raise ValueError(
            f"parameter {fqn} is already a DTensor on {p.device_mesh}, which shares ranks with the "
            f"data-parallel mesh {mesh}; parallelize over the tensor-parallel dims (mesh['tp']) and pass "
            "the data-parallel dims (mesh['dp']) to fully_shard, or, for parameters already on the "
            "whole mesh, pass that mesh and name its data-parallel dims: fully_shard(module, mesh=mesh, "
            "dp_mesh_dims=DataParallelMeshDims(shard='dp'))"
        )


def _check_placement_kinds(p: DTensor, fqn: str) -> None:
    if any(not isinstance(pl, (Shard, Replicate)) for pl in p.placements):
        raise ValueError(
            f"parameter {fqn} has placements {tuple(p.placements)}; fully_shard composes with DTensor "
            "parameters placed with Shard or Replicate only"
        )


def _validate_dp_mesh_dims(dims: Any, mesh: Any) -> DataParallelMeshDims:
    if not isinstance(dims, DataParallelMeshDims):
        if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
            raise TypeError(f"dp_mesh_dims expects a DataParallelMeshDims, got {type(dims).__name__}")
        dims = DataParallelMeshDims(shard=dims.shard, replicate=dims.replicate)  # e.g. torch's own
    if not isinstance(mesh, DeviceMesh) or mesh.mesh_dim_names is None:
        raise ValueError(
            "fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD mesh with mesh_dim_names, e.g. "
            f"init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); got {mesh!r}"
        )
    names = mesh.mesh_dim_names
    given = dims.shard_names + dims.replicate_names
    missing = [n for n in given if n not in names]
    if missing:
        raise ValueError(f"dp_mesh_dims names {missing} that are not dims of the mesh {names}")
    if len(set(given)) != len(given):
        raise ValueError(f"dp_mesh_dims names a mesh dim twice: {dims!r}")
    for field, group in (("shard", dims.shard_names), ("replicate", dims.replicate_names)):
        order = [names.index(n) for n in group]
        if order != sorted(order):
            raise ValueError(
                f"dp_mesh_dims.{field}={group!r} lists mesh dims out of the mesh's order {names}; "
                f"list them in that order: {tuple(sorted(group, key=names.index))!r}"
            )
    return dims


def _validate_spmd_params(params: list[torch.Tensor], fqns: dict, spmd: SpmdDims) -> None:
    """Every parameter of an SPMD group is a DTensor on the full mesh, replicated over the
    data-parallel dims and placed with Shard or Replicate on the others."""
    names = spmd.mesh.mesh_dim_names
    for p in params:
        fqn = fqns[p]
        if not isinstance(p, DTensor):
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): parameter {fqn} is a plain tensor; every parameter must "
                f"already be a DTensor on the full mesh {names} (distribute_tensor / distribute_module), "
                "with Replicate() on the data-parallel dims"
            )
        if p.device_mesh != spmd.mesh:
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): parameter {fqn} is a DTensor on {p.device_mesh}, not on the "
                f"mesh passed to fully_shard {spmd.mesh}; distribute it over that mesh"
            )
        for i in sorted(spmd.dp):
            if not isinstance(p.placements[i], Replicate):
                raise ValueError(
                    f"fully_shard(dp_mesh_dims=...): parameter {fqn} has placements {tuple(p.placements)}; "
                    f"expected Replicate() on the data-parallel dim {names[i]!r} (fully_shard shards it)"
                )
        _check_placement_kinds(p, fqn)


def _mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The ranks of ``mesh``'s slice that contains this rank."""
    return [r for g in range(mesh.ndim) for r in dist.get_process_group_ranks(mesh.get_group(g))]


# ------------------------------------------------------------------ collection
def _collect_params(
    modules: list[nn.Module], ignored: set[int]
) -> tuple[dict[torch.Tensor, list[tuple[nn.Module, str]]], dict[torch.Tensor, str], list[SharedParam]]:
    """Parameters under ``modules`` not managed by an earlier call, with every
    (module, name) that registers each, in ``named_parameters`` order; and those an
    earlier call on a module outside ``modules`` manages (raised at lazy init, see
    ``_shared``). One an earlier call under ``modules`` manages raises here."""
    owners: dict[torch.Tensor, list[tuple[nn.Module, str]]] = {}
    fqns: dict[torch.Tensor, str] = {}
    deferred: list[SharedParam] = []
    for root in modules:
        for module, prefix in _walk_unmanaged(root):
            for name, p in module._parameters.items():
                if p is None or id(p) in ignored:
                    continue
                other = _managed_elsewhere(p)
                if other is not None:
                    other_fqn = find_under(root, other)
                    if other_fqn is not None:
                        where = f"names under the {type(root).__name__} being sharded"
                        raise shared_error(prefix + name, other_fqn, where)
                    deferred.append(SharedParam(root, prefix + name, other))
                    continue
                slots = owners.setdefault(p, [])
                if not any(m is module and n == name for m, n in slots):
                    slots.append((module, name))
                fqns.setdefault(p, prefix + name)
    return owners, fqns, deferred


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """The buffers of the modules this call manages go to the mesh's device, as torch's
    ``fully_shard`` moves them (the parameters' shards are made there); meta buffers
    stay for ``to_empty``, and a meta mesh moves nothing."""
    if device.type == "meta":
        return
    for root in modules:
        for module, _ in _walk_unmanaged(root):
            for buf in module._buffers.values():
                if buf is not None and buf.device != device and buf.device.type != "meta":
                    buf.data = buf.data.to(device)


def _managed_elsewhere(p: torch.Tensor) -> FSDPParam | None:
    """The parameter of an earlier group that ``p`` is: its sharded parameter, or the
    original it replaced."""
    other = sharded_owner(p)
    if other is not None:
        return other
    replaced = _REPLACED.get(id(p))
    return replaced[1]() if replaced is not None and replaced[0]() is p else None


def _remember(registry: dict, key: int, value: Any) -> None:
    """Add to a registry keyed by id(); the entry leaves when its object is collected."""
    target = (value[0] if isinstance(value, tuple) else value)()
    registry[key] = value
    if target is not None:
        weakref.finalize(target, registry.pop, key, None)


def _pre_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: refuse to step parameters fully_shard replaced,
    reshard groups still gathered from before (their gathered copy is about to go stale),
    then step managed parameters on their local shards where that is exact."""
    owners: set[weakref.ref] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            fp = sharded_owner(p)
            if fp is not None:
                owners.add(fp.group)
                continue
            entry = _REPLACED.get(id(p))
            replaced_by = entry[1]() if entry is not None and entry[0]() is p else None
            if replaced_by is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the parameter {replaced_by.fqn} as it was before "
                    "fully_shard, which no longer belongs to the model (it trains nothing). Create "
                    "the optimizer after fully_shard: optimizer = Optimizer(model.parameters(), ...)"
                )
            leaf_of = unsharded_owner(p)
            if leaf_of is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds the unsharded parameter {leaf_of.fqn}: the "
                    "optimizer was created while that module was unsharded (after model.unshard(), "
                    "or after a forward that kept its parameters gathered), so it steps a temporary "
                    "copy. Create the optimizer while the model is sharded: call model.reshard() "
                    "first, then Optimizer(model.parameters(), ...)"
                )
    groups = [g for g in (ref() for ref in owners) if g is not None]
    gathered = [g for g in groups if g.shard_state is not ShardState.SHARDED]
    unreduced = [p.fqn for g in groups if g.requires_gradient_sync for p in g.params if p.unsharded.grad is not None]  # type: ignore[union-attr]
    if unreduced:
        warnings.warn(
            f"fsdp2: {len(unreduced)} unsharded parameter(s) ({', '.join(unreduced[:3])}, ...) hold gradients "
            "that no backward of the model reduced yet, so this step does not see them: they came from a "
            "backward that ran none of the model's fully_shard modules (after unshard()). They are reduced "
            "with the next backward of the model; run that backward before optimizer.step()",
            stacklevel=3,
        )
    for owner in gathered:
        owner.reshard_if_idle()
    local_step.pre_step(optimizer, args, kwargs, sharded_owner)


def _walk_unmanaged(module: nn.Module, prefix: str = "") -> Iterator[tuple[nn.Module, str]]:
    yield module, prefix
    for name, child in module._modules.items():
        if child is not None and "_fsdp2_state" not in child.__dict__:
            yield from _walk_unmanaged(child, f"{prefix}{name}.")


# ------------------------------------------------------------------------ helpers
def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError(
            "fully_shard(mesh=None) needs torch.distributed initialized; call "
            "dist.init_process_group(...) first (torchrun sets the environment) or pass a mesh"
        )
    backend = dist.get_backend()
    device_type = "cpu" if backend == "gloo" else _accelerator_type()
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _accelerator_type() -> str:
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return acc.type if acc is not None else "cpu"


def _show_sharded_for_state_dict(group_ref: weakref.ref, *args: Any) -> None:
    """``state_dict()`` holds the sharded parameters, also of a group that is gathered
    (kept after forward, an explicit ``unshard()``): they are shown for its duration,
    without resharding, which would take a collective to undo on this rank alone."""
    group = group_ref()
    if group is not None:
        for p in group.params:
            p.register_sharded()


def _show_current_after_state_dict(group_ref: weakref.ref, *args: Any) -> None:
    group = group_ref()
    if group is not None and group.shard_state is ShardState.UNSHARDED:
        for p in group.params:
            p.register_unsharded()


def _groups_under(module: nn.Module) -> list[ParamGroup]:
    groups: list[ParamGroup] = []
    for sub in module.modules():
        state = sub.__dict__.get("_fsdp2_state")
        if state is not None and state.group not in groups:
            groups.append(state.group)
    return groups


def _prefetch_groups(method: str, modules: Any) -> list[ParamGroup]:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"{method} expects a list of FSDPModule, got {type(modules).__name__}")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{method} expects modules that fully_shard was applied to, got {type(m).__name__}; "
                "call fully_shard on it first or leave it out"
            )
    return [m._fsdp2_state.group for m in modules]


def _fsdp_class(cls: type) -> type:
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
