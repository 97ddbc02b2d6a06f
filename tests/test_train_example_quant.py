"""The example with quantized communication (``--quantize-gather``/``--quantize-reduce``)
through the pipeline schedule and Mixture-of-Experts' per-parameter meshes: each trains
like the same flags unquantized, within the quantization error (the machinery is tested
bit for bit in tests/test_quant.py, convergence by tools/quant_convergence.py)."""

from __future__ import annotations

import math

import pytest
from test_train_example import FLAG_RUN, MOE, _losses, _torchrun

QUANT = ["--quantize-gather", "int8", "--quantize-reduce", "int8"]
# name -> (ranks, flags), each run with and without QUANT.
QUANT_RUNS: dict[str, tuple[int, list[str]]] = {
    "plain": (2, []),
    "pp 2": (4, ["--pp", "2", "--microbatches", "2"]),
    "moe ep 2, bf16": (4, [*MOE, "--bf16"]),
}


@pytest.mark.parametrize("name", list(QUANT_RUNS))
def test_quantized_example_trains_like_the_unquantized_one(name: str) -> None:
    nproc, flags = QUANT_RUNS[name]
    want = _losses(_torchrun(*FLAG_RUN, *flags, nproc=nproc))
    log = _torchrun(*FLAG_RUN, *flags, *QUANT, nproc=nproc)
    assert "quantize gather int8 reduce int8" in log
    got = _losses(log)
    assert got.keys() == want.keys() and len(want) >= 3, (name, got, want)
    for key, loss in want.items():
        assert math.isfinite(got[key]) and abs(got[key] - loss) <= 0.01 * loss, (name, key, got[key], loss)
    assert got != want  # it did quantize
