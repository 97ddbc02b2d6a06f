"""``fully_shard``'s arguments checked before anything changes: each misuse raises what
was expected, what was given and the fix (``TypeError``/``ValueError``), and the
default mesh."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._compat import TORCH, has_explicit_grad_dtype
from .api import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from .comm.mesh import SpmdDims

if TYPE_CHECKING:
    from .runtime.group import ParamGroup


def validate_modules(module: object) -> list[nn.Module]:
    if isinstance(module, (set, frozenset)):
        raise TypeError(
            "fully_shard got a set of modules, whose order differs between processes (the ranks would "
            "lay out the group's parameters differently); pass a list"
        )
    modules = [module] if isinstance(module, nn.Module) or not isinstance(module, Iterable) else list(module)
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
    return cast("list[nn.Module]", modules)  # each checked above


def validate_mesh(mesh: object, what: str = "the mesh passed to fully_shard") -> None:
    """``mesh`` is one fully_shard can shard over; ``what`` names it in the messages."""
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
        raise ValueError(f"this rank is not part of {what} ({mesh})")


def validate_policies(mp_policy: object, offload_policy: object, mesh: DeviceMesh) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as fsdp2's own classes: torch's equal dataclasses are taken over field by
    field, so a script (or a library such as accelerate) that builds them from
    ``torch.distributed.fsdp`` and calls fsdp2's ``fully_shard`` runs unchanged."""
    mp_policy = _from_torch(mp_policy, (MixedPrecisionPolicy,))
    if offload_policy is None:  # torch's fully_shard takes None for no offload (verl passes it)
        offload_policy = OffloadPolicy()
    offload_policy = _from_torch(offload_policy, (CPUOffloadPolicy, OffloadPolicy))
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy expects a MixedPrecisionPolicy, got {_described(mp_policy)}; pass e.g. "
            "fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy expects an OffloadPolicy or CPUOffloadPolicy, got {_described(offload_policy)}; "
            "pass fsdp2.OffloadPolicy() (or None) or fsdp2.CPUOffloadPolicy()"
        )
    return mp_policy, offload_policy


def param_dtypes(
    mp_policy: MixedPrecisionPolicy, params: list[torch.Tensor], fqns: dict[torch.Tensor, str]
) -> list[tuple[torch.dtype | None, torch.dtype, bool]]:
    """Each parameter's (gather dtype, ``None``: its own; gradient dtype; whether that is an
    explicit ``grad_dtype``): the policy's ``param_dtype_override_fn`` called once per
    parameter. Raises before anything changes. (torch 2.15 accepts ``grad_dtype=None``
    without a ``reduce_dtype`` here and raises at the backward; this raises now.)"""
    out = []
    for p in params:
        try:
            gathered = mp_policy.param_dtype_for(p)
        except ValueError as e:
            raise ValueError(f"parameter {fqns[p]}: {e}") from None
        explicit = has_explicit_grad_dtype(p)
        grad = p.grad_dtype if explicit else p.dtype
        if grad is None and mp_policy.reduce_dtype is None and TORCH.reduce_follows_grad_dtype and p.requires_grad:
            raise ValueError(
                f"parameter {fqns[p]} has grad_dtype=None (any gradient dtype) and the policy no reduce_dtype: "
                "its gradient's dtype could differ between ranks. Set MixedPrecisionPolicy(reduce_dtype=...) "
                "or give the parameter a grad_dtype"
            )
        out.append((gathered, p.dtype if grad is None else grad, explicit and grad is not None))
    return out


def _from_torch(policy: object, ours: tuple[type, ...]) -> object:
    """fsdp2's class for a policy of torch's own class of the same name and fields."""
    kind: type = type(policy)
    if isinstance(policy, ours) or isinstance(policy, type) or not dataclasses.is_dataclass(policy):
        return policy
    # torch's class, or a user's subclass of it: the nearest of torch's classes names it.
    torch_cls = next((c for c in kind.__mro__ if c.__module__.startswith("torch.distributed")), None)
    if torch_cls is None:
        return policy
    for cls in ours:
        if torch_cls.__name__ == cls.__name__:
            names = {f.name for f in dataclasses.fields(cls) if f.init}
            theirs = {f.name for f in dataclasses.fields(policy) if f.init}
            if not theirs <= names:  # fsdp2's may have more (``quantize_gather``...)
                raise TypeError(
                    f"torch's {cls.__name__} has the fields {sorted(theirs)}, fsdp2's {sorted(names)}: this torch "
                    f"is newer than fsdp2 knows; build fsdp2.{cls.__name__}(...) instead"
                )
            return cls(**{n: getattr(policy, n) for n in theirs})
    return policy


def _described(obj: object) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__} (call it: {obj.__qualname__}(...))"
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def validate_ignored(ignored_params: object) -> set[int]:
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Iterable):
        raise TypeError(f"ignored_params expects a set of parameters, got {type(ignored_params).__name__}")
    return {id(p) for p in ignored_params}  # any collection (torch only tests membership)


def check_tp_param(p: DTensor, fqn: str, mesh: DeviceMesh) -> None:
    """A tensor-parallel parameter can compose with the data-parallel ``mesh``."""
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


def validate_dp_mesh_dims(dims: object, mesh: object) -> DataParallelMeshDims:
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


def validate_spmd_param(p: torch.Tensor, fqn: str, spmd: SpmdDims) -> None:
    """A parameter of an SPMD group is a DTensor on the full mesh, replicated over the
    data-parallel dims and placed with Shard or Replicate on the others."""
    names = spmd.mesh.mesh_dim_names
    if not isinstance(p, DTensor):
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...): parameter {fqn} is a plain tensor with no spmd_types type; "
            f"every parameter must already be a DTensor on the full mesh {names} (distribute_tensor / "
            "distribute_module) with Replicate() on the data-parallel dims, or a plain tensor typed on that "
            "mesh with spmd_types.assert_type (torchtitan's spmd_types backend)"
        )
    if p.device_mesh != spmd.mesh:
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...): parameter {fqn} is a DTensor on {p.device_mesh}, not on the "
            f"mesh passed to fully_shard {spmd.mesh}; distribute it over that mesh"
        )
    for i in sorted(spmd.dp):
        if not isinstance(p.placements[i], Replicate):
            if names is None:
                raise AssertionError("fsdp2 internal error: an SPMD mesh without dim names")
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): parameter {fqn} has placements {tuple(p.placements)}; "
                f"expected Replicate() on the data-parallel dim {names[i]!r} (fully_shard shards it)"
            )
    _check_placement_kinds(p, fqn)


def _mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The ranks of ``mesh``'s slice that contains this rank."""
    return [r for g in range(mesh.ndim) for r in dist.get_process_group_ranks(mesh.get_group(g))]


def default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise ValueError(
            "fully_shard(mesh=None) needs torch.distributed initialized; call "
            "dist.init_process_group(...) first (torchrun sets the environment) or pass a mesh"
        )
    backend = dist.get_backend()
    device_type = "cpu" if backend == "gloo" else _accelerator_type()
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _accelerator_type() -> str:
    """The accelerator the default mesh uses, if one is usable here (not only built in:
    ``fsdp2.estimate`` hides CUDA from a script it runs on a GPU machine), else "cpu"."""
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    module = getattr(torch, acc.type, None) if acc is not None else None
    return acc.type if acc is not None and module is not None and module.is_available() else "cpu"


def check_bool(method: str, value: object) -> bool:
    """``value`` as a bool: a bool, or what torch's setters take for one by its truth value
    and means it unambiguously (the ints 0 and 1, a NumPy bool). ``None``, strings and
    other numbers are refused: torch would read ``None`` as False and ``"no"`` as True."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{method} expects a bool (or 0/1), got {type(value).__name__} {value!r}")


def check_one_mesh(method: str, group: ParamGroup, what: str) -> None:
    """torch refuses these knobs on a module whose parameters live on several meshes
    (per-parameter meshes): one hook or collective would serve different process groups."""
    meshes = group.meshes
    if len(meshes) > 1:
        raise ValueError(
            f"{method} is not supported on a module whose parameters are sharded over {len(meshes)} meshes "
            f"(shard_placement_fn returned ShardPlacementResult): the {what} would serve different process "
            "groups. Shard the parameters of the other mesh in a fully_shard call of their own to set it"
        )


def check_comm(method: str, comm: object) -> None:
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{method} expects an object with allocate(size, *, dtype, device) and __call__ (torch's "
            f"AllGather / ReduceScatter protocol), got {type(comm).__name__}"
        )


def cuda_event_types() -> tuple[type, ...]:
    event = getattr(getattr(torch, "cuda", None), "Event", None)
    return (event,) if isinstance(event, type) else ()


def check_not_quantized(method: str, comm: object, group: ParamGroup, which: str) -> None:
    """A custom collective and a quantized one cannot both carry the same payload."""
    if comm is not None and getattr(group.mp_policy, f"quantize_{which}") is not None:
        raise ValueError(
            f"{method}: this module's MixedPrecisionPolicy quantizes its {which} (quantize_{which}=...); "
            f"a custom collective would receive quantized bytes. Drop quantize_{which} from its policy, or the "
            "custom collective"
        )
