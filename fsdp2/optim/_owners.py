"""Whole-matrix updates of sharded parameters, each matrix computed once, by one owner.

An orthogonalizing optimizer (Muon) or a preconditioner (Shampoo/SOAP-like) needs each
matrix whole. On DTensors every rank would gather and compute every matrix; here each
matrix has one owner among the ranks that hold its pieces, and the work is spread:

  Phase 1  each rank sends its piece of every matrix to that matrix's owner (one
           all-to-all per exchange group and dtype, all matrices at once);
  Phase 2  each owner assembles its matrices and computes ``fn(matrix, index)``;
  Phase 3  each owner cuts the results into the holders' pieces and sends them back
           (one all-to-all);
  Phase 4  each rank gets its piece of every result, laid out like its local tensor.

The exchange group of a parameter is the ranks of its mesh that hold different pieces:
the mesh dims where it is sharded (``Shard``/``_StridedShard``): the shard group on a
1-D mesh, the shard group of each replica under HSDP (each replica computes its own
copy: once per replica), data-parallel and tensor-parallel ranks together under FSDP
over TP (the owner sees the whole matrix). Owners are chosen by longest processing time
first on the cost ``m * n * min(m, n)``, so each rank gets about the same work.

Which global rows and columns a rank's local tensor holds follows from the placements,
applied in mesh-dim order as DTensor applies them: ``Shard(d)`` takes the rank's
``torch.chunk`` of the current indices; ``_StridedShard(d, sf)`` splits them into ``sf``
pieces first (the chunks of the later mesh dims that shard ``d``) and takes the rank's
chunk of each.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .._collectives import traced
from .._rank import this_rank


def chunk_indices(indices: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """``torch.chunk(indices, n)[rank]``, empty where chunk gives fewer pieces."""
    size = -(-indices.numel() // n) if indices.numel() else 0
    return indices[rank * size : (rank + 1) * size]


def block_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Placement]
) -> list[torch.Tensor]:
    """Per tensor dim, the global indices (in local order) of the local tensor held at
    mesh coordinate ``coord``."""
    indices = [torch.arange(s) for s in shape]
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, _StridedShard):
            pieces = torch.chunk(indices[pl.dim], pl.split_factor) if indices[pl.dim].numel() else ()
            parts = [chunk_indices(p, mesh_shape[mesh_dim], coord[mesh_dim]) for p in pieces]
            indices[pl.dim] = torch.cat(parts) if parts else indices[pl.dim]
        elif isinstance(pl, Shard):
            indices[pl.dim] = chunk_indices(indices[pl.dim], mesh_shape[mesh_dim], coord[mesh_dim])
    return indices


class Piece(NamedTuple):
    """Where one member's local tensor sits in the matrix: a contiguous range per dim
    (``slices``) when it is one, else index tensors (``_StridedShard``)."""

    slices: tuple[slice, ...] | None
    index: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]

    @staticmethod
    def of(index: list[torch.Tensor]) -> Piece:
        shape = tuple(i.numel() for i in index)
        slices: tuple[slice, ...] | None = tuple(_as_slice(i) for i in index)  # type: ignore[misc]
        if slices is not None and any(s is None for s in slices):
            slices = None
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


class Matrix(NamedTuple):
    """One parameter's exchange plan: its global shape and every member's piece."""

    shape: tuple[int, ...]
    pieces: list[Piece]  # by member of the exchange group
    cost: int


class Exchange(NamedTuple):
    """The ranks that hold the pieces of some matrices, and this rank's place among them."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    me: int


def plan(p: DTensor) -> tuple[Exchange, Matrix]:
    """The exchange group of ``p`` and where each member's piece sits."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    sharded = sharded_dims(placements)
    members = _members(mesh, sharded)
    mesh_shape = tuple(mesh.mesh.shape)
    pieces = [Piece.of(block_indices(p.shape, mesh_shape, c, placements)) for c in members]
    ranks = tuple(int(mesh.mesh[tuple(c)]) for c in members)
    m, n = p.shape[0], p.shape[1] if p.dim() > 1 else 1
    matrix = Matrix(tuple(p.shape), pieces, m * n * min(m, n))
    return Exchange(_group(mesh, sharded, ranks), ranks, ranks.index(dist.get_rank())), matrix


def sharded_dims(placements: Sequence[Placement]) -> list[int]:
    """The mesh dims a DTensor is split over (the others hold copies, or partial sums)."""
    return [i for i, pl in enumerate(placements) if isinstance(pl, (Shard, _StridedShard))]


def sharded_group(mesh: object, placements: Sequence[Placement]) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
    """The process group over the ranks holding different pieces of a DTensor with these
    placements (None when this rank holds it whole), and those ranks."""
    sharded = sharded_dims(placements)
    if not sharded:
        return None, (dist.get_rank(),)
    ranks = tuple(int(mesh.mesh[tuple(c)]) for c in _members(mesh, sharded))  # type: ignore[attr-defined]
    return _group(mesh, sharded, ranks), ranks


def _members(mesh: object, sharded: list[int]) -> list[list[int]]:
    """The mesh coordinates of the ranks that differ from this one on ``sharded`` dims only."""
    coord = list(mesh.get_coordinate())  # type: ignore[attr-defined]
    sizes = [mesh.size(i) for i in sharded]  # type: ignore[attr-defined]
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


def _group(mesh: object, sharded: list[int], ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group over ``ranks``: the mesh's own for one dim, else made once per
    rank (by the member ranks only)."""
    if len(sharded) == 1:
        return mesh.get_group(sharded[0])  # type: ignore[attr-defined]
    if len(sharded) == 0:
        return mesh.get_group(0)  # type: ignore[attr-defined]  # one member: never communicates
    backend = dist.get_backend(mesh.get_group(sharded[0]))  # type: ignore[attr-defined]
    return this_rank().group(
        ("owners", ranks, backend), lambda: dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
    )


def assign_owners(costs: list[int], members: int) -> list[int]:
    """Longest processing time first: each matrix, costliest first, to the least loaded
    member (ties to the lowest index, so every rank computes the same assignment)."""
    load = [0] * members
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        k = min(range(members), key=lambda j: (load[j], j))
        owners[i] = k
        load[k] += costs[i]
    return owners


def exchange(
    ex: Exchange,
    matrices: list[Matrix],
    owners: list[int],
    locals_: list[torch.Tensor],
    fn: Callable[[torch.Tensor, int], torch.Tensor],
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Phases 1-4 for matrices of one exchange group and dtype: ``locals_`` are this
    rank's pieces (contiguous, its local tensors' shapes); returns its pieces of
    ``fn(matrix, i)`` for each matrix ``i``, cast to ``out_dtype``."""
    G, me = len(ex.ranks), ex.me
    dtype, device = locals_[0].dtype, locals_[0].device
    # Phase 1: my piece of each matrix to its owner, grouped by owner.
    order = sorted(range(len(matrices)), key=lambda i: owners[i])
    send = torch.cat([locals_[i].reshape(-1) for i in order]) if order else torch.empty(0, dtype=dtype, device=device)
    send_sizes = [sum(locals_[i].numel() for i in order if owners[i] == k) for k in range(G)]
    mine = [i for i in range(len(matrices)) if owners[i] == me]
    recv_sizes = [sum(math.prod(matrices[i].pieces[k].shape) for i in mine) for k in range(G)]
    recv = _all_to_all(send, send_sizes, recv_sizes, ex.group, "fsdp2::to_owners")
    # Phase 2: assemble and compute the matrices this rank owns.
    results: dict[int, torch.Tensor] = {}
    with traced("fsdp2::owner_compute"):
        starts = _offsets(recv_sizes)
        for i in mine:
            full = torch.empty(matrices[i].shape, dtype=dtype, device=device)
            for k in range(G):
                n = math.prod(matrices[i].pieces[k].shape)
                matrices[i].pieces[k].write(full, recv[starts[k] : starts[k] + n])
                starts[k] += n
            results[i] = fn(full, i)
    # Phase 3: each member's piece of every result I computed, grouped by member.
    parts = [results[i].to(out_dtype).contiguous().view(matrices[i].shape) for i in mine]
    back = [matrices[i].pieces[k].read(r) for k in range(G) for i, r in zip(mine, parts)]
    send = torch.cat(back) if back else torch.empty(0, dtype=out_dtype, device=device)
    send_sizes = recv_sizes
    recv_sizes = [sum(locals_[i].numel() for i in order if owners[i] == k) for k in range(G)]
    recv = _all_to_all(send, send_sizes, recv_sizes, ex.group, "fsdp2::from_owners")
    # Phase 4: my pieces, back in matrix order.
    out: list[torch.Tensor] = [torch.empty(0)] * len(matrices)
    at = 0
    for i in order:
        n = locals_[i].numel()
        out[i] = recv[at : at + n].view(locals_[i].shape)
        at += n
    return out


def _offsets(sizes: list[int]) -> list[int]:
    starts, acc = [], 0
    for s in sizes:
        starts.append(acc)
        acc += s
    return starts


def _all_to_all(
    send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], group: dist.ProcessGroup, label: str
) -> torch.Tensor:
    """One all-to-all with these element counts per member, exchanged as bytes (any
    dtype, bfloat16 included, on every backend)."""
    recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
    if len(send_sizes) == 1:
        recv.copy_(send)
        return recv
    size = send.element_size()
    with traced(label):
        dist.all_to_all_single(
            recv.view(torch.uint8), send.view(torch.uint8),
            [n * size for n in recv_sizes], [n * size for n in send_sizes], group=group,
        )
    return recv


class MatrixOwners:
    """Computes a function of whole matrices of sharded parameters once per matrix (see
    the module docstring), keeping each parameter's exchange plan between calls.

    ``map(params, locals_, fn)``: ``params`` are DTensor parameters (2-D or more; the
    first two dims are the matrix), ``locals_[i]`` a tensor laid out like
    ``params[i].to_local()`` (its gradient, a momentum, an update); ``fn(matrix, i)``
    gets the whole ``i``-th matrix (assembled from ``locals_[i]`` of every rank holding a
    piece) on its owner rank only, and returns a tensor of the same shape. Returns this
    rank's piece of each result, laid out like ``locals_[i]``, in ``out_dtype`` (default:
    the inputs' dtype). Every rank holding pieces of these parameters must call it with
    them in the same order (it communicates). For example, a Shampoo-like update::

        owners = MatrixOwners()
        updates = owners.map(params, [p.grad.to_local() for p in params],
                             lambda g, i: precondition(g, state[i]))
        for p, u in zip(params, updates):
            p.to_local().add_(u, alpha=-lr)
    """

    def __init__(self) -> None:
        self._plans: dict[int, tuple[object, Exchange, Matrix]] = {}

    def plan(self, p: DTensor) -> tuple[Exchange, Matrix]:
        cached = self._plans.get(id(p))
        if cached is not None and cached[0] is p._spec:
            return cached[1], cached[2]
        ex, matrix = plan(p)
        self._plans[id(p)] = (p._spec, ex, matrix)
        return ex, matrix

    def forget(self, keep: Sequence[torch.Tensor]) -> None:
        """Drop the plans of parameters not in ``keep``."""
        ids = {id(p) for p in keep}
        for key in [k for k in self._plans if k not in ids]:
            del self._plans[key]

    def map(
        self,
        params: Sequence[DTensor],
        locals_: Sequence[torch.Tensor],
        fn: Callable[[torch.Tensor, int], torch.Tensor],
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        if len(params) != len(locals_):
            raise ValueError(f"MatrixOwners.map got {len(params)} parameters and {len(locals_)} local tensors")
        out: list[torch.Tensor] = [torch.empty(0)] * len(params)
        batches: dict[tuple, list[int]] = {}
        plans = [self.plan(p) for p in params]
        for i, ((ex, _), t) in enumerate(zip(plans, locals_)):
            if tuple(t.shape) != tuple(params[i]._local_tensor.shape):
                raise ValueError(
                    f"MatrixOwners.map: local tensor {i} has shape {tuple(t.shape)}, the parameter's local "
                    f"shard {tuple(params[i]._local_tensor.shape)}"
                )
            batches.setdefault((ex.ranks, t.dtype, t.device), []).append(i)
        for (_, dtype, _), idx in batches.items():
            ex = plans[idx[0]][0]
            matrices = [plans[i][1] for i in idx]
            owners = assign_owners([m.cost for m in matrices], len(ex.ranks))
            pieces = exchange(
                ex, matrices, owners, [locals_[i].contiguous() for i in idx],
                lambda full, j, idx=idx: fn(full, idx[j]), out_dtype or dtype,
            )
            for i, piece in zip(idx, pieces):
                out[i] = piece
        return out
