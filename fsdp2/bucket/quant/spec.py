"""What a quantized collective sends: the dtype, the block size, the byte layout of a row.

A row of ``n`` values is cut into ``ceil(n / block_size)`` blocks (the last one padded
with zeros); each block gets one float32 scale, ``amax(|block|) * (1 / qmax)`` (the
reciprocal rounded to float32; at least the smallest normal float32), and its values
are sent as ``round(x / scale)`` in the quantized dtype (int8: round half to even, clamped
to [-127, 127]; float8 e4m3: the cast's rounding, clamped to [-448, 448]). The receiver
computes ``q * scale`` in float32. A row on the wire (``RowLayout``), every part aligned to
8 bytes: an optional full-precision tail (values that must arrive exactly: the reduce's
"used" flags and replicated scalars), the scales, the quantized payload.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ...api import BlockQuantization

SCALE_DTYPE = torch.float32
_ALIGN = 8  # every part of a row starts at a multiple of 8 bytes (a float64 tail reads aligned)
# A block of zeros gets this scale instead of 0: its values divide to 0 all the same, and
# no division by zero happens. A NaN amax stays NaN, so a NaN anywhere in a block reads
# back as NaN for the whole block.
TINY = torch.finfo(torch.float32).tiny


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class RowLayout(NamedTuple):
    """Where each part of one quantized row lies, in bytes (see the module docstring).

    The values are the concatenation of ``sizes`` segments (one per parameter): each
    segment starts a block of its own, so no scale spans two parameters (a norm's weights
    near 1 do not coarsen a matrix's near 0.02, and a parameter replicated over tensor
    parallel ranks quantizes alike on each of them, whatever its neighbours hold)."""

    sizes: tuple[int, ...]  # the segments, in order
    splits: tuple[int, ...]  # each segment's size and then its padding to whole blocks
    numel: int  # their sum: the values of a row
    blocks: int
    tail_bytes: int  # the full-precision tail, padded
    scale_offset: int
    payload_offset: int
    nbytes: int  # the whole row, a multiple of 8

    @classmethod
    def of(cls, spec: BlockQuantization, sizes: tuple[int, ...], tail_bytes: int = 0) -> RowLayout:
        blocks = sum(-(-n // spec.block_size) for n in sizes)
        splits = tuple(part for n in sizes for part in (n, -n % spec.block_size))
        tail = _aligned(tail_bytes)
        payload = tail + _aligned(blocks * SCALE_DTYPE.itemsize)
        return cls(
            tuple(sizes), splits, sum(sizes), blocks, tail, tail, payload, payload + _aligned(blocks * spec.block_size)
        )


class QuantizedComm(NamedTuple):
    """What one bucket's policy asks to quantize (each applies where ``quantizes``)."""

    gather: BlockQuantization | None = None
    reduce: BlockQuantization | None = None


NO_QUANTIZATION = QuantizedComm()


def quantizes(bucket: Any) -> bool:
    """Whether a collective of ``bucket`` (a ``BucketView``) may be quantized at all: more
    than one shard rank, floating values, no all-gather extension (those gather through
    their own hooks)."""
    return (
        bucket.comm.shard_size > 1
        and bucket.dtype.is_floating_point
        and bucket.compute_dtype.is_floating_point
        and not bucket.extension
    )
