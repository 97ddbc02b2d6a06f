"""One row layout's quantize and dequantize, on the device's best path: the fused Triton
kernels on CUDA (``fused.py``), the torch-op reference elsewhere (``blockwise.py``).
Both compute the same bits; the gather and the reduce call only this."""

from __future__ import annotations

import torch

from . import blockwise, fused
from .spec import BlockQuantization, RowLayout


class BlockCodec:
    def __init__(self, spec: BlockQuantization, rows: RowLayout) -> None:
        self.spec = spec
        self.rows = rows
        self._table: fused.BlockTable | None = None  # built on first fused use, kept

    def _fused_table(self, t: torch.Tensor) -> fused.BlockTable | None:
        if not fused.usable(t, self.spec):
            return None
        if self._table is None or self._table.block_seg.device != t.device:
            self._table = fused.BlockTable.of(self.spec, self.rows, t.device)
        return self._table

    def quantize(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Rows ``x`` (``R x numel``) into byte rows ``out`` (``R x nbytes``; tail untouched)."""
        table = self._fused_table(x)
        if table is not None:
            fused.quantize_rows(x, self.spec, self.rows, table, out)
        else:
            blockwise.quantize_rows(x, self.spec, self.rows, out)

    def dequantize_blocks(self, packed: torch.Tensor, blocks: torch.Tensor) -> None:
        """Byte rows (``W x nbytes``) into ``blocks`` (``W x numel``, rank-major, contiguous)."""
        table = self._fused_table(packed)
        if table is not None:
            fused.dequantize_to(packed, self.spec, self.rows, table, blocks.view(-1), regions=False)
        else:
            blockwise.dequantize_into(packed, self.spec, self.rows, blocks)

    def dequantize_regions(self, packed: torch.Tensor, regions: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Byte rows into each segment's ``W x size`` region, the regions lying back to back
        from the start of ``flat`` (the unsharded storage)."""
        table = self._fused_table(packed)
        if table is not None:
            fused.dequantize_to(packed, self.spec, self.rows, table, flat, regions=True)
        else:
            padded = blockwise.dequantize_rows(packed, self.spec, self.rows, flat.dtype)
            blockwise.unpack(padded, self.spec, self.rows, regions)

    def dequantize_sum(self, packed: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``numel``) = the sum of the dequantized byte rows, in row order, in float32."""
        table = self._fused_table(packed)
        if table is not None:
            fused.dequantize_sum(packed, self.spec, self.rows, table, out)
            return
        values = blockwise.dequantize_rows(packed, self.spec, self.rows)  # W x padded, float32
        for row in values[1:]:
            values[0].add_(row)
        blockwise.unpack(values[:1], self.spec, self.rows, blockwise.segments_of(out.view(1, -1), self.rows))
