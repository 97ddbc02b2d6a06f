"""While a group is unsharded its modules show the unsharded ``nn.Parameter``s, otherwise
the sharded DTensors; gradients computed on the unsharded parameters outside fsdp2's
hooks (a direct call of an inner module after ``unshard()``, on every rank or on one
only) reach the reduce once; ``set_unshard_in_backward(False)`` skips the backward
all-gather. Each worker also runs with torch's ``fully_shard``, which keeps the
expectations honest."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from _comm import CommCounter
from _dist import run_ranks
from _models import ToyModel, batch, full_params, impl, loss_fn
from torch.distributed.tensor import DTensor

LIBS = ["fsdp2", "torch"]


def _is_unsharded(p: torch.Tensor, shape: torch.Size) -> bool:
    return type(p) is nn.Parameter and p.shape == shape


def _shard(lib: Any, model: nn.Module, **kwargs: Any) -> nn.Module:
    for block in model.blocks:
        lib.fully_shard(block, **kwargs)
    return lib.fully_shard(model, **kwargs)


def _visibility(lib: Any) -> dict[str, bool]:
    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=False)
    model = _shard(lib, copy.deepcopy(ref))
    block = model.blocks[1]
    out = {"sharded_at_start": all(isinstance(p, DTensor) for p in model.parameters())}
    handle = block.unshard(async_op=True)
    handle.wait()
    out["unshard_shows_parameters"] = all(
        _is_unsharded(p, q.shape) and torch.equal(p.detach(), q.detach())
        for p, q in zip(block.parameters(), ref.blocks[1].parameters())
    )
    out["others_stay_sharded"] = isinstance(model.blocks[0].fc1.weight, DTensor)
    block.reshard()
    out["reshard_shows_dtensors"] = all(isinstance(p, DTensor) for p in block.parameters())
    return out


def _kept_after_forward(lib: Any, rank: int, world: int) -> dict[str, bool]:
    torch.manual_seed(0)
    model = _shard(lib, ToyModel(scalar_gate=False), reshard_after_forward=False)
    ids, tg = batch(0, 2 * world)
    loss = loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank])
    shapes = {n: p.shape for n, p in ToyModel(scalar_gate=False).named_parameters()}
    out = {"kept_shows_parameters": all(_is_unsharded(p, shapes[n]) for n, p in model.named_parameters())}
    loss.backward()
    out["after_backward_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
    return out


def _extra_terms(model: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """Inner modules of the root and of the last block, called directly."""
    return model.extra(z).pow(2).mean() + model.blocks[2].fc2(model.blocks[2].fc1(z)).mean()


def _direct_calls(lib: Any, rank: int, world: int, only_rank0: bool) -> float:
    """After ``model.unshard()``, every rank (or rank 0 only) also computes loss terms by
    calling inner modules of the root and of a block directly, before the model's forward
    (step 0) or after it (step 1); two SGD steps equal local training on the same terms (relative error over
    tolerance, <= 1 passes), and each group reduces once per step."""
    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=False).double()
    model = _shard(lib, copy.deepcopy(ref))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    z = torch.randn(world, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    reduces = []
    for step in range(2):
        ids, tg = batch(step, 2 * world)
        model.unshard()
        model.blocks[2].unshard()
        direct = rank == 0 or not only_rank0
        with CommCounter().active() as counter:
            # The direct calls come before the forward in step 0, after it in step 1.
            extra = _extra_terms(model, z[rank]) if direct and step == 0 else 0.0
            loss = loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank])
            if direct and step == 1:
                extra = _extra_terms(model, z[rank])
            (loss + extra).backward()
        reduces.append(counter.calls["reduce"])
        ref_loss = loss_fn(ref(ids), tg)
        for r in range(world) if not only_rank0 else [0]:
            ref_loss = ref_loss + _extra_terms(ref, z[r]) / world
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    if any(n != 4 for n in reduces):  # root and three blocks, once each
        return float("inf")
    got, want = full_params(model), full_params(ref)
    worst = max(((got[n] - want[n]).abs() / (1e-12 + 1e-10 * want[n].abs())).max().item() for n in want)
    return float("inf") if worst != worst else worst


def _unshard_in_backward(lib: Any, rank: int, world: int, unshard_in_backward: bool) -> tuple[int, float]:
    """The embedding in a group of its own, not gathered for backward (its weight's
    gradient needs only the indices): one all-gather fewer, the same gradients."""
    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=False, tie=False).double()
    model = copy.deepcopy(ref)
    emb = lib.fully_shard(model.emb)
    emb.set_unshard_in_backward(unshard_in_backward)
    _shard(lib, model)
    ids, tg = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()  # records the order
    model.zero_grad()
    with CommCounter().active() as counter:
        loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()
    loss_fn(ref(ids), tg).backward()
    worst = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return counter.calls["all_gather"], worst


def _window_edges(rank: int, world: int) -> dict[str, Any]:
    """The unsharded window's edges, each of which once hung, split the model or left
    state behind."""
    import warnings

    import fsdp2

    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=False).double()
    model = _shard(fsdp2, copy.deepcopy(ref))
    groups = [m._fsdp2_state.group for m in (model, *model.blocks)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out: dict[str, Any] = {}
    # A block unsharded and resharded before the first forward (to look at its weights):
    # it joins the root's context and leaves nothing behind.
    model.blocks[1].unshard()
    model.blocks[1].reshard()
    ids, tg = batch(0, 2 * world)
    model(ids.chunk(world)[rank]).sum()  # a forward with grad and no backward: root kept gathered
    out["one_context"] = all(g.ctx is groups[0].ctx for g in groups)
    out["nothing_left_after_reshard"] = not (groups[2].held_by_user or groups[2].calls.reduce_at_finalize)
    # state_dict() on one rank only while the root is gathered: no collective, so the
    # next backward issues the same collectives on every rank.
    if rank == 0:
        out["state_dict_sharded"] = all(isinstance(v, DTensor) for v in model.state_dict().values())
    out["still_shows_gathered"] = type(model.head.weight) is nn.Parameter
    # A backward on one rank only, through the root's unsharded parameters: nothing to
    # reduce then (no hang); the next step warns that those gradients came late.
    model.zero_grad()
    model.unshard()
    if rank == 0:
        model.extra(torch.randn(3, 6, dtype=torch.float64)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warned_late"] = any("no backward of the model reduced" in str(w.message) for w in caught) == (rank == 0)
    loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()
    out["trained_after"] = all(p.grad is not None for p in model.parameters())
    return out


def _worker(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    out: dict[str, Any] = {}
    out.update(_visibility(lib))
    out.update(_kept_after_forward(lib, rank, world))
    out["gathers_unshard_in_backward"] = _unshard_in_backward(lib, rank, world, True)
    out["gathers_no_unshard_in_backward"] = _unshard_in_backward(lib, rank, world, False)
    if lib_name == "fsdp2":  # torch's forward frees what unshard() gathered: no window to test
        out["direct_calls_every_rank"] = _direct_calls(lib, rank, world, only_rank0=False)
        out["direct_calls_rank0_only"] = _direct_calls(lib, rank, world, only_rank0=True)
        out["edges"] = _window_edges(rank, world)
    return out


@functools.cache
def _results(lib_name: str) -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, lib_name)


@pytest.mark.parametrize("lib_name", LIBS)
def test_modules_show_what_the_shard_state_holds(lib_name: str) -> None:
    for out in _results(lib_name):
        for key in ("sharded_at_start", "unshard_shows_parameters", "others_stay_sharded", "reshard_shows_dtensors",
                    "kept_shows_parameters", "after_backward_dtensors"):
            assert out[key], (key, out)


def test_direct_calls_after_unshard_reduce_once() -> None:
    """Inner modules called directly after ``unshard()``, before the model's forward, on
    every rank; the root's and a block's parameters."""
    for out in _results("fsdp2"):
        assert out["direct_calls_every_rank"] <= 1.0, out


def test_direct_calls_on_one_rank_only_reduce_once() -> None:
    """Only rank 0 computes the extra terms: every rank still issues the same reduces."""
    for out in _results("fsdp2"):
        assert out["direct_calls_rank0_only"] <= 1.0, out


@pytest.mark.parametrize("lib_name", LIBS)
def test_set_unshard_in_backward(lib_name: str) -> None:
    for out in _results(lib_name):
        with_gather, worst_with = out["gathers_unshard_in_backward"]
        without, worst_without = out["gathers_no_unshard_in_backward"]
        assert without == with_gather - 1, out
        assert worst_with < 1e-12 and worst_without < 1e-12, out


def test_the_window_edges_hang_nothing_and_leave_nothing() -> None:
    for out in _results("fsdp2"):
        assert all(out["edges"].values()), out["edges"]
