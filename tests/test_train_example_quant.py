"""The example with quantized communication (``--quantize-gather``/``--quantize-reduce``)
through the pipeline schedule and Mixture-of-Experts' per-parameter meshes: each trains
like the same flags unquantized, within the quantization error (the machinery is tested
bit for bit in tests/test_quant.py, convergence by tools/quant_convergence.py)."""

from __future__ import annotations

import math

import pytest
from _dist import cached_outcome
from test_train_example import FLAG_RUN, MOE, _losses, run_example

QUANT = ["--quantize-gather", "int8", "--quantize-reduce", "int8"]
# name -> (ranks, flags), each run with and without QUANT.
QUANT_RUNS: dict[str, tuple[int, list[str]]] = {
    "plain": (2, []),
    "pp 2": (4, ["--pp", "2", "--microbatches", "2"]),
    "moe ep 2, bf16": (4, [*MOE, "--bf16"]),
}


@cached_outcome
def _logs(nproc: int) -> dict[str, str]:
    """The runs of QUANT_RUNS on ``nproc`` ranks, in one set of ranks: name -> log of the
    run without QUANT, name + " quantized" -> with it."""
    runs = {}
    for name, (ranks, flags) in QUANT_RUNS.items():
        if ranks == nproc:
            runs[name], runs[f"{name} quantized"] = [*FLAG_RUN, *flags], [*FLAG_RUN, *flags, *QUANT]
    return run_example(nproc, runs)


@pytest.mark.parametrize("name", list(QUANT_RUNS))
def test_quantized_example_trains_like_the_unquantized_one(name: str) -> None:
    logs = _logs(QUANT_RUNS[name][0])
    want = _losses(logs[name])
    log = logs[f"{name} quantized"]
    assert "quantize gather int8 reduce int8" in log
    got = _losses(log)
    assert got.keys() == want.keys() and len(want) >= 3, (name, got, want)
    for key, loss in want.items():
        assert math.isfinite(got[key]) and abs(got[key] - loss) <= 0.01 * loss, (name, key, got[key], loss)
    assert got != want  # it did quantize
