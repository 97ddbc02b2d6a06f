"""User collectives and hooks at 2 ranks, each also with torch's ``fully_shard``:
``set_all_reduce_hook`` (1D and HSDP) sees the reduced gradients and what it writes is
what the optimizer gets; ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` are
called with the library's buffers and train exactly as the default collectives do."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _models import ToyModel, batch, full_params, impl, loss_fn
from torch.distributed.device_mesh import init_device_mesh

LIBS = ("fsdp2", "torch")


class Gather:
    """torch's AllGather protocol over ``all_gather_into_tensor``, counting calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ReduceScatter:
    """torch's ReduceScatter protocol as an all-reduce of a copy, then this rank's chunk."""

    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        self.calls += 1
        full = input_tensor.clone()
        dist.all_reduce(full, op=op, group=group)
        output_tensor.copy_(full.view(group.size(), -1)[group.rank()])
        return None


def _train(lib: Any, rank: int, world: int, setup: Any = None, mesh: Any = None, lr: float = 0.1) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = ToyModel(scalar_gate=False).double()
    kwargs = {} if mesh is None else {"mesh": mesh}
    for block in model.blocks:
        lib.fully_shard(block, **kwargs)
    lib.fully_shard(model, **kwargs)
    if setup is not None:
        setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(2):
        ids, targets = batch(step, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    return full_params(model)


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _hook_run(lib: Any, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """A hook that doubles the reduced gradients equals training at twice the rate."""
    seen: list[torch.dtype] = []

    def double(t: torch.Tensor) -> None:
        seen.append(t.dtype)
        t.mul_(2)

    def setup(model: Any) -> None:
        for m in [*model.blocks, model]:
            m.set_all_reduce_hook(double)

    hooked = _train(lib, rank, world, setup, mesh)
    doubled = _train(lib, rank, world, mesh=mesh, lr=0.2)  # doubled gradients = twice the lr (plain SGD)
    return {"worst": _worst(hooked, doubled), "calls": len(seen), "dtypes": sorted({str(d) for d in seen})}


def _zeroing_hook(lib: Any, rank: int, world: int) -> list[Any]:
    """A hook that zeroes everything (e.g. skipping a step on overflow): every gradient
    is zero, none is None (torch's behavior; fsdp2 would otherwise read its "used"
    flags)."""
    torch.manual_seed(0)
    model = ToyModel(scalar_gate=False).double()
    lib.fully_shard(model)
    model.set_all_reduce_hook(lambda t: t.zero_())
    ids, targets = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    return [None if p.grad is None else float(p.grad.to_local().abs().sum()) for p in model.parameters()]


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    for lib_name in LIBS:
        lib = impl(lib_name)
        res: dict[str, Any] = {"hook_1d": _hook_run(lib, rank, world, None), "hook_hsdp": _hook_run(lib, rank, world, hsdp)}
        res["zeroing"] = _zeroing_hook(lib, rank, world)
        plain = _train(lib, rank, world)
        gather, scatter = Gather(), ReduceScatter()

        def custom(model: Any) -> None:
            for m in [*model.blocks, model]:
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)

        res["custom"] = {"worst": _worst(_train(lib, rank, world, custom), plain), "gathers": gather.calls, "scatters": scatter.calls}
        out[lib_name] = res
    return out


@functools.cache
def _spawned() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("case", ["hook_1d", "hook_hsdp"])
def test_all_reduce_hook_result_is_what_the_optimizer_gets(lib_name: str, case: str) -> None:
    for out in _spawned():
        res = out[lib_name][case]
        assert res["worst"] <= 1e-12, res
        assert res["calls"] >= 2 * 4 and res["dtypes"] == ["torch.float64"], res  # every group, every step


@pytest.mark.parametrize("lib_name", LIBS)
def test_custom_collectives_are_used_and_train_as_the_default(lib_name: str) -> None:
    for out in _spawned():
        res = out[lib_name]["custom"]
        assert res["worst"] <= 1e-12, res
        assert res["gathers"] > 0 and res["scatters"] == 2 * 4, res  # a reduce per group per step


@pytest.mark.parametrize("lib_name", LIBS)
def test_a_zeroing_hook_gives_zero_gradients(lib_name: str) -> None:
    for out in _spawned():
        assert out[lib_name]["zeroing"] and all(g == 0.0 for g in out[lib_name]["zeroing"]), out[lib_name]["zeroing"]
