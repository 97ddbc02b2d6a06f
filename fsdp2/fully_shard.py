"""``fully_shard``: validate -> collect parameters -> build the group -> hooks -> swap class.

The checks live in ``_validate.py``, the ``FSDPModule`` mixin the swapped class gains in
``_module.py``.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ._module import FSDPModule, fsdp_class
from ._placement import MeshTarget, resolve_placements
from ._validate import (
    default_mesh,
    param_dtypes,
    validate_dp_mesh_dims,
    validate_ignored,
    validate_mesh,
    validate_modules,
    validate_policies,
)
from .api import DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy, ShardPlacementResult
from .comm.mesh import MeshInfo, SpmdDims, mesh_device
from .optim import local_step
from .params.param import FSDPParam, HoldingGroup, sharded_owner, unsharded_owner
from .params.shared import SharedParam, find_under, shared_error
from .params.spmd_annotations import pausing_typecheck
from .params.state_dict import register_state_dict_hooks
from .runtime.group import ParamGroup, ShardState
from .runtime.settings import GroupSettings, check_reshard_after_forward
from .runtime.state import FSDPState

# id(original parameter) -> (weak refs to it and to the FSDPParam that replaced it): an
# optimizer still holding one was created too early (checked at optimizer.step()).
# process-wide: an optimizer built before fully_shard is seen only through its tensors;
# entries leave with their parameter and are trusted only if it is that very tensor.
_REPLACED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[FSDPParam]]] = {}


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[FSDPModule]: ...
@pausing_typecheck  # fsdp2's own copies into its buffers: also inside an spmd_types check
def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, torch's signature
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, torch's signature
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
            any dim, negative too; sizes need not divide the shard count. Or a
            ``ShardPlacementResult(placement, mesh)`` (fsdp2's or torch's) that shards the
            parameter over a mesh of its own, e.g. MoE experts over the expert-data-parallel
            mesh: the parameters on each mesh form a group of their own (one all-gather and
            one reduce each, issued together), spanning as many ranks as the rest.
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
    modules = validate_modules(module)
    mesh = default_mesh() if mesh is None else mesh
    spmd: SpmdDims | None = None
    if dp_mesh_dims is not None:
        mesh, spmd = SpmdDims.split(mesh, validate_dp_mesh_dims(dp_mesh_dims, mesh))
    validate_mesh(mesh)
    mp_policy, offload_policy = validate_policies(mp_policy, offload_policy, mesh)
    ignored = validate_ignored(ignored_params)
    owners, fqns, shared = _collect_params(modules, ignored)
    params = list(owners)
    default = MeshTarget(mesh, spmd)
    placed = resolve_placements(params, fqns, shard_placement_fn, default)
    dtypes = param_dtypes(mp_policy, params, fqns)
    targets = list(dict.fromkeys([default, *(pl.target for pl in placed)]))
    used = list(dict.fromkeys(pl.target for pl in placed)) or [default]
    # Checked against every mesh, the call's own too (as torch); an int equal to the shard
    # size of every mesh in use means True (``ParamGroup.meshes`` decides alike later).
    reshard_after_forward = check_reshard_after_forward(
        reshard_after_forward, tuple(t.shard_size for t in targets), tuple(t.shard_size for t in used)
    )

    device = mesh_device(mesh)
    infos = {t: MeshInfo.from_mesh(t.mesh, t.spmd) for t in targets}
    fsdp_params = [
        FSDPParam(fqns[p], owners[p], p, infos[pl.target], pl.dim, pl.annotation) for p, pl in zip(params, placed)
    ]
    for fp, (gathered, grad, explicit) in zip(fsdp_params, dtypes):
        fp.policy_dtype, fp.grad_dtype, fp.explicit_grad_dtype = gathered, grad, explicit
    shard_device = torch.device("meta") if any(p.device.type == "meta" for p in params) else device
    settings = GroupSettings(mp_policy, offload_policy, reshard_after_forward)
    group = ParamGroup(fsdp_params, params, modules, infos[default], shard_device, settings, shared)
    _move_buffers(modules, device)
    _mark_managed(modules)
    for fp, original in zip(fsdp_params, params):
        fp.register_sharded()
        _remember(_REPLACED, id(original), (weakref.ref(original), weakref.ref(fp)))
    register_state_dict_hooks(fsdp_params)
    local_step.install_hooks(_pre_optimizer_step)
    for m in modules:
        m.__dict__["_fsdp2_state"] = FSDPState(m, group)
        m.register_state_dict_pre_hook(functools.partial(_show_sharded_for_state_dict, weakref.ref(group)))
        m.register_state_dict_post_hook(functools.partial(_show_current_after_state_dict, weakref.ref(group)))
        m.__class__ = fsdp_class(type(m))
    return module


# ---------------------------------------------------------------------- FSDPModule


# --------------------------------------------------------------------- validation


# ------------------------------------------------------------------ collection
def _collect_params(
    modules: list[nn.Module], ignored: set[int]
) -> tuple[dict[torch.Tensor, list[tuple[nn.Module, str]]], dict[torch.Tensor, str], list[SharedParam]]:
    """Parameters under ``modules`` not managed by an earlier call, with every
    (module, name) that registers each, in ``named_parameters`` order; and those an
    earlier call on a module outside ``modules`` manages (raised at lazy init, see
    ``params/shared.py``). One an earlier call under ``modules`` manages raises here."""
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


def _mark_managed(modules: list[nn.Module]) -> None:
    """The marks torch's ``fully_shard`` leaves on every module it manages, which other
    code reads to know a module is FSDP-sharded: transformers' ``generate`` turns on
    ``synced_gpus`` (every rank runs forwards until all are done, so ranks whose
    sequences end at different steps issue the same collectives), and dynamo treats the
    module as FSDP-managed (its parameters are graph inputs, not guarded constants:
    they change between sharded and unsharded)."""
    for root in modules:
        for module, _ in _walk_unmanaged(root):
            module._is_fsdp_managed_module = module._fsdp_use_orig_params = True  # type: ignore[assignment]


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


def _pre_optimizer_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Global optimizer step pre-hook: refuse to step parameters fully_shard replaced,
    reshard groups still gathered from before (their gathered copy is about to go stale),
    then step managed parameters on their local shards where that is exact."""
    owners: set[Callable[[], HoldingGroup | None]] = set()  # each a weakref.ref to a ParamGroup
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
    groups = cast("list[ParamGroup]", [g for g in (ref() for ref in owners) if g is not None])  # what ParamGroup sets
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


