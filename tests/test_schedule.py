"""The communication schedule: how many collectives, how many bytes, and that
prefetching really issues all-gathers ahead of the compute that needs them."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from _comm import CommCounter
from _dist import cached_outcome, run_ranks, run_scenarios
from _models import ToyModel, batch, in_place_worker, loss_fn

import fsdp2
from fsdp2.runtime.group import ShardState

N_BLOCKS = 3


def _shard(model: ToyModel, **kwargs: object) -> ToyModel:
    for block in model.blocks:
        fsdp2.fully_shard(block, **kwargs)
    return fsdp2.fully_shard(model, **kwargs)


def _group(module: nn.Module):  # noqa: ANN202
    return module._fsdp2_state.group


def _padded_bytes(group, world: int) -> tuple[int, int]:  # noqa: ANN001
    """(all-gather output bytes, reduce input bytes) of one group, from its layout.
    Reduced in place (gloo, large buckets), the flags are there once, not once per rank."""
    gather = sum(world * b.shard_numel * b.compute_dtype.itemsize for b in group.buckets)
    reduce = sum(
        (world * b.shard_numel + len(b.params) + len(b.scalars) if b.in_place is not None else world * b.reduce.layout().numel)
        * b.reduce_dtype.itemsize
        for b in group.buckets
    )
    return gather, reduce


def _count_worker(rank: int, world: int, reshard: bool) -> dict:
    torch.manual_seed(0)
    model = _shard(ToyModel(n_blocks=N_BLOCKS), reshard_after_forward=reshard)
    ids, targets = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()  # warm-up
    with CommCounter().active() as counter:
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    groups = [_group(b) for b in model.blocks] + [_group(model)]
    sizes = [_padded_bytes(g, world) for g in groups]
    in_place = [b.in_place is not None for g in groups for b in g.buckets]
    return {"calls": dict(counter.calls), "bytes": dict(counter.bytes), "sizes": sizes, "in_place": in_place}


@pytest.mark.parametrize("in_place", [False, True])
def test_one_all_gather_per_unshard_one_reduce_per_group(in_place: bool) -> None:
    # In place, gathers are all-reduces; the counter still sees one all-gather each.
    worker = functools.partial(in_place_worker, _count_worker) if in_place else _count_worker
    for reshard in (True, False):
        for out in run_ranks(worker, 2, reshard):
            assert out["in_place"] == [in_place] * len(out["in_place"]), out
            block_gather = sum(g for g, _ in out["sizes"][:N_BLOCKS])
            root_gather = out["sizes"][-1][0]
            reduce_bytes = sum(r for _, r in out["sizes"])
            # Forward gathers every group once; backward re-gathers the resharded blocks
            # (the root is kept: reshard_after_forward=True applies to it explicitly here).
            regathers = N_BLOCKS + 1 if reshard else 0
            assert out["calls"]["all_gather"] == N_BLOCKS + 1 + regathers, out
            assert out["calls"]["reduce"] == N_BLOCKS + 1, out
            expected_gather = block_gather + root_gather + (block_gather + root_gather if reshard else 0)
            assert out["bytes"]["all_gather"] == expected_gather, out
            assert out["bytes"]["reduce"] == reduce_bytes, out


def _bytes_vs_torch_worker(rank: int, world: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    out = {}
    for name, lib in (("fsdp2", fsdp2), ("torch", torch_fsdp)):
        torch.manual_seed(0)
        model = ToyModel(n_blocks=N_BLOCKS, scalar_gate=False)
        for block in model.blocks:
            lib.fully_shard(block)
        lib.fully_shard(model)
        ids, targets = batch(0, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        with CommCounter().active() as counter:
            loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        out[name] = (dict(counter.calls), dict(counter.bytes))
    return out


def test_no_more_collectives_or_gather_bytes_than_torch() -> None:
    out = _at2()["bytes_vs_torch"][0]
    (ours_calls, ours_bytes), (torch_calls, torch_bytes) = out["fsdp2"], out["torch"]
    # One all-gather fewer: the last block keeps its parameters for backward.
    assert ours_calls == {"all_gather": torch_calls["all_gather"] - 1, "reduce": torch_calls["reduce"]}, out
    assert ours_bytes["all_gather"] <= torch_bytes["all_gather"], out
    # Reduce input: the same padded gradients plus one "used" flag per parameter.
    n_flags = sum(1 for _ in ToyModel(n_blocks=N_BLOCKS).parameters())
    assert ours_bytes["reduce"] <= torch_bytes["reduce"] + 2 * n_flags * 4, out


def _prefetch_worker(rank: int, world: int, explicit: bool) -> dict:
    torch.manual_seed(0)
    model = _shard(ToyModel(n_blocks=4))
    blocks = list(model.blocks)
    if explicit:
        for i, block in enumerate(blocks[:-2]):
            block.set_modules_to_forward_prefetch([blocks[i + 2]])
        for i, block in enumerate(blocks[2:], start=2):
            block.set_modules_to_backward_prefetch([blocks[i - 2]])
    seen_forward: list[tuple[int, str, int]] = []
    seen_backward: list[tuple[int, str]] = []

    def forward_probe(i: int):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple) -> None:
            ahead = i + (2 if explicit else 1)
            state = _group(blocks[ahead]).shard_state.name if ahead < len(blocks) else "-"
            alive = sum(_group(b).shard_state is not ShardState.SHARDED for b in blocks)
            seen_forward.append((i, state, alive))
            if torch.is_grad_enabled():
                args[0].register_hook(lambda g: seen_backward.append((i, backward_state(i))))

        return hook

    def backward_state(i: int) -> str:
        behind = i - (2 if explicit else 1)
        return _group(blocks[behind]).shard_state.name if behind >= 0 else "-"

    for i, block in enumerate(blocks):
        block.fc1.register_forward_pre_hook(forward_probe(i))
    ids, targets = batch(0, 2 * world)
    for _step in range(2):  # the first step records the order, the second prefetches
        seen_forward.clear()
        seen_backward.clear()
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    return {"forward": seen_forward, "backward": seen_backward}


def test_implicit_prefetch_issues_ahead_and_bounds_memory() -> None:
    for out in _at2()["prefetch_implicit"]:
        fwd = {i: (state, alive) for i, state, alive in out["forward"]}
        for i in range(3):
            assert fwd[i][0] in ("GATHERING", "UNSHARDED"), out  # block i+1 already issued
        assert all(alive <= 2 for _, alive in fwd.values()), out  # current + prefetched
        bwd = dict(out["backward"])
        for i in (1, 2, 3):
            assert bwd[i] in ("GATHERING", "UNSHARDED"), out  # block i-1 issued during block i


def test_explicit_prefetch_overrides_order() -> None:
    for out in _at2()["prefetch_explicit"]:
        fwd = {i: state for i, state, _ in out["forward"]}
        assert fwd[0] in ("GATHERING", "UNSHARDED") and fwd[1] in ("GATHERING", "UNSHARDED"), out
        bwd = dict(out["backward"])
        assert bwd[2] in ("GATHERING", "UNSHARDED") and bwd[3] in ("GATHERING", "UNSHARDED"), out


def _pool_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _shard(ToyModel(n_blocks=4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pool = _group(model).comm.pool
    ids, targets = batch(0, 2 * world)
    counts, held = [], []
    for _ in range(4):
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
        counts.append(pool.allocations)
        held.append(len(pool._in_use))
    return {"counts": counts, "held": held}


def test_steady_state_allocates_no_communication_buffers() -> None:
    for out in _at2()["pool"]:
        counts, held = out["counts"], out["held"]
        assert counts[1] == counts[2] == counts[3], counts
        assert held[1] == held[2] == held[3], held  # nothing handed out and never given back


class Adapted(nn.Module):
    """A bf16 base layer with an fp32 adapter in the same group."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(6, 6).to(torch.bfloat16)
        self.adapter = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.to(torch.bfloat16)).float() + self.adapter(x)


def _mixed_dtype_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = Adapted()
    model = fsdp2.fully_shard(Adapted())
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2 * world, 6, generator=torch.Generator().manual_seed(0))
    with CommCounter().active() as counter:
        model(x.chunk(world)[rank]).sum().backward()
    ref(x).sum().backward()
    grads_ok = all(
        torch.allclose(p.grad.full_tensor().float(), q.grad.float() / world, rtol=1e-2, atol=1e-2)  # mean of sums
        and p.grad.dtype == q.dtype
        for p, q in zip(model.parameters(), ref.parameters())
    )
    return {"calls": dict(counter.calls), "grads_ok": grads_ok, "dtypes": sorted(str(b.dtype) for b in _group(model).buckets)}


def test_group_mixing_dtypes_runs_one_collective_per_dtype() -> None:
    for out in _at2()["mixed_dtype"]:
        assert out["dtypes"] == ["torch.bfloat16", "torch.float32"], out
        # forward all-gather per dtype (the root is kept for backward), reduce per dtype
        assert out["calls"] == {"all_gather": 2, "reduce": 2}, out
        assert out["grads_ok"], out


def _profiler_worker(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    model = _shard(ToyModel(n_blocks=2))
    ids, targets = batch(0, 2 * world)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("fsdp2::")})


def test_profiler_labels_tell_the_story() -> None:
    names = _at2()["profiler"][0]
    for label in ("fsdp2::all_gather", "fsdp2::reduce_scatter", "fsdp2::reduce_prepare",
                  "fsdp2::grad_copy", "fsdp2::wait"):
        assert label in names, names
    # Gathered into a pooled buffer and copied out, or (large buckets on gloo) in place.
    assert "fsdp2::copy_out" in names or "fsdp2::copy_in" in names, names


def _kept_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyModel(n_blocks=N_BLOCKS)
    for block in model.blocks:
        fsdp2.fully_shard(block)  # the default, reshard_after_forward=None
    fsdp2.fully_shard(model)
    states: list[list[str]] = []
    model.register_forward_hook(lambda m, a, o: states.append([_group(b).shard_state.name for b in model.blocks]))
    ids, targets = batch(0, 2 * world)
    calls = []
    for _ in range(2):  # the first step records the forward order
        with CommCounter().active() as counter:
            loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        calls.append(counter.calls["all_gather"])
    return {"states": states, "calls": calls, "after": [_group(b).shard_state.name for b in model.blocks]}


def test_last_block_stays_gathered_for_backward_by_default() -> None:
    """With ``reshard_after_forward=None`` the last block to run forward keeps its
    parameters for its backward, which comes first: one all-gather fewer than torch's."""
    for out in _at2()["kept"]:
        assert out["states"][0] == ["SHARDED"] * N_BLOCKS, out  # order not known yet
        assert out["states"][1] == ["SHARDED"] * (N_BLOCKS - 1) + ["UNSHARDED"], out
        # Forward: root and every block; backward: every block but the last.
        assert out["calls"] == [2 * N_BLOCKS + 1, 2 * N_BLOCKS], out
        assert out["after"] == ["SHARDED"] * N_BLOCKS, out  # freed after its backward


@cached_outcome
def _at2() -> dict[str, list]:
    """The scenarios at 2 ranks that need no environment, one after the other in one spawn."""
    return run_scenarios(2, {
        "pool": (_pool_worker, ()),  # first: the process' buffer pool holds no idle buffers yet
        "bytes_vs_torch": (_bytes_vs_torch_worker, ()),
        "prefetch_implicit": (_prefetch_worker, (False,)),
        "prefetch_explicit": (_prefetch_worker, (True,)),
        "mixed_dtype": (_mixed_dtype_worker, ()),
        "profiler": (_profiler_worker, ()),
        "kept": (_kept_worker, ()),
    })
