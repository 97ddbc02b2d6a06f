"""Gradient dtypes as the installed torch's ``fully_shard`` computes them, bit for bit: a
model whose op computes a weight's gradient wider than the weight (CPU's ``rms_norm``
takes a bf16 weight's gradient in float32 and sums it over the batch there), two blocks
of RMSNorm + Linear at 2 ranks, every combination of ``param_dtype`` and
``reduce_dtype``, three SGD steps that each reduce and three that each accumulate two
micro-batches first; fsdp2 and torch's ``fully_shard`` in the same ranks end with the
same weights on torch 2.13 (which casts each gradient to the compute dtype) and on 2.15
(which keeps the op's dtype in a backward that reduces: ``_compat.TORCH``)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import cached_outcome, run_scenarios
from _models import full_params, impl

PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
REDUCE_DTYPES = {"none": None, "fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("reduce", "accumulate")
CASES = [f"{p}-{r}-{m}" for p, r, m in itertools.product(PARAM_DTYPES, REDUCE_DTYPES, MODES)]


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def _run(rank: int, world: int, lib_name: str, case: str) -> dict[str, Any]:
    param, reduce, mode = case.split("-")
    lib = impl(lib_name)
    torch.manual_seed(0)
    model = nn.Sequential(_Block(16), _Block(16))
    with torch.no_grad():  # norm weights apart from 1, so their gradients carry rounding
        for block in model:
            block.norm.weight.uniform_(0.5, 1.5)
    mp = lib.MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[param], reduce_dtype=REDUCE_DTYPES[reduce])
    for block in model:
        lib.fully_shard(block, mp_policy=mp)
    lib.fully_shard(model, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        micro = 2 if mode == "accumulate" else 1
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)
            model(torch.randn(8, 6, 16, generator=g)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


@cached_outcome
def _world() -> dict[str, list[Any]]:
    return run_scenarios(2, {f"{case}-{lib}": (_run, (lib, case)) for case in CASES for lib in ("fsdp2", "torch")})


@pytest.mark.parametrize("case", CASES)
def test_weights_equal_torchs_bit_for_bit(case: str) -> None:
    world = _world()
    for ours, theirs in zip(world[f"{case}-fsdp2"], world[f"{case}-torch"]):
        assert list(ours) == list(theirs)
        for name in theirs:
            same = torch.equal(ours[name], theirs[name])  # a NaN is never equal
            assert same, (case, name, (ours[name] - theirs[name]).abs().max().item())
