"""Large buckets on gloo gather and reduce in place, in the unsharded storage.

The all-gather runs as an all-reduce over rows filled with -0.0 (exact for every float),
and gradients are summed where their parameters were. Results must be bit-identical to
the pooled path (all-gather into a buffer, copy-out, reduce buffer): at world 2 every
sum has two terms, so even the order of summation cannot differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import run_ranks
from _models import ToyModel, batch, loss_fn

import fsdp2
import fsdp2._bucket

STEPS = 3


def _train(
    rank: int, world: int, in_place: bool, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> dict:
    fsdp2._bucket.IN_PLACE_MIN_BYTES = 0 if in_place else 1 << 62
    torch.manual_seed(0)
    model = ToyModel()
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fsdp2.fully_shard(block, mp_policy=mp)
    fsdp2.fully_shard(model, mp_policy=mp)
    buckets = [
        b for m in model.modules() if isinstance(m, fsdp2.FSDPModule) for b in m._fsdp2_state.group.buckets
    ]
    pool = buckets[0].comm.pool
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    allocations = []
    for step in range(STEPS):
        ids, targets = batch(step, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        allocations.append(pool.allocations)
        grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "grads": grads,
        "in_place": [b.in_place for b in buckets],
        "storage_freed": all(b.unsharded_bytes() == 0 for b in buckets),
        "steady_allocations": allocations[-1] - allocations[0],
    }


def _worker(rank: int, world: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> dict:
    pooled = _train(rank, world, False, param_dtype, reduce_dtype)
    in_place = _train(rank, world, True, param_dtype, reduce_dtype)
    return {"pooled": pooled, "in_place": in_place}


@pytest.mark.parametrize(
    "param_dtype,reduce_dtype",
    [(None, None), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16-reduce-in-storage", "bf16-gather-fp32-reduce"],
)
def test_in_place_is_bit_identical_to_pooled(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> None:
    for out in run_ranks(_worker, 2, param_dtype, reduce_dtype):
        pooled, in_place = out["pooled"], out["in_place"]
        assert not any(pooled["in_place"]) and all(in_place["in_place"]), out
        for key in ("params", "grads"):
            for name, want in pooled[key].items():
                assert torch.equal(in_place[key][name], want), (key, name, in_place[key][name], want)
        # Nothing pooled in the steady state, and no gathered storage left after a step.
        assert in_place["steady_allocations"] == 0 and in_place["storage_freed"], in_place


def test_gather_over_minus_zero_is_exact() -> None:
    """x + (-0.0) == x bit for bit for every non-NaN x (signed zeros, subnormals and
    infinities included); a NaN stays a NaN."""
    special = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, float("inf"), -float("inf"), float("nan"), 3.0, -2.5e38],
        dtype=torch.float32,
    )
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = special.to(dtype)
        summed = x + torch.full_like(x, -0.0)
        real = ~x.isnan()
        assert torch.equal(summed[real].view(_int(dtype)), x[real].view(_int(dtype))), dtype
        assert summed[~real].isnan().all(), dtype


def _int(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def _uneven_worker(rank: int, world: int) -> bool:
    """Three ranks: 7-row weights split 3/3/1, so every bucket has padding rows, which
    hold garbage in the reduce and must come out as zero in the shard."""
    fsdp2._bucket.IN_PLACE_MIN_BYTES = 0
    torch.manual_seed(0)
    ref = ToyModel().double()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    ids, targets = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    loss_fn(ref(ids), targets).backward()
    return all(
        torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-10, atol=1e-12)
        for p, q in zip(model.parameters(), ref.parameters())
    )


def test_three_ranks_uneven_rows_in_place() -> None:
    assert all(run_ranks(_uneven_worker, 3))


def _overlap_worker(rank: int, world: int, chain: bool) -> list[int]:
    """After each block's pre_backward: how many other blocks hold their storage."""
    import fsdp2._group as group_mod

    fsdp2._bucket.IN_PLACE_MIN_BYTES = 0
    group_mod.PREFETCH_BEHIND_REDUCE = chain
    torch.manual_seed(0)
    model = ToyModel(n_blocks=4)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    blocks = [b._fsdp2_state.group for b in model.blocks]
    counts: list[int] = []
    original = group_mod.ParamGroup.pre_backward

    def probe(self: group_mod.ParamGroup) -> None:
        original(self)
        if self in blocks:
            counts.append(sum(g is not self and any(b.unsharded_bytes() for b in g.buckets) for g in blocks))

    group_mod.ParamGroup.pre_backward = probe  # type: ignore[method-assign]
    for step in range(3):  # the first step records the order; later ones prefetch
        ids, targets = batch(step, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    return counts


def test_backward_prefetch_waits_for_the_reduce_in_flight() -> None:
    """While block k computes its gradients, block k+1's gradients are still being summed
    in its storage: block k-1's gather starts only once that storage is free, so besides
    block k at most one block's storage is resident."""
    for counts in run_ranks(_overlap_worker, 2, True):
        assert counts and max(counts) <= 1, counts
