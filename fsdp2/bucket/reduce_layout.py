"""The column layout of one bucket's reduce input: which parameters are reduced, where
each one's gradient block sits in a rank's row, then the replicated scalars and the
"used" flags (``reduce.BucketReduce`` fills and reduces it)."""

from __future__ import annotations

from typing import NamedTuple

from ..params.param import FSDPParam


class ReduceLayout(NamedTuple):
    params: list[FSDPParam]  # reduced parameters that shard, in column order
    scalars: list[FSDPParam]  # reduced replicated scalars
    offsets: list[int]  # column offset of each entry of ``params``
    grad_numel: int  # columns holding sharded gradients
    numel: int  # columns per rank in all: gradients, scalars, flags
    # This rank's padding columns (past a shard's real elements): never written by a
    # deposit, zeroed in the result so a flat optimizer step keeps the padding at zero.
    padding: list[tuple[int, int]]
    # Every entry of ``params`` shards on dim 0 with something to deposit: one
    # ``torch._chunk_cat`` lays all their gradients out (``_deposit_all_at_once``).
    dim0: bool

    @classmethod
    def of(cls, params: list[FSDPParam], reduced: tuple[bool, ...]) -> ReduceLayout:
        """The layout of the ``reduced`` ones of ``params``; numbers them (``rs_index``:
        their column block and "used" flag; -1 for the others)."""
        sharded = [p for p, rg in zip(params, reduced) if rg and not p.is_replicated]
        scalars = [p for p, rg in zip(params, reduced) if rg and p.is_replicated]
        offsets, col = [], 0
        for p in sharded:
            offsets.append(col)
            col += p.shard_numel
        for p in params:
            p.rs_index = -1
        for i, p in enumerate(sharded + scalars):
            p.rs_index = i
        flags = len(sharded) + len(scalars)
        padding = [
            (off + p.layout.local_numel, off + p.shard_numel) for p, off in zip(sharded, offsets) if p.layout.padded
        ]
        dim0 = bool(sharded) and all(p.layout.blocks_are_the_value and p.layout.shape.numel() for p in sharded)
        return cls(sharded, scalars, offsets, col, col + flags + len(scalars), padding, dim0)

    @property
    def scalar_base(self) -> int:
        """First column of the scalars' gradients (right after the sharded gradients)."""
        return self.grad_numel

    @property
    def flags_base(self) -> int:
        """First column of the "used" flags (after the scalars)."""
        return self.grad_numel + len(self.scalars)
