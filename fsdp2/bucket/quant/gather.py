"""The quantized all-gather of one bucket (``MixedPrecisionPolicy(quantize_gather=...)``).

Phase 1 (``start``): this rank quantizes its sharded flat (the full-precision shards,
before any cast to ``param_dtype``) into one byte row, scales and payload, and all-gathers
the rows: one collective, ``1 + 4 / block_size`` bytes per value instead of the compute
dtype's size. Phase 2 (``finish``): every rank dequantizes the ``W`` rows into a pooled
the parameters' regions of the unsharded storage (parameters sharded on another dim go
through a pooled ``W x S`` buffer of the compute dtype and are copied out by their layout,
as the plain gather does). The sharded parameters are never touched: gradients reach them as
always, and the quantization error does not accumulate over steps.

Gathers it does not quantize go the plain way: one rank (nothing travels), a custom
all-gather, a non-floating dtype, the kept rows of an integer ``reshard_after_forward``
(already dequantized values, gathered over the smaller group as they are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...comm.collectives import all_gather_flat, traced, wait_pending
from ..gather import BucketGather
from .codec import BlockCodec
from .spec import BlockQuantization, RowLayout, quantizes

if TYPE_CHECKING:
    from ..view import BucketView


class QuantizedGather(BucketGather):
    """One bucket's all-gather, quantized blockwise when it may be (see the module)."""

    def __init__(self, bucket: BucketView, spec: BlockQuantization) -> None:
        super().__init__(bucket)
        self.spec = spec
        self._send: torch.Tensor | None = None  # pooled, this rank's row: kept until waited
        self._rows: RowLayout | None = None  # set while a quantized gather is in flight
        self._codec: BlockCodec | None = None

    def start_whole(self, after: torch.futures.Future | None) -> None:
        b = self.bucket
        if b.user.all_gather is not None or not quantizes(b):
            return super().start_whole(after)
        comm = b.comm
        source = b.sharded_flat[: b.shard_numel]
        if b.offload is not None:
            source = b.offload.to_compute(source)
        codec = self._codec_for_bucket()
        rows = self._rows = codec.rows
        self._send = comm.pool.acquire(rows.nbytes, torch.uint8, source.device)
        with traced("fsdp2::quantize"):
            codec.quantize(source.view(1, -1), self._send.view(1, -1))
        self.buf = comm.pool.acquire(comm.shard_size * rows.nbytes, torch.uint8, source.device)
        self._pooled = True
        label = f"{self.spec.name} all-gather of {b.name}"
        self._pending = all_gather_flat(self._send, self.buf, comm.shard_group, label=label)

    def finish(self) -> None:
        b, rows = self.bucket, self._rows
        if rows is None:
            return super().finish()
        if self._pending is None or self.buf is None:
            raise AssertionError("fsdp2 internal error: no all-gather issued")
        b.alloc_unsharded()
        pool, world = b.comm.pool, b.comm.shard_size
        try:
            packed = wait_pending(self._pending).view(world, rows.nbytes)
            self._pending = None
            self._release_send()
            codec = self._codec_for_bucket()
            with traced("fsdp2::dequantize"):
                if b.blocks_are_the_values:  # straight into the parameters' regions
                    codec.dequantize_regions(packed, b.regions, b.unsharded_write)
                else:
                    self._dequantize_by_layout(codec, packed)
        finally:  # the byte rows go back to the pool whatever happened
            self._pending = None
            pool.release(self.buf)
            self.buf = None
        self.partial = None
        if b.scalars or b.offload is not None:
            self._finish_tail()

    def _dequantize_by_layout(self, codec: BlockCodec, packed: torch.Tensor) -> None:
        """Parameters sharded on other dims: rank-major blocks first, then each parameter's
        own copy out (``copy_out``)."""
        b = self.bucket
        world = b.comm.shard_size
        values = b.comm.pool.acquire(world * b.shard_numel, b.compute_dtype, b.device)
        try:
            codec.dequantize_blocks(packed, values.view(world, b.shard_numel))
            self.copy_out(values.view(world, b.shard_numel))
        finally:
            b.comm.pool.release(values)

    def _codec_for_bucket(self) -> BlockCodec:
        """One segment per sharded parameter (built once; the bucket's layout is fixed)."""
        sizes = tuple(p.shard_numel for p in self.bucket.sharded_params)
        if self._codec is None or self._codec.rows.sizes != sizes:
            self._codec = BlockCodec(self.spec, RowLayout.of(self.spec, sizes))
        return self._codec

    def drop(self) -> None:
        try:
            super().drop()
        finally:
            self._release_send()

    def _release_send(self) -> None:
        if self._send is not None:
            self.bucket.comm.pool.release(self._send)
        self._send = None
        self._rows = None
