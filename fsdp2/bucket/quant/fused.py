"""The blockwise scheme of ``blockwise.py`` as fused Triton kernels, for CUDA devices.

The torch-op path (``blockwise.py``) is the reference and runs everywhere; on a CUDA
device with Triton installed these kernels replace it, one launch each, reading the
unpadded rows and writing straight to where the values belong:

* ``quantize_rows``: rows of values -> byte rows (scales and payload), padding each
  segment's last block with zeros on the fly (no packing copy);
* ``dequantize_to``: byte rows -> values, each block written to ``base + rank * stride``
  (the parameters' regions of the unsharded storage, or a rank-major buffer);
* ``dequantize_sum``: the byte rows of every rank -> their sum in float32, in rank order.

They compute exactly what the reference does, operation for operation: float32 division
and multiplication rounded to nearest (``div_rn``, no fused multiply-add), round half to
even, the same casts; ``tools/gpu_quant.py`` checks both paths agree bit for bit on the
GPU. ``FSDP2_QUANT_FUSED=0`` (debugging) keeps the reference path.

Each block's place comes from a small table per layout (``BlockTable``): its segment, int32
per block, and each segment's offset and size.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

from .spec import TINY, BlockQuantization, RowLayout


@functools.cache
def _triton() -> Any:
    """The kernels, compiled lazily, or None where Triton is missing."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from . import _fused_kernels

    return _fused_kernels


def usable(t: torch.Tensor, spec: BlockQuantization) -> bool:
    """The fused kernels serve ``t``'s device: an NVIDIA GPU with Triton installed, and for
    float8 one that has it (compute capability 8.9, Ada and Hopper on)."""
    if t.device.type != "cuda" or torch.version.hip is not None or os.environ.get("FSDP2_QUANT_FUSED", "1") == "0":
        return False
    if spec.dtype != torch.int8 and torch.cuda.get_device_capability(t.device) < (8, 9):
        return False
    return _triton() is not None


class BlockTable(NamedTuple):
    """Where each block of a layout lies, on the device: its segment (int32 per block, a
    thirty-second of a byte per value at 128 values a block) and each segment's offset,
    size and first block (int64 per segment)."""

    block_seg: torch.Tensor
    seg_offset: torch.Tensor
    seg_size: torch.Tensor
    seg_first_block: torch.Tensor

    @classmethod
    def of(cls, spec: BlockQuantization, rows: RowLayout, device: torch.device) -> BlockTable:
        block_seg: list[int] = []
        offsets: list[int] = []
        first: list[int] = []
        offset = 0
        for i, n in enumerate(rows.sizes):
            offsets.append(offset)
            first.append(len(block_seg))
            block_seg += [i] * -(-n // spec.block_size)
            offset += n
        return cls(
            torch.tensor(block_seg, dtype=torch.int32).to(device),
            torch.tensor(offsets, dtype=torch.int64).to(device),
            torch.tensor(rows.sizes, dtype=torch.int64).to(device),
            torch.tensor(first, dtype=torch.int64).to(device),
        )


def quantize_rows(
    x: torch.Tensor, spec: BlockQuantization, rows: RowLayout, table: BlockTable, out: torch.Tensor
) -> None:
    """``blockwise.quantize_rows``: ``x`` (``R x numel``, rows may be strided, last dim
    contiguous) into the byte rows ``out`` (``R x nbytes``)."""
    k = _triton()
    if not (x.stride(-1) == 1 and out.is_contiguous()):
        raise AssertionError("fsdp2 internal error: fused quantize layouts")
    grid = (rows.blocks, x.shape[0])
    k.quantize[grid](
        x, x.stride(0), out, rows.nbytes, rows.scale_offset, rows.payload_offset, *table,
        1.0 / spec.qmax, TINY, IS_INT8=spec.dtype == torch.int8, BLOCK=spec.block_size, enable_fp_fusion=False,
    )


def dequantize_to(
    packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout, table: BlockTable, out: torch.Tensor, regions: bool
) -> None:
    """Each byte row ``r`` of ``packed`` (``W x nbytes``) dequantized into the flat ``out``
    (any float dtype): ``regions``, parameter-major (segment ``i`` of rank ``r`` at ``W *
    offset_i + r * size_i``: the unsharded storage's regions), else rank-major (``W x numel``)."""
    k = _triton()
    grid = (rows.blocks, packed.shape[0])
    k.dequantize[grid](
        packed, rows.nbytes, rows.scale_offset, rows.payload_offset, *table, packed.shape[0], rows.numel, out,
        IS_INT8=spec.dtype == torch.int8, BLOCK=spec.block_size, REGIONS=regions, enable_fp_fusion=False,
    )


def dequantize_sum(
    packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout, table: BlockTable, out: torch.Tensor
) -> None:
    """``out`` (``numel`` values, any float dtype) = the sum over the byte rows of
    ``packed``, dequantized, in row order, in float32."""
    k = _triton()
    k.dequantize_sum[(rows.blocks,)](
        packed, packed.shape[0], rows.nbytes, rows.scale_offset, rows.payload_offset, *table, out,
        IS_INT8=spec.dtype == torch.int8, BLOCK=spec.block_size, enable_fp_fusion=False,
    )
