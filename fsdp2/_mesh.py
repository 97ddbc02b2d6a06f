"""What a group communicates over: the data-parallel mesh taken apart.

``fully_shard`` gets a 1-D mesh (FSDP: every rank holds a shard) or a 2-D mesh
``(replicate, shard)`` (HSDP: parameters are sharded within a shard group and
replicated across shard groups). A ``MeshInfo`` names the two process groups, this
rank's place in each and their sizes (replicate size 1 when absent), and the
placements the data-parallel mesh dimensions give a parameter. Buckets read nothing
else about the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from ._buffers import BufferPool
from ._collectives import cached_group


@dataclass(frozen=True)
class MeshInfo:
    mesh: DeviceMesh  # the data-parallel mesh fully_shard was given
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None  # None without a replicate dimension
    replicate_rank: int
    replicate_size: int
    pool: BufferPool
    # gloo: pooled reduces run as an all-to-all plus a local sum, large buckets may
    # gather and reduce in place (both faster than gloo's all-gather/reduce-scatter).
    on_gloo: bool

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, pool: BufferPool) -> MeshInfo:
        shard_dim = mesh.ndim - 1
        shard_group = mesh.get_group(shard_dim)
        replicate = mesh.ndim == 2
        return cls(
            mesh=mesh,
            shard_group=shard_group,
            shard_rank=mesh.get_local_rank(shard_dim),
            shard_size=mesh.size(shard_dim),
            replicate_group=mesh.get_group(0) if replicate else None,
            replicate_rank=mesh.get_local_rank(0) if replicate else 0,
            replicate_size=mesh.size(0) if replicate else 1,
            pool=pool,
            on_gloo=dist.get_backend(shard_group) == "gloo",
        )

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
        group = cached_group(
            ("partial", block, backend),
            lambda: dist.new_group(list(block), backend=backend, use_local_synchronization=True),
        )
        return group, self.shard_rank % factor


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type in ("cpu", "meta"):
        return torch.device(mesh.device_type)
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())
