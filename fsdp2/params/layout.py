"""Where one parameter's values live when sharded, gathered and reduced.

A ``ShardLayout`` is the shape arithmetic of one parameter over the shard dimension of
the mesh, and nothing else: no storage, no process group. The tensor it shards is the
parameter's local value (the whole parameter, or this rank's tensor-parallel shard), of
shape ``shape``, split along ``dim`` with ``torch.chunk``'s rule: every rank holds
``chunk`` slices in the flat layouts, its real ones first (``length`` of them, starting at
``start``), then padding; trailing ranks may hold none. Its shard is contiguous in its
own shape, so in the flat buffers every rank's block is ``shard_numel`` elements whose
first ``local_numel`` are real.

Gathered, the blocks of all ranks sit rank-major (``W x shard_numel``). Along dim 0
that already is the parameter (the real rows first), so the unsharded value is a plain
view of the blocks; along any other dim the blocks are copied into the parameter's own
contiguous shape (``copy_blocks_out``) and gradients are cut back into blocks
(``write_blocks``). 0-dim parameters cannot be split: they are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class ShardLayout:
    shape: torch.Size  # the value sharded: the parameter, or its tensor-parallel local shard
    dim: int  # the dimension split over the shard ranks (non-negative)
    world: int  # shard ranks
    rank: int  # this rank among them

    @cached_property
    def is_replicated(self) -> bool:
        return len(self.shape) == 0

    @cached_property
    def chunk(self) -> int:
        """Slices along ``dim`` that every rank's block has room for."""
        return 1 if self.is_replicated else -(-self.shape[self.dim] // self.world)

    def length_of(self, rank: int) -> int:
        """Real slices along ``dim`` that ``rank`` holds."""
        if self.is_replicated:
            return 1
        return max(0, min(self.chunk, self.shape[self.dim] - rank * self.chunk))

    @cached_property
    def start(self) -> int:
        return 0 if self.is_replicated else self.rank * self.chunk

    @cached_property
    def length(self) -> int:
        return self.length_of(self.rank)

    @cached_property
    def slice_numel(self) -> int:
        """Elements of one slice along ``dim``."""
        return math.prod(s for i, s in enumerate(self.shape) if i != self.dim)

    @cached_property
    def shard_numel(self) -> int:
        """Elements of one rank's block in the flat layouts, padding included."""
        return 0 if self.is_replicated else self.chunk * self.slice_numel

    @cached_property
    def local_numel(self) -> int:
        return 1 if self.is_replicated else self.length * self.slice_numel

    def shape_of(self, rank: int) -> tuple[int, ...]:
        if self.is_replicated:
            return ()
        shape = list(self.shape)
        shape[self.dim] = self.length_of(rank)
        return tuple(shape)

    @cached_property
    def local_shape(self) -> tuple[int, ...]:
        return self.shape_of(self.rank)

    @cached_property
    def blocks_are_the_value(self) -> bool:
        """The rank-major blocks, read from the start, are the parameter itself (dim 0):
        gathers may write straight into the unsharded value."""
        return self.is_replicated or self.dim == 0 or self.world == 1

    @cached_property
    def padded(self) -> bool:
        return self.length < self.chunk

    def local_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slices of a full value of the sharded tensor."""
        if self.is_replicated:
            return full.reshape(())
        return full.narrow(self.dim, min(self.start, full.shape[self.dim]), self.length)

    def copy_blocks_out(self, blocks: torch.Tensor, value: torch.Tensor) -> None:
        """``value`` (the full tensor, contiguous) from ``blocks`` (``W x shard_numel``)."""
        if self.blocks_are_the_value:
            raise AssertionError("fsdp2 internal error: dim-0 blocks are gathered in place")
        if self.shape[self.dim] == self.world * self.chunk:  # even: one strided copy
            src = blocks.view(self.world, *self.shape_of(0)).movedim(0, self.dim)
            value.view(self._split_shape()).copy_(src)
            return
        for r in range(self.world):
            n = self.length_of(r)
            if n:
                shape = self.shape_of(r)
                value.narrow(self.dim, r * self.chunk, n).copy_(blocks[r, : math.prod(shape)].view(shape))

    def write_blocks(self, blocks: torch.Tensor, grad: torch.Tensor, accumulate: bool) -> None:
        """Copy (or add) a full gradient into ``blocks`` (``W x shard_numel``), each rank's
        real slices at the start of its block; padding is left as it is."""
        if self.blocks_are_the_value:
            flat = grad.reshape(-1)
            numel = flat.numel()
            full, rest = divmod(numel, self.shard_numel) if self.shard_numel else (0, 0)
            if full:
                _write(blocks[:full], flat[: full * self.shard_numel].view(full, self.shard_numel), accumulate)
            if rest:
                _write(blocks[full, :rest], flat[full * self.shard_numel :], accumulate)
            return
        if self.shape[self.dim] == self.world * self.chunk:
            dst = blocks.view(self.world, *self.shape_of(0))
            _write(dst, grad.reshape(self._split_shape()).movedim(self.dim, 0), accumulate)
            return
        for r in range(self.world):
            n = self.length_of(r)
            if n:
                shape = self.shape_of(r)
                _write(blocks[r, : math.prod(shape)].view(shape), grad.narrow(self.dim, r * self.chunk, n), accumulate)

    def _split_shape(self) -> tuple[int, ...]:
        """``shape`` with ``dim`` split into ``(world, chunk)``."""
        shape = list(self.shape)
        return (*shape[: self.dim], self.world, self.chunk, *shape[self.dim + 1 :])


def _write(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        dst.add_(src)
    else:
        dst.copy_(src)
