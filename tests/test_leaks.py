"""Nothing leaks: a long run keeps memory and Python objects flat, building and dropping
sharded models frees everything, and two identical runs are bitwise equal."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fsdp2
from _dist import run_ranks
from _models import ToyModel, batch, full_params, loss_fn


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _build(seed: int = 0) -> tuple[ToyModel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = ToyModel()
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: ToyModel, opt: torch.optim.Optimizer, steps: int, rank: int, world: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        ids, targets = batch(step % 7, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()


def _long_run(rank: int, world: int) -> dict:
    model, opt = _build()
    _train(model, opt, 200, rank, world)
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_mb()
    _train(model, opt, 1000, rank, world, start=200)
    gc.collect()
    return {"objects": len(gc.get_objects()) - objects, "rss_mb": _rss_mb() - rss}


def test_long_run_keeps_objects_and_memory_flat() -> None:
    for out in run_ranks(_long_run, 2, timeout=600):
        # A leak of one object a step would show ~1000; a few may be in flight at the count
        # when another test file runs beside this one (pytest-xdist).
        assert out["objects"] < 50, out
        assert out["rss_mb"] < 4.0, out


def _build_teardown(rank: int, world: int) -> dict:
    import importlib

    fs = importlib.import_module("fsdp2.fully_shard")  # the module, not the function
    from fsdp2.params.param import _SHARDED_OWNER

    counts = []
    for i in range(12):
        model, opt = _build(i)
        _train(model, opt, 2, rank, world)
        del model, opt
        gc.collect()
        counts.append((len(gc.get_objects()), len(_SHARDED_OWNER), len(fs._REPLACED)))
    return {"counts": counts}


def test_build_and_teardown_free_everything() -> None:
    for out in run_ranks(_build_teardown, 2):
        counts = out["counts"]
        assert counts[-1][1] == counts[-1][2] == 0, counts  # registries emptied
        assert counts[-1][0] <= counts[3][0], counts  # object count flat after warm-up


def _deterministic(rank: int, world: int) -> bool:
    params = []
    for _ in range(2):
        model, opt = _build(0)
        _train(model, opt, 5, rank, world)
        params.append(full_params(model))
    return all(torch.equal(params[0][n], params[1][n]) for n in params[0])


def test_identical_runs_are_bitwise_equal() -> None:
    assert run_ranks(_deterministic, 3) == [True, True, True]


def _grads_freed(rank: int, world: int) -> list[int]:
    torch.manual_seed(0)
    model = ToyModel(scalar_gate=False)  # every bucket steps flat: the optimizer keeps its plan
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alive = []
    for step in range(4):
        ids, targets = batch(step, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        grads = [p.grad for p in model.parameters()]
        # The DTensors, their local views and the flat tensor those views share.
        tensors = [t for g in grads for t in (g, g._local_tensor, g._local_tensor._base) if t is not None]
        refs = [weakref.ref(t) for t in tensors]
        del grads, tensors
        opt.step()
        opt.zero_grad(set_to_none=True)
        gc.collect()
        alive.append(sum(r() is not None for r in refs))
    return alive


@pytest.mark.parametrize("world", [1, 2])
def test_zero_grad_frees_the_gradients(world: int) -> None:
    """Nothing of fsdp2's (the optimizer's kept plan, the buckets' record of the flat
    gradients they committed) holds gradients past ``zero_grad(set_to_none=True)``."""
    for alive in run_ranks(_grads_freed, world):
        assert alive == [0, 0, 0, 0], alive
