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
    _leaf_grad_mode: tuple[torch.dtype | None, torch.Tensor | None]  # (as last set, for these leaves)

    def set_leaf_grad_dtypes(self, reduces: bool) -> None:
        """At each backward: the dtype the unsharded leaves take their gradients in, as
        the installed torch's ``fully_shard`` does (``_compat.TORCH``).

        - torch 2.15, a reduce dtype wider than the compute dtype (bf16 parameters,
          float32 reduce): in the first of several backwards accumulating without
          synchronization, the reduce dtype (the leaves' ``grad_dtype``: autograd casts
          each contribution, a tied weight's two, before summing them); in the others
          (the one that reduces, later accumulating ones) each op's own dtype
          (``grad_dtype=None``: autograd sums a leaf's contributions in the dtype they
          come in, and an op that computes a wider gradient keeps it, e.g. CPU's
          ``rms_norm`` for a bf16 weight: float32, summed over the batch in float32);
        - torch 2.15, any other reduce dtype: that dtype (a narrower one casts each
          contribution, as torch's leaf whose ``grad_dtype`` is the reduce dtype);
        - before 2.15: the compute dtype, cast to the reduce dtype once at the deposit.
        Leaves are left as built until some backward changes them."""
        b = self.bucket
        wider = b.reduce_dtype.itemsize > b.compute_dtype.itemsize
        first_accumulating = not reduces and not self.is_accumulating()
        mode: torch.dtype | None = b.compute_dtype  # the leaves' own: as built
        if TORCH.accumulates_in_reduce_dtype and (not wider or first_accumulating):
            mode = b.reduce_dtype
        elif wider and TORCH.reduce_keeps_computed_grad_dtype:
            mode = None
        if self._leaf_grad_mode[1] is not b.unsharded_flat:  # new leaves (new storage): as built
            self._leaf_grad_mode = (b.compute_dtype, b.unsharded_flat)
        if self._leaf_grad_mode[0] == mode:
            return
        self._leaf_grad_mode = (mode, b.unsharded_flat)
        for p in self.params:
            leaf = p.unsharded
            if p.has_plain_leaf and leaf is not None and leaf.requires_grad and p.bucket is b:
                if mode is not None and leaf.grad is not None and leaf.grad.dtype != mode:
                    leaf.grad = leaf.grad.to(mode)  # e.g. computed after an ``unshard()``
                leaf.grad_dtype = mode

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
