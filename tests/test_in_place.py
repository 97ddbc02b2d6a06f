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
from _models import ToyModel, batch, force_in_place, loss_fn

import fsdp2
import fsdp2.bucket.in_place

STEPS = 3


def _train(
    rank: int, world: int, mode: str, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> dict:
    if mode == "pooled":
        fsdp2.bucket.in_place.IN_PLACE_MIN_BYTES = 1 << 62
    else:  # "in_place", or "reduce_in_place": pooled all-gather, reduce in the storage
        force_in_place(gather=mode == "in_place")
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
        "in_place": [(b.in_place is not None, b.in_place is not None and b.in_place.gathers) for b in buckets],
        "storage_freed": all(b.unsharded_bytes() == 0 for b in buckets),
        "steady_allocations": allocations[-1] - allocations[0],
    }


MODES = {"pooled": (False, False), "reduce_in_place": (True, False), "in_place": (True, True)}


def _worker(rank: int, world: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> dict:
    return {mode: _train(rank, world, mode, param_dtype, reduce_dtype) for mode in MODES}


@pytest.mark.parametrize(
    "param_dtype,reduce_dtype",
    [(None, None), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
    ids=["fp32", "bf16-reduce-in-storage", "bf16-gather-fp32-reduce"],
)
def test_in_place_is_bit_identical_to_pooled(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> None:
    for out in run_ranks(_worker, 2, param_dtype, reduce_dtype):
        for mode, flags in MODES.items():
            assert set(out[mode]["in_place"]) == {flags}, (mode, out[mode]["in_place"])
        pooled = out["pooled"]
        for mode in ("reduce_in_place", "in_place"):
            for key in ("params", "grads"):
                for name, want in pooled[key].items():
                    got = out[mode][key][name]
                    assert torch.equal(got, want), (mode, key, name, got, want)
            assert out[mode]["storage_freed"], mode  # no gathered storage left after a step
        # Nothing pooled in the steady state once gathers run in place too.
        assert out["in_place"]["steady_allocations"] == 0, out["in_place"]


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
    force_in_place()
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
    import fsdp2.runtime.group as group_mod

    force_in_place()
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


class _TwoHeads(torch.nn.Module):
    """One group of two modules (two autograd nodes per step); rank 1 leaves ``a`` out
    of its loss, so only one of the group's nodes runs there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_a: bool) -> torch.Tensor:
        return self.b(x).pow(2).mean() + (self.a(x).pow(2).mean() if use_a else 0.0)


def _uneven_nodes_worker(rank: int, world: int) -> float:
    force_in_place()
    torch.manual_seed(0)
    ref = _TwoHeads().double()
    model = copy.deepcopy(ref)
    fsdp2.fully_shard([model.a, model.b])
    x = torch.randn(2 * world, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        model(x.chunk(world)[rank], rank == 0).backward()
    total = sum(ref(xr, r == 0) for r, xr in enumerate(x.chunk(world))) / world
    (2 * total).backward()
    return max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )


def test_reduce_is_the_same_collective_when_ranks_run_different_nodes() -> None:
    """Whether a group sums in its storage may not depend on which of its nodes ran on
    a rank (that depends on the data): otherwise the ranks issue different reduces."""
    assert max(run_ranks(_uneven_nodes_worker, 2, timeout=120)) < 1e-12


def _two_targets_worker(rank: int, world: int) -> float:
    force_in_place()
    torch.manual_seed(0)
    ref = ToyModel(n_blocks=4).double()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    blocks = list(model.blocks)
    for i in range(2, 4):  # each prefetches the two blocks before it: two deferred gathers
        blocks[i].set_modules_to_backward_prefetch([blocks[i - 1], blocks[i - 2]])
    worst = 0.0
    for step in range(3):
        ids, targets = batch(step, 2 * world)
        model.zero_grad()
        ref.zero_grad()
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        loss_fn(ref(ids), targets).backward()
        worst = max(
            worst,
            max(
                (p.grad.full_tensor() - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters())
            ),
        )
    return worst


def test_deferred_gathers_keep_their_order() -> None:
    """Several gathers deferred behind one reduce are issued in program order on every
    rank (same-size blocks would otherwise be matched with each other across ranks)."""
    assert max(run_ranks(_two_targets_worker, 2, timeout=120)) < 1e-12
