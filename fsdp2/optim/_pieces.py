"""Where each rank's piece of a DTensor sits in the whole tensor, and the ranks that hold
different pieces.

Which global rows and columns a rank's local tensor holds follows from the placements
(``block_indices``: tensor-parallel splits first, then fsdp2's chunk of the local
tensor). Replicated mesh dims hold copies: the ranks holding different pieces are those
along the sharded dims (``sharded_group``), listed in their process group's rank order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..comm.rank import this_rank


def chunk_indices(indices: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """``torch.chunk(indices, n)[rank]``, empty where chunk gives fewer pieces."""
    size = -(-indices.numel() // n) if indices.numel() else 0
    return indices[rank * size : (rank + 1) * size]


def block_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> list[torch.Tensor]:
    """Per tensor dim, the global indices (in local order) of the local tensor held at
    mesh coordinate ``coord``, as fsdp2 lays its shards out: the ``Shard`` placements
    (tensor parallel) split the tensor first, in mesh-dim order, then each
    ``_StridedShard`` (fsdp2's data-parallel dim over them) takes its ``torch.chunk`` of
    the local indices. For even sizes that is DTensor's meaning of ``_StridedShard``;
    for uneven ones it is where fsdp2 keeps the data."""
    indices = [torch.arange(s) for s in shape]
    ordered: list[tuple[int, Shard | _StridedShard]] = [
        (i, pl) for i, pl in enumerate(placements) if isinstance(pl, Shard) and not isinstance(pl, _StridedShard)
    ]
    ordered += [(i, pl) for i, pl in enumerate(placements) if isinstance(pl, _StridedShard)]
    for mesh_dim, pl in ordered:
        indices[pl.dim] = chunk_indices(indices[pl.dim], mesh_shape[mesh_dim], coord[mesh_dim])
    return indices


class Piece(NamedTuple):
    """Where one member's local tensor sits in the matrix: a contiguous range per dim
    (``slices``) when it is one, else index tensors (``_StridedShard``)."""

    slices: tuple[slice, ...] | None
    index: tuple[torch.Tensor, ...]  # type: ignore[assignment]  # shadows tuple.index, as named
    shape: tuple[int, ...]

    @staticmethod
    def of(index: list[torch.Tensor]) -> Piece:
        shape = tuple(i.numel() for i in index)
        found = tuple(_as_slice(i) for i in index)
        slices = None if any(s is None for s in found) else cast("tuple[slice, ...]", found)
        return Piece(slices, tuple(index), shape)

    def write(self, full: torch.Tensor, flat: torch.Tensor) -> None:
        value = flat.view(self.shape)
        if self.slices is not None:
            full[self.slices] = value
        else:
            full[torch.meshgrid(*self.index, indexing="ij")] = value

    def read(self, full: torch.Tensor) -> torch.Tensor:
        if self.slices is not None:
            return full[self.slices].reshape(-1)
        return full[torch.meshgrid(*self.index, indexing="ij")].reshape(-1)


def _as_slice(index: torch.Tensor) -> slice | None:
    if index.numel() == 0:
        return slice(0, 0)
    start = int(index[0])
    stop = start + index.numel()
    return slice(start, stop) if bool((index == torch.arange(start, stop)).all()) else None



def sharded_dims(placements: Sequence[Placement]) -> list[int]:
    """The mesh dims a DTensor is split over (the others hold copies, or partial sums)."""
    return [i for i, pl in enumerate(placements) if isinstance(pl, (Shard, _StridedShard))]


def sharded_group(mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
    """The process group over the ranks holding different pieces of a DTensor with these
    placements (None when this rank holds it whole), and those ranks."""
    sharded = sharded_dims(placements)
    if not sharded:
        return None, (dist.get_rank(),)
    group, members = members_in_group_order(mesh, sharded)
    return group, tuple(int(mesh.mesh[tuple(c)]) for c in members)


def members_in_group_order(mesh: DeviceMesh, sharded: list[int]) -> tuple[dist.ProcessGroup, list[list[int]]]:
    """The group over the ranks along ``sharded`` dims and their mesh coordinates, in the
    group's own rank order (which collectives' split lists follow)."""
    members = members_along(mesh, sharded)
    ranks = [int(mesh.mesh[tuple(c)]) for c in members]
    group = group_over(mesh, sharded, tuple(ranks))
    order = dist.get_process_group_ranks(group) if len(ranks) > 1 else ranks
    by_rank = dict(zip(ranks, members))
    return group, [by_rank[r] for r in order]


def members_along(mesh: DeviceMesh, sharded: list[int]) -> list[list[int]]:
    """The mesh coordinates of the ranks that differ from this one on ``sharded`` dims only."""
    here = mesh.get_coordinate()
    if here is None:
        raise AssertionError("fsdp2 internal error: this rank is not on the mesh of its own shards")
    coord = list(here)
    sizes = [mesh.size(i) for i in sharded]
    members = []
    for k in range(math.prod(sizes)):
        c = list(coord)
        for i, s in zip(sharded, _unravel(k, sizes)):
            c[i] = s
        members.append(c)
    return members


def _unravel(k: int, sizes: list[int]) -> list[int]:
    out = []
    for s in reversed(sizes):
        out.append(k % s)
        k //= s
    return list(reversed(out))


def group_over(mesh: DeviceMesh, sharded: list[int], ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group over ``ranks``: the mesh's own for one dim, else made once per
    rank (by the member ranks only)."""
    if len(sharded) == 1:
        return mesh.get_group(sharded[0])
    if len(sharded) == 0:
        return mesh.get_group(0)  # one member: never communicates
    backend = dist.get_backend(mesh.get_group(sharded[0]))
    return this_rank().subgroup("owners", ranks, backend)

