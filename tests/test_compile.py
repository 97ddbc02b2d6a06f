"""torch.compile with fully_shard at 2 ranks, float64, with fsdp2 and with torch's
``fully_shard`` in the same ranks: each block compiled (inductor) before ``fully_shard``
(torchtitan's order) and the whole sharded model compiled. Both train exactly like a
local model compiled the same way (inductor's float64 kernels differ from eager ones by
~1e-6 after a few AdamW steps, for either library; checked against eager too), and
per-block compile has no graph break: fsdp2's hooks run eagerly around each block's
graph."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from _models import full_params, impl

LIBS = ("fsdp2", "torch")
MODES = ("blocks", "whole")
STEPS = 3


def _build() -> torch.nn.Module:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from model import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=16)).double()


def _compiled(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "blocks":
        for block in model.layers:
            block.compile()
        return model
    return torch.compile(model)


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (2 * world, 16), generator=g)
    return ids, torch.randint(0, 64, (2 * world, 16), generator=g)


@functools.cache
def _reference(mode: str, world: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The full parameters of the local model after ``STEPS`` steps on the global batches,
    trained eagerly and compiled as ``mode``: the same for either library, so trained once
    per rank (they were trained again beside each library's model, compiles included)."""
    torch._dynamo.reset()
    eager, ref = _build(), _compiled(_build(), mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ref)]
    for step in range(STEPS):
        ids, targets = _batch(step, world)
        for m in (eager, ref):
            F.cross_entropy(m(ids).flatten(0, 1), targets.flatten()).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return full_params(eager), full_params(getattr(ref, "_orig_mod", ref))


def _run(lib: Any, rank: int, world: int, mode: str) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    want_eager, want_compiled = _reference(mode, world)
    # A fresh cache: the sharded model's compiles are its own (and so are the graph breaks
    # counted).
    torch._dynamo.reset()
    counters.clear()
    model = _build()
    if mode == "blocks":
        _compiled(model, mode)
    for block in model.layers:
        lib.fully_shard(block)
    lib.fully_shard(model)
    run = _compiled(model, mode) if mode == "whole" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        ids, targets = _batch(step, world)
        out = run(ids.chunk(world)[rank])
        F.cross_entropy(out.flatten(0, 1), targets.chunk(world)[rank].flatten()).backward()
        opt.step()
        opt.zero_grad()
    got = full_params(model)

    def worst(want: dict[str, torch.Tensor]) -> float:
        return max((got[n] - want[n]).abs().max().item() for n in want)

    return {
        "vs_compiled": worst(want_compiled), "vs_eager": worst(want_eager),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    import torch.distributed as dist

    # Rank 0 compiles the local models first, the others then: with a cold inductor cache
    # they find the kernels there instead of compiling the same ones at the same time (the
    # sharded blocks' too: the same graph as the local blocks').
    for mode in MODES:
        if rank:
            dist.barrier()
        _reference(mode, world)
        if not rank:
            dist.barrier()
    return {lib_name: {mode: _run(impl(lib_name), rank, world, mode) for mode in MODES} for lib_name in LIBS}


@functools.cache
def _spawned() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_worker, 2, timeout=400)


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("mode", MODES)
def test_compiled_training_matches_the_same_compiled_local_model(lib_name: str, mode: str) -> None:
    for out in _spawned():
        res = out[lib_name][mode]
        assert res["vs_compiled"] <= 1e-12, res
        assert res["vs_eager"] <= 1e-5, res


@pytest.mark.parametrize("lib_name", LIBS)
def test_per_block_compile_has_no_graph_break(lib_name: str) -> None:
    for out in _spawned():
        assert out[lib_name]["blocks"]["graph_breaks"] == 0, out[lib_name]["blocks"]
