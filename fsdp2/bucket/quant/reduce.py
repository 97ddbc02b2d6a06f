"""The quantized gradient reduce of one bucket (``MixedPrecisionPolicy(quantize_reduce=...)``).

Phase 1 (``start``): each row ``r`` of the reduce input (``W x N``: rank ``r``'s share
of this rank's gradients, then the replicated scalars' gradients and the "used" flags)
is quantized blockwise into a byte row, the scalars and flags riding exactly in the
row's tail, and one all-to-all sends row ``r`` to rank ``r`` (ZeRO++'s qgZ, in one hop).
Phase 2 (``combine``, run by ``wait_pending`` on the caller's thread): the ``W``
received rows are dequantized to float32 and summed in rank order, the tails in the
reduce dtype in rank order (so scalars come out bitwise equal on every rank), into this
rank's row of the input; the staging reads it from there as after a plain reduce. With
HSDP the replica all-reduce that follows stays in ``reduce_dtype``.
"""

from __future__ import annotations

import torch

from ...comm.buffers import BufferPool
from ...comm.collectives import Pending, all_to_all_rows, sum_rows, traced
from ...comm.mesh import MeshInfo
from ..reduce_layout import ReduceLayout
from .codec import BlockCodec
from .spec import BlockQuantization, RowLayout


class QuantizedReduce:
    """One bucket's reduce buffers and encoding while a quantized reduce is in flight."""

    def __init__(self, spec: BlockQuantization) -> None:
        self.spec = spec
        self._bufs: list[torch.Tensor] = []  # pooled send and receive rows, until staged
        self._codec: BlockCodec | None = None  # for the last layout (``_layout``)
        self._layout: tuple[ReduceLayout, int] | None = None

    def start(self, input2d: torch.Tensor, layout: ReduceLayout, comm: MeshInfo, label: str) -> Pending:
        """Issue the all-to-all of ``input2d``'s rows, the gradients quantized (one segment
        per parameter), the rest of each row exact in its tail."""
        world, numel = input2d.shape
        grad_numel = layout.grad_numel
        tail = numel - grad_numel
        codec = self._codec_for(layout, tail * input2d.element_size())
        rows = codec.rows
        for _ in range(2):  # each held as soon as acquired: ``release`` returns what was taken
            self._bufs.append(comm.pool.acquire(world * rows.nbytes, torch.uint8, input2d.device))
        send, recv = self._bufs
        send2d = send.view(world, rows.nbytes)
        with traced("fsdp2::quantize"):
            codec.quantize(input2d[:, :grad_numel], send2d)
            if tail:
                send2d[:, : tail * input2d.element_size()].view(input2d.dtype).copy_(input2d[:, grad_numel:])

        def combine(received: torch.Tensor, result: torch.Tensor) -> None:
            self._combine(codec, received.view(world, rows.nbytes), result, input2d.dtype)

        result = input2d[comm.shard_rank]
        return all_to_all_rows(send, recv, comm.shard_group, result, combine, f"{self.spec.name} {label}")

    def _combine(self, codec: BlockCodec, received: torch.Tensor, result: torch.Tensor, dtype: torch.dtype) -> None:
        """``result`` = the sum over ranks, in rank order, of the received rows."""
        numel = codec.rows.numel
        with traced("fsdp2::dequantize"):
            codec.dequantize_sum(received, result[:numel])
            tail = result.numel() - numel
            if tail:
                exact = received[:, : tail * dtype.itemsize].view(dtype)
                sum_rows(exact, result[numel:])

    def _codec_for(self, layout: ReduceLayout, tail_bytes: int) -> BlockCodec:
        """One segment per reduced parameter; rebuilt only when the layout changed."""
        last = self._layout
        if self._codec is None or last is None or last[0] is not layout or last[1] != tail_bytes:
            sizes = tuple(p.shard_numel for p in layout.params)
            self._codec = BlockCodec(self.spec, RowLayout.of(self.spec, sizes, tail_bytes))
            self._layout = (layout, tail_bytes)
        return self._codec

    def release(self, pool: BufferPool) -> None:
        for buf in self._bufs:
            pool.release(buf)
        self._bufs = []
