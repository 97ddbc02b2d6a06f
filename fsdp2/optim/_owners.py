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

Where each piece sits is ``_pieces``' business.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm.collectives import traced
from ..comm.mesh import collective_device
from ._pieces import Piece, block_indices, members_in_group_order, sharded_dims


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
    group, members = members_in_group_order(mesh, sharded_dims(placements))
    mesh_shape = tuple(mesh.mesh.shape)
    pieces = [Piece.of(block_indices(p.shape, mesh_shape, c, placements)) for c in members]
    ranks = tuple(int(mesh.mesh[tuple(c)]) for c in members)
    m, n = p.shape[0], p.shape[1] if p.dim() > 1 else 1
    matrix = Matrix(tuple(p.shape), pieces, m * n * min(m, n))
    return Exchange(group, ranks, ranks.index(dist.get_rank())), matrix



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
    device: torch.device,
) -> list[torch.Tensor]:
    """Phases 1-4 for matrices of one exchange group and dtype: ``locals_`` are this
    rank's pieces (contiguous, its local tensors' shapes); returns its pieces of
    ``fn(matrix, i)`` for each matrix ``i``, cast to ``out_dtype``. The exchange and
    ``fn`` run on ``device`` (the mesh's: offloaded pieces live on the host)."""
    G, me = len(ex.ranks), ex.me
    dtype, home = locals_[0].dtype, locals_[0].device
    # Phase 1: my piece of each matrix to its owner, grouped by owner.
    order = sorted(range(len(matrices)), key=lambda i: owners[i])
    send = torch.cat([locals_[i].reshape(-1) for i in order]) if order else torch.empty(0, dtype=dtype, device=home)
    send = send.to(device)
    mine_sizes = [sum(locals_[i].numel() for i in order if owners[i] == k) for k in range(G)]  # to each owner
    mine = [i for i in range(len(matrices)) if owners[i] == me]
    recv_sizes = [sum(math.prod(matrices[i].pieces[k].shape) for i in mine) for k in range(G)]
    recv = _all_to_all(send, mine_sizes, recv_sizes, ex.group, "fsdp2::to_owners")
    # Phase 2: assemble and compute the matrices this rank owns.
    results: dict[int, torch.Tensor] = {}
    with traced("fsdp2::owner_compute"):
        starts = [0, *itertools.accumulate(recv_sizes)][:-1]
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
    recv = _all_to_all(send, recv_sizes, mine_sizes, ex.group, "fsdp2::from_owners").to(home)  # the way back
    # Phase 4: my pieces, back in matrix order.
    out: list[torch.Tensor] = [torch.empty(0)] * len(matrices)
    at = 0
    for i in order:
        n = locals_[i].numel()
        out[i] = recv[at : at + n].view(locals_[i].shape)
        at += n
    return out


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
    piece) on its owner rank only, on the mesh's device (with ``CPUOffloadPolicy`` the
    pieces live on the host, the matrix on the accelerator), and returns a tensor of the
    same shape. Returns this
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
        for (_, dtype, home), idx in batches.items():
            ex = plans[idx[0]][0]
            matrices = [plans[i][1] for i in idx]
            owners = assign_owners([m.cost for m in matrices], len(ex.ranks))

            def on_owner(full: torch.Tensor, j: int, idx: list[int] = idx) -> torch.Tensor:
                return fn(full, idx[j])

            pieces = exchange(
                ex, matrices, owners, [locals_[i].contiguous() for i in idx],
                on_owner, out_dtype or dtype,
                collective_device(params[idx[0]].device_mesh, home),
            )
            for i, piece in zip(idx, pieces):
                out[i] = piece
        return out
