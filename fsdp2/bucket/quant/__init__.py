"""Quantized collectives: blockwise int8 / float8 e4m3 all-gathers and gradient reduces,
opted into per ``fully_shard`` call through ``MixedPrecisionPolicy(quantize_gather=...,
quantize_reduce=...)``. See docs/quantization.md."""

from .spec import BlockQuantization

__all__ = ["BlockQuantization"]
