"""An exception in forward, in the loss or in backward leaves the model usable: after
``reset_iter_state()`` (or automatically at the next forward) the next step matches
local training, no parameter stays unsharded and no gradient is half-reduced."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn as nn
from _dist import run_ranks
from _models import in_place_worker

import fsdp2
from fsdp2._compat import TORCH
from fsdp2.runtime.group import ShardState, TrainingState


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
        if TORCH.reset_clears_grads:  # torch 2.15's reset_iter_state drops .grad too
            clean = clean and all(p.grad is None for p in model.parameters())
            ref.zero_grad()
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


def test_recovery_after_backward_failure_in_place() -> None:
    """The last module's gradients are being summed in its parameters' storage when the
    middle one raises: the reduce is waited for and the storage freed."""
    for out in run_ranks(functools.partial(in_place_worker, _recovery_worker), 2, "backward", False):
        assert all(out.values()), out


def test_recovery_after_exceptions_on_one_rank() -> None:
    """On one rank gradients accumulate in leaf aliases of the shards: a failed backward
    must leave nothing in them either."""
    for where in ("forward", "backward"):
        for out in run_ranks(_recovery_worker, 1, where, False):
            assert all(out.values()), (where, out)


def _tp_reset_communicates_nothing(out: Any) -> None:
    """One rank of a fake dp 2 x tp 2 job: a backward raises after TP gradients (Partial)
    reached the unsharded leaves; ``reset_iter_state`` drops them without a collective
    (a recovery that only some ranks run must not wait for the others)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    for layer in model:
        layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh["tp"], [Replicate()]))
    fsdp2.fully_shard(model, mesh=mesh["dp"])

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.view_as(t)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    x = DTensor.from_local(torch.randn(2, 4, requires_grad=True), mesh["tp"], [Shard(0)])
    kept = model(x)  # a forward whose backward never runs: the group waits for its node
    try:
        model(Boom.apply(x)).to_local().sum().backward()
    except RuntimeError:
        pass
    partial = sum(fp.unsharded.grad is not None for fp in model._fsdp2_state.group.params)
    calls = []
    original = DTensor.redistribute
    DTensor.redistribute = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    model.reset_iter_state()
    DTensor.redistribute = original
    out.put({"leaf_grads_before": partial, "redistributes": len(calls)})
    del kept


def test_reset_after_tensor_parallel_backward_failure_communicates_nothing() -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_tp_reset_communicates_nothing, args=(out,))
    proc.start()
    result = out.get(timeout=120)
    proc.join(timeout=30)
    assert result == {"leaf_grads_before": 2, "redistributes": 0}, result
