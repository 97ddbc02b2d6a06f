"""fsdp2's collective formulations on gloo, checked against sums computed locally."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import run_ranks

from fsdp2.comm.collectives import reduce_scatter_flat, wait_pending

N = 37  # per-rank columns; the last 5 are written alike on every row (flags, scalars)


def _inputs(rank: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    # Magnitudes far apart: a different summation order changes the float32 result.
    x = torch.randn(world, N, generator=gen) * torch.logspace(-6, 6, N)
    x[:, -5:] = x[0, -5:]  # like the flags and replicated scalars: the same in every row
    return x


def _reduce_worker(rank: int, world: int) -> dict:
    x = _inputs(rank, world)
    scratch = torch.empty_like(x)
    pending = reduce_scatter_flat(x, dist.group.WORLD, rank, "all_to_all", scratch, label="test")
    got = wait_pending(pending).clone()
    want = _inputs(0, world)[rank].clone()
    for r in range(1, world):
        want += _inputs(r, world)[rank]  # rank order
    tails = [torch.empty(5) for _ in range(world)]
    dist.all_gather(tails, got[-5:].contiguous())
    return {"exact": torch.equal(got, want), "same_tails": all(torch.equal(t, tails[0]) for t in tails)}


def test_all_to_all_reduce_sums_in_rank_order_and_agrees_across_ranks() -> None:
    for out in run_ranks(_reduce_worker, 3):
        assert out == {"exact": True, "same_tails": True}, out


def _older_names_worker(rank: int, world: int) -> dict:
    """Torch before 2.13 names the flat collectives ``_allgather_base``,
    ``_reduce_scatter_base`` and ``alltoall_base``; fsdp2 calls those there."""
    import fsdp2.comm.collectives as c

    c._ALL_GATHER_SINGLE, c._REDUCE_SCATTER_SINGLE, c._ALL_TO_ALL_SINGLE = (
        "_allgather_base", "_reduce_scatter_base", "alltoall_base"
    )
    shard = torch.arange(4.0) + 10 * rank
    out = torch.empty(4 * world)
    gathered = wait_pending(c.all_gather_flat(shard, out, dist.group.WORLD, "test")).clone()
    want_gathered = torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])
    x = _inputs(rank, world)
    want = sum(_inputs(r, world)[rank] for r in range(world))
    reduced = {
        method: wait_pending(
            reduce_scatter_flat(x.clone(), dist.group.WORLD, rank, method, torch.empty_like(x), label="test")
        ).clone()
        for method in ("all_to_all", "reduce_scatter")
    }
    return {"gathered": torch.equal(gathered, want_gathered),
            **{m: torch.allclose(r, want, rtol=1e-6, atol=0) for m, r in reduced.items()}}


def test_older_torch_collective_names() -> None:
    for out in run_ranks(_older_names_worker, 3):
        assert out == {"gathered": True, "all_to_all": True, "reduce_scatter": True}, out
