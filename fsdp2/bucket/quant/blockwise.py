"""Blockwise quantize / dequantize of rows of values into the byte rows of ``RowLayout``.

Plain torch ops, so the same code runs on every device (and on meta tensors, for the
memory estimate). The scheme is spelled out in ``spec.py``; ``tests/test_quant.py``
checks it bit for bit against a block-by-block reference.
"""

from __future__ import annotations

import torch

from .spec import SCALE_DTYPE, TINY, BlockQuantization, RowLayout


def segments_of(values: torch.Tensor, rows: RowLayout) -> list[torch.Tensor]:
    """``values`` (``R x numel``) cut into its segments' columns."""
    return list(values.split(rows.sizes, dim=1))


def pack(x: torch.Tensor, spec: BlockQuantization, rows: RowLayout) -> torch.Tensor:
    """``x`` (``R x numel``) as float32 ``R x blocks x block_size``: every segment
    zero-padded to whole blocks (one copy, casting as it goes)."""
    r, b = x.shape[0], spec.block_size
    if rows.numel == rows.blocks * b:  # no padding anywhere
        out = torch.empty(r, rows.blocks * b, dtype=SCALE_DTYPE, device=x.device)
        out.copy_(x)
    else:
        out = torch.zeros(r, rows.blocks * b, dtype=SCALE_DTYPE, device=x.device)
        values = out.split(rows.splits, dim=1)[0::2]  # each segment's place, its padding left 0
        # One copy splits it; it takes one dtype (a bf16 / float64 row is cast first).
        torch.split_with_sizes_copy(x.to(SCALE_DTYPE), rows.sizes, dim=1, out=values)
    return out.view(r, rows.blocks, b)


def unpack(padded: torch.Tensor, spec: BlockQuantization, rows: RowLayout, segments: list[torch.Tensor]) -> None:
    """Copy the values of ``padded`` (``R x blocks*block_size``) into ``segments`` (one
    ``R x n`` tensor per segment, any dtype, e.g. the parameters' regions), the padding
    dropped: one copy."""
    if segments and segments[0].dtype != padded.dtype:  # one copy splits it, in one dtype
        padded = padded.to(segments[0].dtype)
    if rows.numel == padded.shape[1] and len(segments) == 1:
        segments[0].copy_(padded)
        return
    # The padding is copied too, into a scratch row cut alike: one split copy in all.
    scratch = padded.new_empty(padded.shape[0], sum(rows.splits[1::2])).split(rows.splits[1::2], dim=1)
    pieces = [t for pair in zip(segments, scratch) for t in pair]
    torch.split_with_sizes_copy(padded, rows.splits, dim=1, out=pieces)


def scales_of(packed: torch.Tensor, rows: RowLayout) -> torch.Tensor:
    """The float32 scales of byte rows ``packed`` (``R x nbytes``), ``R x blocks x 1``."""
    part = packed[:, rows.scale_offset : rows.scale_offset + rows.blocks * SCALE_DTYPE.itemsize]
    return part.view(SCALE_DTYPE).view(packed.shape[0], rows.blocks, 1)


def payload_of(packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout) -> torch.Tensor:
    """The quantized values of byte rows ``packed``, ``R x blocks x block_size``."""
    part = packed[:, rows.payload_offset : rows.payload_offset + rows.blocks * spec.block_size]
    return part.view(spec.dtype).view(packed.shape[0], rows.blocks, spec.block_size)  # type: ignore[arg-type]


def quantize_rows(x: torch.Tensor, spec: BlockQuantization, rows: RowLayout, out: torch.Tensor) -> None:
    """Write the scales and payload of each row of ``x`` (``R x numel``, any float dtype)
    into the byte rows ``out`` (``R x nbytes``, uint8); the tail is left to the caller.
    Seven kernels after the packing copy: abs, amax, two on the scales, divide, round (int8),
    the cast into the payload. No clamp: ``|x| / (amax / qmax)`` exceeds ``qmax`` by a
    rounding at most, which int8's rounding and e4m3's cast bring back to ``qmax``."""
    blocks = pack(x, spec, rows)
    scale = scales_of(out, rows)  # written in place: the divisor is the scale sent
    # ``amax * (1 / qmax)``, not ``amax / qmax``: a division by a scalar is a product by its
    # reciprocal on CUDA, so this is the same bits on every device. (``abs().amax()``: the
    # infinity norm is the same value, 12x slower on CPU.)
    torch.mul(blocks.abs().amax(dim=2, keepdim=True), 1.0 / spec.qmax, out=scale)
    scale.clamp_min_(TINY)  # ``clamp_min`` keeps a NaN
    q = blocks.div_(scale)  # ``pack`` made a copy
    if spec.dtype == torch.int8:
        q = q.round_()
    payload_of(out, spec, rows).copy_(q)


def dequantize_rows(packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout, dtype: torch.dtype = SCALE_DTYPE) -> torch.Tensor:
    """The values of byte rows ``packed`` (``R x nbytes``) as ``R x blocks*block_size`` of
    ``dtype`` (``q * scale`` computed in float32, then cast; still padded: ``unpack``
    drops the padding). One kernel for int8, two for float8."""
    values = torch.empty(packed.shape[0], rows.blocks, spec.block_size, dtype=dtype, device=packed.device)
    payload = payload_of(packed, spec, rows)
    if spec.dtype != torch.int8:  # torch does not promote float8: widen it first (a second kernel)
        payload = payload.to(SCALE_DTYPE)
    torch.mul(payload, scales_of(packed, rows), out=values)
    return values.view(packed.shape[0], -1)


def dequantize_into(packed: torch.Tensor, spec: BlockQuantization, rows: RowLayout, out: torch.Tensor) -> None:
    """``out`` (``R x n``, any float dtype) = the dequantized rows of ``packed``."""
    unpack(dequantize_rows(packed, spec, rows, out.dtype), spec, rows, segments_of(out, rows))
