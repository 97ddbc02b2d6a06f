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

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

_DTYPES = MappingProxyType({"int8": torch.int8, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn})
# The largest magnitude each quantized dtype holds, the ``qmax`` a block's amax maps to.
QMAX = MappingProxyType({torch.int8: 127.0, torch.float8_e4m3fn: 448.0})
SCALE_DTYPE = torch.float32
_ALIGN = 8  # every part of a row starts at a multiple of 8 bytes (a float64 tail reads aligned)
# A block of zeros gets this scale instead of 0: its values divide to 0 all the same, and
# no division by zero happens. A NaN amax stays NaN, so a NaN anywhere in a block reads
# back as NaN for the whole block.
TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class BlockQuantization:
    """Blockwise quantization of a collective's payload (``MixedPrecisionPolicy``'s
    ``quantize_gather`` / ``quantize_reduce``).

    Attributes:
        dtype: ``torch.int8`` (or ``"int8"``) or ``torch.float8_e4m3fn`` (or ``"fp8"``).
        block_size: values per float32 scale; a power of two from 16 to 65536. Bytes sent per
            value: ``1 + 4 / block_size`` (128: 1.03, a 0.258x of float32's).
    """

    dtype: torch.dtype | str = torch.int8
    block_size: int = 128

    def __post_init__(self) -> None:
        dtype = _DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in QMAX:
            raise ValueError(
                f"BlockQuantization.dtype must be torch.int8 ('int8') or torch.float8_e4m3fn ('fp8'), "
                f"got {self.dtype!r}"
            )
        object.__setattr__(self, "dtype", dtype)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"BlockQuantization.block_size must be an int, got {type(self.block_size).__name__}")
        if not 16 <= self.block_size <= 1 << 16 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"BlockQuantization.block_size must be a power of two from 16 to 65536 (one float32 scale "
                f"per block; 128 is a good default), got {self.block_size}"
            )

    @property
    def qmax(self) -> float:
        return QMAX[self.dtype]  # type: ignore[index]

    @property
    def name(self) -> str:
        return "int8" if self.dtype == torch.int8 else "fp8"


def as_quantization(value: Any, field: str) -> BlockQuantization | None:
    """``None``, a ``BlockQuantization``, or a dtype / its short name as the default blocks."""
    if value is None or isinstance(value, BlockQuantization):
        return value
    if isinstance(value, (str, torch.dtype)):
        try:
            return BlockQuantization(value)
        except ValueError:
            pass
    raise ValueError(
        f"MixedPrecisionPolicy.{field} expects None, 'int8', 'fp8', torch.int8, torch.float8_e4m3fn or "
        f"fsdp2.BlockQuantization(dtype, block_size), got {value!r}"
    )


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
