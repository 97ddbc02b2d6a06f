"""Blockwise quantize / dequantize of rows of values into the byte rows of ``RowLayout``.

Plain torch ops, so the same code runs on every device (and on meta tensors, for the
memory estimate). The scheme is spelled out in ``spec.py``; ``tests/test_quant.py``
checks it bit for bit against a block-by-block reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import SCALE_DTYPE, BlockQuantization, RowLayout

# A block of zeros gets this scale instead of 0: its values divide to 0 all the same, and
# no division by zero happens. A NaN amax stays NaN (``clamp_min`` propagates it), so a
# NaN anywhere in a block reads back as NaN for the whole block.
_TINY = torch.finfo(torch.float32).tiny


def _blocks(x: torch.Tensor, spec: BlockQuantization, rows: RowLayout) -> torch.Tensor:
    """``x`` (``R x n``) as float32 ``R x blocks x block_size``, the last block zero-padded."""
    xf = x.to(SCALE_DTYPE)
    pad = rows.blocks * spec.block_size - rows.numel
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.reshape(x.shape[0], rows.blocks, spec.block_size)


def scales_of(packed: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    """The float32 scales of byte rows ``packed`` (``R x nbytes``), ``R x blocks x 1``."""
    part = packed[:, rows.scale_offset : rows.scale_offset + rows.blocks * SCALE_DTYPE.itemsize]
    return part.view(SCALE_DTYPE).view(packed.shape[0], rows.blocks, 1)


def payload_of(packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout) -> torch.Tensor:
    """The quantized values of byte rows ``packed``, ``R x blocks x block_size``."""
    part = packed[:, rows.payload_offset : rows.payload_offset + rows.blocks * spec.block_size]
    return part.view(spec.dtype).view(packed.shape[0], rows.blocks, spec.block_size)  # type: ignore[arg-type]


def quantize_rows(x: torch.Tensor, spec: BlockQuantization, rows: RowLayout, out: torch.Tensor) -> None:
    """Write the scales and payload of each row of ``x`` (``R x n``, any float dtype) into
    the byte rows ``out`` (``R x nbytes``, uint8); the tail is left to the caller."""
    blocks = _blocks(x, spec, rows)
    scale = blocks.abs().amax(dim=2, keepdim=True).div_(spec.qmax).clamp_min_(_TINY)
    q = blocks / scale  # not in place: ``blocks`` may be a view of ``x``
    if spec.dtype == torch.int8:
        q = q.round_()
    q.clamp_(-spec.qmax, spec.qmax)
    payload_of(out, spec, rows).copy_(q)
    scales_of(out, rows).copy_(scale)


def dequantize_rows(packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout) -> torch.Tensor:
    """The values of byte rows ``packed`` (``R x nbytes``) as float32 ``R x blocks x
    block_size`` (``q * scale``; the padding of the last block reads 0)."""
    return payload_of(packed, spec, rows).to(SCALE_DTYPE).mul_(scales_of(packed, rows))


def dequantize_into(packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout, out: torch.Tensor) -> None:
    """``out`` (``R x n``, any float dtype) = the dequantized rows of ``packed``."""
    values = dequantize_rows(packed, spec, rows).view(packed.shape[0], -1)
    out.copy_(values[:, : rows.numel])
