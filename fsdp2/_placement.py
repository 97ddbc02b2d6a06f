"""Where each parameter of one ``fully_shard`` call is sharded: the dim, and the mesh.

``shard_placement_fn`` may return ``None`` (dim 0), ``Shard(d)``, or a
``ShardPlacementResult`` that names a mesh of the parameter's own (fsdp2's, or torch's
with an ``FSDPMeshInfo``/``HSDPMeshInfo``, read by its fields): Mixture-of-Experts
models shard routed experts over the expert-data-parallel mesh and the rest over the
mesh ``fully_shard`` got. Every mesh and placement is checked here, before anything
changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeGuard

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._validate import check_tp_param, validate_dp_mesh_dims, validate_mesh, validate_spmd_param
from .api import DataParallelMeshDims
from .comm.mesh import SpmdDims, shard_size
from .params.spmd_annotations import SpmdAnnotation, annotation_of


@dataclass(frozen=True)
class MeshTarget:
    """A data-parallel mesh parameters are sharded over: 1-D, or ``(replicate, shard)``;
    with ``spmd``, the data-parallel part of a full SPMD mesh."""

    mesh: DeviceMesh
    spmd: SpmdDims | None = None

    @property
    def shard_size(self) -> int:
        return shard_size(self.mesh, self.spmd)

    def describe(self) -> str:
        return f"{self.spmd.mesh if self.spmd is not None else self.mesh}"


if TYPE_CHECKING:
    # A mesh ``shard_placement_fn`` named, with its data-parallel dims (SPMD meshes).
    _TargetKey = tuple[DeviceMesh, DataParallelMeshDims | None]


class Placed(NamedTuple):
    dim: int  # the (non-negative) dim the parameter's local tensor is sharded on
    target: MeshTarget
    annotation: SpmdAnnotation | None = None  # a plain parameter typed with spmd_types (SPMD meshes)


def resolve_placements(
    params: list[torch.Tensor],
    fqns: dict[torch.Tensor, str],
    placement_fn: Callable | None,
    default: MeshTarget,
) -> list[Placed]:
    """Each parameter's dim and mesh, checked: meshes this rank belongs to, on the default
    mesh's device type, spanning (with the parameter's own DTensor mesh) the data-parallel
    ranks of the default mesh, and placements the parameter can take."""
    targets: dict[_TargetKey, MeshTarget] = {}
    placed, seen = [], []
    for p in params:
        result = placement_fn(p) if placement_fn is not None else None
        placement, target = _split_result(result, fqns[p], default, targets)
        annotation = annotation_of(p, fqns[p], target.spmd)
        # A typed plain parameter is checked as the DTensor it is taken as.
        seen.append(p if annotation is None else annotation.as_dtensor(p))
        placed.append(Placed(_dim(seen[-1], placement, fqns[p]), target, annotation))
    for p, as_placed, pl in zip(params, seen, placed):
        _check_param_on(as_placed, fqns[p], pl.target)
    _check_covers_data_parallel(params, fqns, placed, default)
    return placed


def _split_result(
    result: Any, fqn: str, default: MeshTarget, targets: dict[_TargetKey, MeshTarget]
) -> tuple[object, MeshTarget]:
    """(placement, mesh) of one ``shard_placement_fn`` result."""
    if result is None or _is_shard(result):
        return result, default
    if not hasattr(result, "placement") or not (hasattr(result, "mesh") or hasattr(result, "mesh_info")):
        raise ValueError(
            f"shard_placement_fn returned {result!r} for {fqn}; it may return None, Shard(dim) or "
            "fsdp2.ShardPlacementResult(placement, mesh) (torch's ShardPlacementResult too)"
        )
    key = _target_key(result, fqn)
    if key is None:
        return result.placement, default
    target = targets.get(key)
    if target is None:
        target = targets[key] = _make_target(key, fqn, default)
    return result.placement, (default if target == default else target)


def _target_key(result: object, fqn: str) -> _TargetKey | None:
    """(mesh, dp_mesh_dims) a result names, or None for the call's own mesh."""
    info = getattr(result, "mesh_info", None)
    if info is None:  # fsdp2's ShardPlacementResult
        mesh, dims = getattr(result, "mesh", None), getattr(result, "dp_mesh_dims", None)
        if mesh is None:
            if dims is not None:
                raise ValueError(
                    f"shard_placement_fn returned dp_mesh_dims={dims!r} without a mesh for {fqn}; pass the "
                    "full SPMD mesh those dims name: ShardPlacementResult(placement, mesh, dp_mesh_dims)"
                )
            return None
        if not isinstance(mesh, DeviceMesh) and hasattr(mesh, "shard_mesh_dim"):
            info = mesh  # torch's FSDPMeshInfo given where fsdp2 takes a mesh
        else:
            return (_checked_mesh(mesh, fqn), validate_dp_mesh_dims(dims, mesh) if dims is not None else None)
    return _mesh_info_key(info, fqn)


def _mesh_info_key(info: object, fqn: str) -> _TargetKey:
    """torch's FSDPMeshInfo / HSDPMeshInfo, by its fields: a data-parallel mesh and which
    of its dims shard and replicate, or the full SPMD mesh and its data-parallel dims."""
    dims, full = getattr(info, "dp_mesh_dims", None), getattr(info, "spmd_mesh", None)
    if dims is not None:
        if full is None:
            raise ValueError(
                f"shard_placement_fn returned a mesh info for {fqn} with dp_mesh_dims={dims!r} but no "
                "spmd_mesh (the full mesh those dims name); build it with torch's _get_mesh_info(mesh, dims)"
            )
        return (_checked_mesh(full, fqn), validate_dp_mesh_dims(dims, full))
    mesh = _checked_mesh(getattr(info, "mesh", None), fqn)
    shard_dim, replicate_dim = getattr(info, "shard_mesh_dim", None), getattr(info, "replicate_mesh_dim", None)
    if (mesh.ndim, shard_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
        raise ValueError(
            f"shard_placement_fn returned a mesh for {fqn} with shard_mesh_dim={shard_dim} and "
            f"replicate_mesh_dim={replicate_dim} on a {mesh.ndim}-D mesh; fsdp2 shards over a 1-D mesh "
            "(shard dim 0) or a 2-D (replicate, shard) mesh (replicate dim 0, shard dim 1)"
        )
    return (mesh, None)


def _checked_mesh(mesh: object, fqn: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"shard_placement_fn returned a mesh for {fqn} that is a {type(mesh).__name__}, not a DeviceMesh")
    return mesh


def _make_target(key: _TargetKey, fqn: str, default: MeshTarget) -> MeshTarget:
    mesh, dims = key
    spmd = None
    if dims is not None:
        mesh, spmd = SpmdDims.split(mesh, dims)
    try:
        validate_mesh(mesh, f"the mesh shard_placement_fn returned for {fqn}")
    except (TypeError, ValueError) as e:
        raise ValueError(f"shard_placement_fn returned a mesh for {fqn} that fully_shard cannot take: {e}") from None
    if mesh.device_type != default.mesh.device_type:
        raise ValueError(
            f"shard_placement_fn returned a {mesh.device_type} mesh for {fqn} while fully_shard got a "
            f"{default.mesh.device_type} mesh; build both from one init_device_mesh"
        )
    return MeshTarget(mesh, spmd)


def _dim(p: torch.Tensor, placement: object, fqn: str) -> int:
    local = p._local_tensor if isinstance(p, DTensor) else p
    if placement is None:
        return 0
    if not _is_shard(placement):
        raise ValueError(
            f"shard_placement_fn returned the placement {placement!r} for {fqn}; fsdp2 shards parameters "
            "with Shard(dim) (None: Shard(0))"
        )
    dim = placement.dim
    if local.dim() == 0 or not -local.dim() <= dim < local.dim():
        raise ValueError(
            f"shard_placement_fn returned Shard({dim}) for {fqn} of shape {tuple(local.shape)}: "
            + ("a 0-dim parameter is replicated, return None for it" if local.dim() == 0
               else f"the dim must lie in [{-local.dim()}, {local.dim() - 1}]")
        )
    return dim % local.dim()


def _check_param_on(p: torch.Tensor, fqn: str, target: MeshTarget) -> None:
    """A parameter fits its mesh: SPMD meshes take DTensors on the full mesh; a
    tensor-parallel DTensor meets the data-parallel mesh at this rank only."""
    if target.spmd is not None:
        validate_spmd_param(p, fqn, target.spmd)
    elif isinstance(p, DTensor):
        check_tp_param(p, fqn, target.mesh)


def _span(p: torch.Tensor, target: MeshTarget) -> int:
    """How many ranks hold a piece or a copy of ``p``: its data-parallel mesh times the
    rest of its own DTensor mesh."""
    if target.spmd is not None:
        return target.spmd.mesh.size()
    tp = p.device_mesh.size() if isinstance(p, DTensor) else 1
    return target.mesh.size() * tp


def _check_covers_data_parallel(
    params: list[torch.Tensor], fqns: dict[torch.Tensor, str], placed: list[Placed], default: MeshTarget
) -> None:
    """A parameter on a mesh of its own, with the rest of its DTensor mesh, spans every
    data-parallel rank of the call's mesh (a multiple of them: tensor-parallel copies
    compute alike): its gradients are then summed over every rank that computed one
    (experts: the expert-data-parallel mesh times the expert-parallel mesh)."""
    want = default.mesh.size()
    for p, pl in zip(params, placed):
        got = _span(p, pl.target)
        if pl.target != default and got % want:
            tp = f" times its DTensor mesh {p.device_mesh}" if isinstance(p, DTensor) else ""
            raise ValueError(
                f"shard_placement_fn put {fqns[p]} on the mesh {pl.target.describe()}{tp}: it would span "
                f"{got} ranks, not a multiple of the {want} data-parallel ranks of the mesh fully_shard got "
                f"({default.describe()}), so its gradients would not be reduced over exactly the ranks that "
                f"computed them. Give it a mesh that spans {want} ranks with its own DTensor mesh (e.g. for "
                f"experts split over ep ranks, an expert-data-parallel mesh of {want} // ep ranks). torch's "
                "fully_shard does not check this"
            )


def _is_shard(placement: object) -> TypeGuard[Shard]:
    """``Shard(dim)`` or a subclass of it that shards the same way (torch's checks are
    ``isinstance``); not ``_StridedShard``, whose rows interleave."""
    return isinstance(placement, Shard) and not isinstance(placement, _StridedShard)
