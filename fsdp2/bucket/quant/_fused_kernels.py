"""Triton kernels of ``fused.py`` (imported only where Triton is installed).

Every block finds its place through its segment (one per parameter): ``block_seg[b]`` is
its segment, whose values start at ``seg_offset`` in an unpadded row, number
``seg_size`` and whose first block is ``seg_first_block``. Float32 arithmetic is the
reference's: ``div_rn`` (IEEE division), the scale a product by ``1 / qmax``, products not fused into additions (the launches
pass ``enable_fp_fusion=False``), NaN kept by the block maximum.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Round half to even, as ``torch.round``: adding 1.5 * 2**23 leaves no fraction bits in a
# float32 whose magnitude is below 2**22 (a quantized value is at most 127), and the
# addition rounds to nearest even; subtracting it back is exact.
_RNE = tl.constexpr(12582912.0)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block(b, block_seg, seg_offset, seg_size, seg_first_block, BLOCK: tl.constexpr):
    """(first value's offset in the row, its segment's offset and size, values in the block)."""
    seg = tl.load(block_seg + b)
    offset = tl.load(seg_offset + seg)
    size = tl.load(seg_size + seg)
    inner = (b - tl.load(seg_first_block + seg)).to(tl.int64) * BLOCK
    return offset + inner, offset, size, inner, tl.minimum(size - inner, BLOCK)


@triton.jit
def _load_values(row, scale_off, payload_off, b, mask, IS_INT8: tl.constexpr, BLOCK: tl.constexpr):
    """One block of a byte row, dequantized in float32: ``q * scale``."""
    k = tl.arange(0, BLOCK)
    where = row + payload_off + b.to(tl.int64) * BLOCK + k
    if IS_INT8:
        q = tl.load(where.to(tl.pointer_type(tl.int8)), mask=mask, other=0).to(tl.float32)
    else:
        q = tl.load(where.to(tl.pointer_type(tl.float8e4nv)), mask=mask, other=0.0).to(tl.float32)
    scale = tl.load((row + scale_off + b.to(tl.int64) * 4).to(tl.pointer_type(tl.float32)))
    return q * scale


@triton.jit
def quantize(
    x, x_row_stride, out, nbytes, scale_off, payload_off, block_seg, seg_offset, seg_size, seg_first_block,
    inv_qmax, tiny, IS_INT8: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)  # blocks on the first grid axis: up to 2**31 of them (the others stop at 65535)
    r = tl.program_id(1).to(tl.int64)
    start, _, _, _, valid = _block(b, block_seg, seg_offset, seg_size, seg_first_block, BLOCK)
    k = tl.arange(0, BLOCK)
    mask = k < valid
    v = tl.load(x + r * x_row_stride + start + k, mask=mask, other=0.0).to(tl.float32)
    amax = tl.reduce(tl.abs(v), 0, _max_keep_nan)
    scale = amax * inv_qmax
    scale = tl.where(scale < tiny, tiny, scale)  # a NaN stays: NaN < tiny is false
    q = tl.div_rn(v, scale)
    row = out + r * nbytes
    where = row + payload_off + b.to(tl.int64) * BLOCK + k
    if IS_INT8:
        tl.store(where.to(tl.pointer_type(tl.int8)), ((q + _RNE) - _RNE).to(tl.int8))
    else:
        tl.store(where.to(tl.pointer_type(tl.float8e4nv)), q.to(tl.float8e4nv))
    tl.store((row + scale_off + b.to(tl.int64) * 4).to(tl.pointer_type(tl.float32)), scale)


@triton.jit
def dequantize(
    packed, nbytes, scale_off, payload_off, block_seg, seg_offset, seg_size, seg_first_block, world, numel, out,
    IS_INT8: tl.constexpr, BLOCK: tl.constexpr, REGIONS: tl.constexpr,
):
    b = tl.program_id(0)  # blocks on the first grid axis: up to 2**31 of them (the others stop at 65535)
    r = tl.program_id(1).to(tl.int64)
    start, offset, size, inner, valid = _block(b, block_seg, seg_offset, seg_size, seg_first_block, BLOCK)
    k = tl.arange(0, BLOCK)
    mask = k < valid
    v = _load_values(packed + r * nbytes, scale_off, payload_off, b, mask, IS_INT8, BLOCK)
    if REGIONS:  # parameter-major: segment i of rank r at world * offset_i + r * size_i
        dst = world * offset + r * size + inner
    else:  # rank-major: row r at r * numel
        dst = r * numel + start
    tl.store(out + dst + k, v.to(out.dtype.element_ty), mask=mask)


@triton.jit
def dequantize_sum(
    packed, world, nbytes, scale_off, payload_off, block_seg, seg_offset, seg_size, seg_first_block, out,
    IS_INT8: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    start, _, _, _, valid = _block(b, block_seg, seg_offset, seg_size, seg_first_block, BLOCK)
    k = tl.arange(0, BLOCK)
    mask = k < valid
    acc = _load_values(packed, scale_off, payload_off, b, mask, IS_INT8, BLOCK)
    row_bytes = nbytes.to(tl.int64)  # receive buffers may pass 2 GiB
    for r in range(1, world):  # in rank order, each product rounded before it is added
        acc = acc + _load_values(packed + r * row_bytes, scale_off, payload_off, b, mask, IS_INT8, BLOCK)
    tl.store(out + start + k, acc.to(out.dtype.element_ty), mask=mask)
