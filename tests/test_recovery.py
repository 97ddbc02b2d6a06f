"""An exception in forward, in the loss or in backward leaves the model usable: after
``reset_iter_state()`` (or automatically at the next forward) the next step matches
local training, no parameter stays unsharded and no gradient is half-reduced."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp2
from _dist import run_ranks
from _models import IN_PLACE_ENV
from fsdp2._group import ShardState, TrainingState


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        raise RuntimeError("injected backward failure")


class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.fail = ""  # "", "forward" or "backward"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail == "forward":
            raise RuntimeError("injected forward failure")
        y = self.lin(x)
        return FailInBackward.apply(y) if self.fail == "backward" else y


def _groups(model: nn.Module) -> list:
    seen: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            seen.setdefault(id(m._fsdp2_state.group), m._fsdp2_state.group)
    return list(seen.values())


def _sharded_grads(model: nn.Module) -> list[torch.Tensor]:
    return [fp.sharded.grad.full_tensor() for g in _groups(model) for fp in g.params]


def _recovery_worker(rank: int, world: int, where: str, explicit_reset: bool) -> dict:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), Flaky(), nn.Linear(6, 6)).double()
    model = copy.deepcopy(ref)
    for m in model:
        fsdp2.fully_shard(m)
    fsdp2.fully_shard(model)
    x = torch.randn(2 * world, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    local = x.chunk(world)[rank]
    model(local).pow(2).mean().backward()  # a good step first: state as in real training
    ref(x).pow(2).mean().backward()
    grads_before = _sharded_grads(model)
    model[1].fail = where
    try:
        out = model(local)
        if where == "loss":
            raise RuntimeError("injected loss failure")
        out.pow(2).mean().backward()
    except RuntimeError as e:
        assert "injected" in str(e), e
    model[1].fail = ""
    # Read through the sharded parameters: after a failure the groups may still be
    # gathered (a loss that raised after forward), so the modules show the unsharded ones.
    untouched = all(torch.equal(a, b) for a, b in zip(_sharded_grads(model), grads_before))
    if explicit_reset:
        model.reset_iter_state()
        clean = all(
            g.shard_state is ShardState.SHARDED and g.training_state is TrainingState.IDLE for g in _groups(model)
        )
    else:
        clean = True  # checked after the next step
    model(local).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    worst = max(
        (p.grad.full_tensor() - q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    resharded = all(g.shard_state is ShardState.SHARDED for g in _groups(model))
    return {"grads_untouched": untouched, "clean": clean, "resharded": resharded, "parity": worst < 1e-12}


def test_recovery_after_exceptions() -> None:
    for where in ("forward", "loss", "backward"):
        for explicit in (True, False):
            for out in run_ranks(_recovery_worker, 2, where, explicit):
                assert all(out.values()), (where, explicit, out)


def test_recovery_after_backward_failure_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last module's gradients are being summed in its parameters' storage when the
    middle one raises: the reduce is waited for and the storage freed."""
    for key, value in IN_PLACE_ENV.items():
        monkeypatch.setenv(key, value)
    for out in run_ranks(_recovery_worker, 2, "backward", False):
        assert all(out.values()), out


def test_recovery_after_exceptions_on_one_rank() -> None:
    """On one rank gradients accumulate in leaf aliases of the shards: a failed backward
    must leave nothing in them either."""
    for where in ("forward", "backward"):
        for out in run_ranks(_recovery_worker, 1, where, False):
            assert all(out.values()), (where, out)
