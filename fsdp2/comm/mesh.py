"""What a group communicates over: the data-parallel mesh taken apart.

``fully_shard`` gets a 1-D mesh (FSDP: every rank holds a shard) or a 2-D mesh
``(replicate, shard)`` (HSDP: parameters are sharded within a shard group and
replicated across shard groups), or a full SPMD mesh and the names of its
data-parallel dims (``dp_mesh_dims``: parameters are DTensors on the whole mesh,
replicated over those dims). A ``MeshInfo`` names the two process groups, this rank's
place in each and their sizes (replicate size 1 when absent), and the placements the
data-parallel mesh dimensions give a parameter. Buckets read nothing else about the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from ..api import DataParallelMeshDims
from .buffers import BufferPool
from .rank import RankLocal, this_rank


@dataclass(frozen=True)
class SpmdDims:
    """A full SPMD mesh (``fully_shard(..., dp_mesh_dims=...)``) and where its
    data-parallel dims are: parameters are DTensors on ``mesh`` with ``Replicate()`` on
    those dims, and their shards are DTensors on it too."""

    mesh: DeviceMesh
    shard: tuple[int, ...]  # indices of the dims sharded over (flattened when several); none: DDP
    replicate: tuple[int, ...]  # indices of the replica dims
    # The data-parallel dims as one (shard) or two (replicate, shard) dims; replicas only
    # (DDP): one, the replicas.
    dp_mesh: DeviceMesh

    @property
    def dp(self) -> frozenset[int]:
        return frozenset(self.shard + self.replicate)

    @property
    def replicate_only(self) -> bool:
        """Replicated over the data-parallel dims, not sharded (DDP): shard size 1."""
        return not self.shard

    @classmethod
    def split(cls, mesh: DeviceMesh, dims: DataParallelMeshDims) -> tuple[DeviceMesh, SpmdDims]:
        """The data-parallel mesh to shard over (1-D, or ``(replicate, shard)``; the
        replicas alone for DDP) and the description of ``mesh``; names already validated."""
        names = mesh.mesh_dim_names
        if names is None:
            raise AssertionError("fsdp2 internal error: expected names is not None")
        replicas = _flat(mesh, dims.replicate_names) if dims.replicate_names else None
        if not dims.shard_names:
            if replicas is None:
                raise AssertionError("fsdp2 internal error: expected replicas is not None")
            dp = replicas
        else:
            shard = _flat(mesh, dims.shard_names)
            dp = shard if replicas is None else DeviceMesh._concatenate([replicas, shard])
        spmd = cls(
            mesh=mesh,
            shard=tuple(names.index(n) for n in dims.shard_names),
            replicate=tuple(names.index(n) for n in dims.replicate_names),
            dp_mesh=dp,
        )
        return dp, spmd


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


@dataclass(frozen=True)
class MeshInfo:
    mesh: DeviceMesh  # the data-parallel mesh fully_shard was given
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None  # None without a replicate dimension
    replicate_rank: int
    replicate_size: int
    local: RankLocal  # this rank's pools and derived groups
    pool: BufferPool  # ``local``'s pool for the mesh's device
    # gloo: pooled reduces run as an all-to-all plus a local sum, large buckets may
    # gather and reduce in place (both faster than gloo's all-gather/reduce-scatter).
    on_gloo: bool
    spmd: SpmdDims | None = None  # set when fully_shard got a full SPMD mesh and dp_mesh_dims

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, spmd: SpmdDims | None = None) -> MeshInfo:
        local = this_rank()
        if spmd is not None and spmd.replicate_only:
            # Replicas only (DDP) is HSDP with shards of one rank: ``mesh`` is the replicas.
            rank = dist.get_rank()
            backend = dist.get_backend(mesh.get_group(0))
            shard_group = local.subgroup("self", (rank,), backend)
            shard_rank, shard_size, replicate = 0, 1, True
        else:
            shard_group = mesh.get_group(mesh.ndim - 1)
            shard_rank, shard_size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
            replicate = mesh.ndim == 2
        return cls(
            mesh=mesh,
            shard_group=shard_group,
            shard_rank=shard_rank,
            shard_size=shard_size,
            replicate_group=mesh.get_group(0) if replicate else None,
            replicate_rank=mesh.get_local_rank(0) if replicate else 0,
            replicate_size=mesh.size(0) if replicate else 1,
            local=local,
            pool=local.pool(mesh_device(mesh)),
            on_gloo=dist.get_backend(shard_group) == "gloo",
            spmd=spmd,
        )

    @cached_property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dim (what the all-gather extension's hooks get)."""
        mesh = self.mesh
        if mesh.ndim == 1:
            return mesh
        if mesh.mesh_dim_names is not None:
            return mesh[mesh.mesh_dim_names[-1]]
        return DeviceMesh.from_group(self.shard_group, mesh.device_type)

    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    @property
    def dp_size(self) -> int:
        """Ranks a gradient is averaged over: shard size times replicate size."""
        return self.shard_size * self.replicate_size

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None

    def dp_placements(self, shard: Placement) -> tuple[Placement, ...]:
        """A parameter's placements on the data-parallel mesh dimensions."""
        return (Replicate(), shard) if self.is_hsdp else (shard,)

    def partial_group(self, factor: int) -> tuple[dist.ProcessGroup, int]:
        """The group of ``factor`` consecutive shard ranks this rank gathers from after a
        partial reshard (``reshard_after_forward=factor``), and its place in it. Made by
        the member ranks only, so a shard group that is one slice of a larger mesh
        (HSDP, pipeline stages) needs nothing from the ranks outside it."""
        ranks = dist.get_process_group_ranks(self.shard_group)
        first = self.shard_rank - self.shard_rank % factor
        block = tuple(ranks[first : first + factor])
        backend = dist.get_backend(self.shard_group)
        group = self.local.subgroup("partial", block, backend)
        return group, self.shard_rank % factor


def shard_size(mesh: DeviceMesh, spmd: SpmdDims | None) -> int:
    """How many ranks a parameter is sharded over (``MeshInfo.shard_size``), before one is built."""
    return 1 if spmd is not None and spmd.replicate_only else mesh.size(mesh.ndim - 1)


def collective_device(mesh: DeviceMesh, otherwise: torch.device) -> torch.device:
    """Where ``mesh``'s collectives need their tensors: its accelerator, or ``otherwise``
    (where the tensors already are) on a CPU or meta mesh. Offloaded tensors live on the
    host while their mesh's collectives run on the accelerator."""
    return otherwise if mesh.device_type in ("cpu", "meta") else mesh_device(mesh)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type in ("cpu", "meta"):
        return torch.device(mesh.device_type)
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())
