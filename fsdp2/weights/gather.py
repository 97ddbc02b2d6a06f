"""The collectives of one group's export: its buckets gathered over the shard ranks,
then each tensor-parallel (or expert-parallel) mesh dimension gathered once for all of
the group's parameters sharded on it.

A bucket goes out as its sharded flat buffer, cast to the export dtype first (half the
bytes of float32 masters in bf16), in one ``all_gather_into_tensor``; each parameter's
full value (or its tensor-parallel local shard) is cut out of the rank-major blocks by
its ``ShardLayout``. A mesh dimension's gather sends each parameter's piece padded to
``torch.chunk``'s chunk along its sharded dim, so every rank sends the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from ..bucket.bucket import FlatBucket
from ..comm.collectives import Pending, all_gather_flat, wait_pending
from ..memory.tracker import free_storage
from ..params.param import FSDPParam


@dataclass
class BucketOut:
    """One bucket's all-gather in flight: its output (``W x S``, rank-major), whether the
    export made it (freed when done, else it is the bucket's own shard), and the cast
    shard it sends (freed after the wait)."""

    bucket: FlatBucket
    out: torch.Tensor
    owned: bool
    pending: Pending | None = None
    send: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self.pending is not None:
            wait_pending(self.pending)
            self.pending = None
        if self.send is not None:
            free_storage(self.send)
            self.send = None
        return self.out


@dataclass
class GroupOut:
    """A group's export: its buckets' gathers; then (``finish_group``) the values of the
    parameters on model-parallel meshes, gathered whole, and for the others where to cut
    them from, cut one at a time as they are taken (``take``), each bucket's output
    dropped with its last parameter: a group is held at full size about once."""

    buckets: list[BucketOut]
    values: dict[int, torch.Tensor] = field(default_factory=dict)  # id(FSDPParam) -> value
    _source: dict[int, tuple[BucketOut, torch.Tensor]] = field(default_factory=dict)  # -> (bucket, blocks)
    _left: dict[int, int] = field(default_factory=dict)  # id(BucketOut) -> parameters not taken yet

    def take(self, p: FSDPParam, dtype: torch.dtype | None) -> torch.Tensor | None:
        """``p``'s full value (a tensor of its own); None for a parameter the group did
        not gather (a subclass sharded by its own ops)."""
        if id(p) in self.values:
            return self.values.pop(id(p))
        found = self._source.pop(id(p), None)
        if found is None:
            return None
        bo, blocks = found
        value = _cut(p, bo.bucket, blocks, dtype)
        self._done_with(bo)
        return value

    def _done_with(self, bo: BucketOut) -> None:
        self._left[id(bo)] -= 1
        if not self._left[id(bo)]:  # its blocks are all cut out
            if bo.owned:
                free_storage(bo.out)
            bo.out = bo.out.new_empty(0)


def start_group(buckets: list[FlatBucket], dtype: torch.dtype | None) -> GroupOut:
    """Issue the all-gather of each bucket (async); nothing waits yet."""
    return GroupOut([_start_bucket(b, dtype) for b in buckets if b.sharded_flat.numel()])


def export_dtype(b: FlatBucket, dtype: torch.dtype | None) -> torch.dtype:
    """What ``b``'s parameters go out as: ``dtype`` for floating-point ones, else their own."""
    return dtype if dtype is not None and b.dtype.is_floating_point else b.dtype


def _start_bucket(b: FlatBucket, dtype: torch.dtype | None) -> BucketOut:
    world = b.comm.shard_size
    flat = b.sharded_flat[: b.shard_numel]
    src = flat.to(device=b.device, dtype=export_dtype(b, dtype))  # ``flat`` itself when already so
    fresh = src is not flat
    if world == 1:
        return BucketOut(b, src, owned=fresh)
    out = torch.empty(world * b.shard_numel, dtype=src.dtype, device=src.device)
    pending = all_gather_flat(src, out, b.comm.shard_group, f"{b.name}: full_weights")
    return BucketOut(b, out, owned=True, pending=pending, send=src if fresh else None)


def finish_group(group: GroupOut, dtype: torch.dtype | None) -> None:
    """Wait for the buckets' gathers; gather the parameters on tensor-parallel (or
    expert) meshes over those mesh dims (one collective per dim); the rest are cut out
    when taken."""
    parallel = []
    for bo in group.buckets:
        b = bo.bucket
        blocks = bo.wait().view(b.comm.shard_size, b.shard_numel)
        group._left[id(bo)] = 1  # held until every parameter is placed
        for p in b.params:
            if p.dispatched:
                continue
            if p.tp is not None:
                group.values[id(p)] = _cut(p, b, blocks, dtype)
                parallel.append(p)
            else:
                group._source[id(p)] = (bo, blocks)
                group._left[id(bo)] += 1
        del blocks
        group._done_with(bo)
    _gather_model_parallel(group, parallel)


def _cut(p: FSDPParam, b: FlatBucket, blocks: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``p``'s value from its bucket's gathered blocks (a tensor of its own)."""
    if p.is_replicated:  # a 0-dim parameter: every rank holds it whole
        return b.sharded_flat[p.offset].to(device=b.device, dtype=export_dtype(b, dtype), copy=True).view(())
    region = blocks[:, p.offset : p.offset + p.shard_numel]
    shape = p.layout.shape
    value = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
    if not p.layout.blocks_are_the_value:
        p.layout.copy_blocks_out(region.contiguous(), value)
        return value
    flat, world = value.view(-1), blocks.shape[0]  # dim 0: each rank's real rows, in rank order
    if flat.numel() == world * p.shard_numel:
        flat.view(world, p.shard_numel).copy_(region)
        return value
    for r in range(world):
        n = p.layout.length_of(r) * p.layout.slice_numel
        if n:
            flat[r * p.shard_numel : r * p.shard_numel + n].copy_(region[r, :n])
    return value


def _gather_model_parallel(group: GroupOut, params: list[FSDPParam]) -> None:
    """Gather every parameter on a tensor-parallel (or expert) mesh over its sharded mesh
    dims, the last first, batching the parameters that share a dim's process group."""
    plain = []
    for p in params:  # each on a model-parallel mesh (``p.tp``)
        mesh, placements = _tp(p)
        if all(isinstance(pl, Replicate) or type(pl) is Shard for pl in placements):
            plain.append(p)
        else:  # other placements (strided shards): DTensor's own redistribution
            local = DTensor.from_local(group.values[id(p)], mesh, placements, run_check=False,
                                       shape=p.shape, stride=p.stride)
            group.values[id(p)] = local.full_tensor()
    depth = max((_tp(p)[0].ndim for p in plain), default=0)
    for back in range(1, depth + 1):  # mesh dims from the last one
        batches: dict[int, list[tuple[FSDPParam, int, int]]] = {}
        for p in plain:
            mesh, placements = _tp(p)
            i = mesh.ndim - back
            if i < 0:
                continue
            placement = placements[i]
            if not isinstance(placement, Shard):
                continue
            d = placement.dim
            size = _size_before(p, i, d)
            pg = mesh.get_group(i)
            batches.setdefault(id(pg), []).append((p, d, size))
        for batch in batches.values():
            mesh = _tp(batch[0][0])[0]
            i = mesh.ndim - back
            _gather_dim(group.values, batch, mesh.get_group(i), mesh.size(i))


def _tp(p: FSDPParam) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The model-parallel mesh and placements of ``p``, one of those that have them."""
    if p.tp is None:
        raise AssertionError(f"fsdp2 internal error: {p.fqn} is not on a model-parallel mesh")
    return p.tp


def _size_before(p: FSDPParam, i: int, d: int) -> int:
    """Length along ``d`` of ``p``'s piece before mesh dim ``i`` split it (the mesh dims
    before it applied with this rank's coordinates, ``torch.chunk``'s rule, as DTensor)."""
    mesh, placements = _tp(p)
    n = p.shape[d]
    coords = mesh.get_coordinate()
    if coords is None:
        raise AssertionError("fsdp2 internal error: this rank is not on the parameter's mesh")
    for j in range(i):
        pl = placements[j]
        if isinstance(pl, Shard) and pl.dim == d:
            chunk = -(-n // mesh.size(j))
            n = max(0, min(chunk, n - coords[j] * chunk))
    return n


def _gather_dim(values: dict[int, torch.Tensor], batch: list[tuple[FSDPParam, int, int]],
                pg: dist.ProcessGroup, world: int) -> None:
    """One all-gather over ``pg`` for every ``(param, dim, full length)`` in ``batch``."""
    pieces, layouts = [], []
    for p, d, n in batch:
        t = values[id(p)].movedim(d, 0)
        chunk = -(-n // world)
        rest = tuple(t.shape[1:])
        padded = t.new_zeros((chunk, *rest))
        padded[: t.shape[0]].copy_(t)
        pieces.append(padded.view(-1))
        layouts.append((chunk, rest, math.prod(rest)))
    send = torch.cat(pieces)
    del pieces
    out = send.new_empty(world * send.numel())
    wait_pending(all_gather_flat(send, out, pg, "full_weights: a model-parallel dim"))
    free_storage(send)
    rows = out.view(world, -1)
    offset = 0
    for (p, d, n), (chunk, rest, slice_numel) in zip(batch, layouts):
        numel = chunk * slice_numel
        parts = []
        for r in range(world):
            length = max(0, min(chunk, n - r * chunk))
            parts.append(rows[r, offset : offset + length * slice_numel].view(length, *rest))
        values[id(p)] = torch.cat(parts).movedim(0, d).contiguous()
        offset += numel
    free_storage(out)
