"""Mixed precision: bf16 all-gather and compute, fp32 reduce, fp32 master weights.

The reference is local and runs at the same dtypes: a bf16 copy of fp32 master weights
runs forward/backward on each rank's slice of the global batch, its bf16 gradients are
summed in fp32 and averaged, and AdamW steps the fp32 master weights.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _models import ToyModel, batch, full_params, impl, loss_fn
from _models import worst as worst_error

from fsdp2._compat import TORCH

STEPS = 3
PER_RANK_BATCH = 2


def _reference_step(master: torch.nn.Module, world: int, ids: torch.Tensor, targets: torch.Tensor, micro: int) -> float:
    """Each rank's micro-batches' bf16 gradients summed in fp32, averaged over ranks."""
    compute = copy.deepcopy(master).to(torch.bfloat16)
    sums = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    total = 0.0
    for ids_r, tg_r in zip(ids.chunk(world), targets.chunk(world)):
        for mb, (ids_mb, tg_mb) in enumerate(zip(ids_r.chunk(micro), tg_r.chunk(micro))):
            compute.zero_grad()
            # torch 2.15 takes the first of several accumulating backwards' gradients in
            # fp32, each contribution (the tied weight's two) cast before summing.
            wide = TORCH.accumulates_in_reduce_dtype and micro > 1 and mb == 0
            for p in compute.parameters():
                p.grad_dtype = torch.float32 if wide else torch.bfloat16
            loss = loss_fn(compute(ids_mb), tg_mb) / micro
            loss.backward()
            total += loss.item()
            for n, p in compute.named_parameters():
                if p.grad is not None:
                    sums[n] += p.grad.float()
    for n, p in master.named_parameters():
        p.grad = sums[n] / world
    return total / world


def _worker(rank: int, world: int, lib_name: str, micro: int) -> dict[str, Any]:
    lib = impl(lib_name)
    torch.manual_seed(0)
    master = ToyModel(scalar_gate=lib_name == "fsdp2")
    model = copy.deepcopy(master)
    mp = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        lib.fully_shard(block, mp_policy=mp)
    lib.fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(master.parameters(), lr=0.05, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        ids, targets = batch(step, PER_RANK_BATCH * micro * world)
        got = torch.zeros(())
        for mb, (ids_mb, tg_mb) in enumerate(zip(ids.chunk(world)[rank].chunk(micro), targets.chunk(world)[rank].chunk(micro))):
            model.set_requires_gradient_sync(mb == micro - 1)  # accumulate, then reduce once
            logits = model(ids_mb)
            assert logits.dtype == torch.bfloat16
            loss = loss_fn(logits, tg_mb) / micro
            loss.backward()
            got += loss.detach()
        for p in model.parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        torch.distributed.all_reduce(got)
        want = _reference_step(master, world, ids, targets, micro)
        losses.append((got.item() / world, want))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    got, want = full_params(model), full_params(master)
    errors = {n: (got[n] - want[n]).abs().max().item() for n in want}
    return {"losses": losses, "errors": errors}


@functools.cache
def _results(world: int, lib_name: str, micro: int = 1) -> dict[str, Any]:
    return run_ranks(_worker, world, lib_name, micro)[0]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("lib_name", ["fsdp2", "torch"])
def test_bf16_compute_fp32_reduce_matches_local(world: int, lib_name: str) -> None:
    result = _results(world, lib_name)
    for got, want in result["losses"]:
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    worst = worst_error(list(result["errors"].values()))
    assert worst <= 1e-6, result["errors"]


@pytest.mark.parametrize("lib_name", ["fsdp2", "torch"])
def test_accumulating_without_sync_sums_in_the_reduce_dtype(lib_name: str) -> None:
    """Eight micro-batches accumulated with ``set_requires_gradient_sync(False)``: their
    bf16 gradients are summed in fp32, not in bf16."""
    result = _results(2, lib_name, 8)
    for got, want in result["losses"]:
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    worst = worst_error(list(result["errors"].values()))
    assert worst <= 1e-6, result["errors"]


def _output_dtype_worker(rank: int, world: int) -> list[str]:
    import fsdp2

    torch.manual_seed(0)
    model = ToyModel()
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    fsdp2.fully_shard(model, mp_policy=mp)
    out = model(batch(0, 2)[0])
    seen = [str(out.dtype)]
    fsdp2_mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    lin = torch.nn.Linear(4, 4)
    fsdp2.fully_shard(lin, mp_policy=fsdp2_mp)
    seen.append(str(lin(torch.randn(2, 4)).dtype))
    return seen


def test_output_dtype_and_input_cast() -> None:
    assert run_ranks(_output_dtype_worker, 2)[0] == ["torch.float32", "torch.bfloat16"]
