"""Phase 1 of a bucket's reduce: the leaves' gradients into the reduce input.

A gradient goes into its parameter's columns of the pooled ``W x N`` input (each rank's
block in its row, ``ShardLayout.write_blocks``), or, when gloo's in-place strategy
holds the unsharded storage (``storage_lent``), into that storage. The usual backward
(a gradient for every reduced parameter, all sharded on dim 0) writes them all with
one ``torch._chunk_cat``. ``BucketReduce`` takes these methods from ``Deposits``.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from .._compat import TORCH
from ..comm.collectives import traced
from ..params.param import FSDPParam

if TYPE_CHECKING:
    from .view import BucketView


class ReduceState(Enum):
    IDLE = auto()  # nothing deposited since the last reduce
    ACCUMULATING = auto()  # gradients deposited, in the pooled input or the lent storage
    IN_FLIGHT = auto()  # the reduce is issued, not waited for


class Deposits:
    """Mixin of ``BucketReduce``: depositing gradients. The attributes declared below
    are ``BucketReduce``'s, and so are ``layout``, ``input2d`` and ``_advance``."""

    bucket: BucketView
    params: list[FSDPParam]
    state: ReduceState
    deposited: list[bool]  # per reduced parameter: a gradient was deposited since the last reduce
    _leaves_wide: tuple[bool, torch.Tensor | None]  # (as last set, for the leaves over this storage)

    def accumulate_leaves_wide(self, wide: bool) -> None:
        """At each backward: ``wide`` (the first of several backwards accumulating
        without synchronization) makes the leaves take their gradients in the reduce
        dtype, autograd casting each contribution (a tied weight's two) before summing
        them, as torch 2.15 does (its leaf has no gradient yet and the reduce dtype as
        ``grad_dtype``; later backwards add to that gradient the compute dtype's sum).
        Otherwise, and before 2.15, in the compute dtype, cast once at the deposit."""
        b = self.bucket
        wide = wide and TORCH.accumulates_in_reduce_dtype and b.reduce_dtype != b.compute_dtype
        if self._leaves_wide[1] is not b.unsharded_flat:  # new leaves (new storage): as built
            self._leaves_wide = (False, b.unsharded_flat)
        if self._leaves_wide[0] == wide:
            return  # untouched unless some backward widens them (never before torch 2.15)
        self._leaves_wide = (wide, b.unsharded_flat)
        for p in self.params:
            leaf = p.unsharded
            if p.tp is None and leaf is not None and leaf.requires_grad and p.bucket is b:
                dtype = b.reduce_dtype if wide else leaf.dtype
                if leaf.grad is not None and leaf.grad.dtype != dtype:
                    leaf.grad = leaf.grad.to(dtype)  # e.g. computed after an ``unshard()``
                leaf.grad_dtype = dtype

    def is_accumulating(self) -> bool:
        """Gradients of an earlier backward wait in the reduce input."""
        return self.state is ReduceState.ACCUMULATING

    def has_unsharded_grads(self) -> bool:
        """Some unsharded leaf holds a gradient not yet moved into the reduce input."""
        return any(p.has_unsharded_grad for p in self.params)

    def deposit_unsharded_grads(self, sync: bool = True) -> None:
        """Move the leaves' gradients into the reduce input (adding to earlier ones).
        Without ``sync`` (accumulating), TP gradients still to be reduced over TP wait
        in the reduce dtype, to be reduced over TP once, with the synchronizing step's."""
        defer = None if sync else self.bucket.reduce_dtype
        with torch.no_grad():
            taken = []
            for p in self.params:
                grad = p.take_unsharded_grad(defer)
                if grad is not None:
                    taken.append((p, grad))
            if self._deposit_all_at_once(taken):
                return
            for p, grad in taken:
                self.deposit(p, grad)

    def _deposit_all_at_once(self, taken: list[tuple[FSDPParam, torch.Tensor]]) -> bool:
        """The usual backward: nothing deposited yet, a gradient for every reduced
        parameter, all sharded on dim 0 and of the reduce dtype. Then one
        ``torch._chunk_cat`` writes them all (each cut into ``W`` zero-padded chunks,
        rank-major: the reduce input's layout) instead of one deposit per parameter.
        False (nothing done) otherwise."""
        layout = self.layout()
        if (
            self.state is not ReduceState.IDLE
            or not layout.dim0
            or len(taken) != len(layout.params) + len(layout.scalars)
            or self.bucket.storage_lent
        ):
            return False
        sharded = [(p, g) for p, g in taken if not p.is_replicated]
        dtype = self.bucket.reduce_dtype
        if len(sharded) != len(layout.params) or any(
            g.dtype != dtype or not g.is_contiguous() or p is not q for (p, g), q in zip(sharded, layout.params)
        ):
            return False
        self._advance(ReduceState.ACCUMULATING, ReduceState.IDLE)
        buf = self.input2d()
        with traced("fsdp2::deposit_grads"):
            torch._chunk_cat([g for _, g in sharded], 0, buf.shape[0], out=buf[:, : layout.grad_numel])
        for p in layout.params:
            self.deposited[p.rs_index] = True
        for p, grad in taken:
            if p.is_replicated:
                self.deposit(p, grad)
        return True

    def deposit(self, p: FSDPParam, grad: torch.Tensor) -> None:
        """Add (or copy, if first) ``p``'s unsharded gradient into the reduce input."""
        layout = self.layout()
        if p.rs_index < 0:
            raise AssertionError(f"fsdp2 internal error: gradient for frozen parameter {p.fqn}")
        self._advance(ReduceState.ACCUMULATING, ReduceState.IDLE, ReduceState.ACCUMULATING)
        first = not self.deposited[p.rs_index]
        self.deposited[p.rs_index] = True
        if self.bucket.storage_lent:
            self.bucket.in_place.deposit(p, grad, first)
            return
        buf = self.input2d()
        if p.is_replicated:
            write(buf[:, layout.scalar_base + layout.scalars.index(p)], grad, first)
            return
        region = buf[:, layout.offsets[p.rs_index] : layout.offsets[p.rs_index] + p.shard_numel]
        p.layout.write_blocks(region, grad, accumulate=not first)


def write(dst: torch.Tensor, src: torch.Tensor, first: bool) -> None:
    if first:
        dst.copy_(src)
    else:
        dst.add_(src)
