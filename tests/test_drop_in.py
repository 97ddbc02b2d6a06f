"""Edge cases a script written for torch's ``fully_shard`` meets, at 2 ranks; each case
runs with fsdp2 and with torch's ``fully_shard`` in the same ranks (torch handles each,
which keeps the expectations honest): containers without forward are refused up front,
slicing a sharded ``nn.Sequential`` gives a working module, ``model.to(dtype)`` keeps an
explicit mixed-precision policy, a parameter reassigned before the first forward is
adopted, and an integer ``reshard_after_forward`` of 1 or of the shard size is accepted."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from _models import ToyModel, batch, full_params, impl, loss_fn
from torch.distributed.tensor import DTensor, distribute_tensor

LIBS = ("fsdp2", "torch")


def _refuses_containers(lib: Any) -> dict[str, str]:
    out = {}
    for container in (nn.ModuleList([nn.Linear(2, 2)]), nn.ModuleDict({"a": nn.Linear(2, 2)})):
        try:
            lib.fully_shard(container)
            out[type(container).__name__] = "accepted"
        except ValueError as e:
            untouched = not isinstance(container, lib.FSDPModule) and not isinstance(next(container.parameters()), DTensor)
            out[type(container).__name__] = f"ValueError untouched={untouched}: {e}"
    return out


def _slicing(lib: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    for layer in (model[0], model[2], model[3]):
        lib.fully_shard(layer)
    lib.fully_shard(model)
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the root runs forward first (torch requires it)
    head = model[:2]
    want = torch.tanh(x @ model[0].weight.full_tensor().T + model[0].bias.full_tensor())
    with torch.no_grad():
        out = head(x)
    model.zero_grad()
    model(x).sum().backward()  # the whole model still trains after its slice ran
    return {
        "type": type(head).__name__,
        "children_sharded": isinstance(head[0], lib.FSDPModule),
        "values": torch.allclose(out, want),
        "grads": all(p.grad is not None for p in model.parameters()),
    }


def _to_keeps_policy(lib: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).to(torch.bfloat16)
    policy = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    lib.fully_shard(model[0], mp_policy=policy)
    lib.fully_shard(model, mp_policy=policy)
    model.to(torch.float32)
    out = model(torch.randn(2, 4))
    out.float().sum().backward()
    return {
        "params": {p.dtype for p in model.parameters()} == {torch.float32},
        "output": str(out.dtype),
        "grads": {p.grad.dtype for p in model.parameters()} == {torch.float32},
    }


def _reassigned(lib: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    lib.fully_shard(model[0])
    lib.fully_shard(model)
    old = model[0].weight
    value = torch.full((4, 4), 0.25)
    model[0].weight = nn.Parameter(distribute_tensor(value, old.device_mesh, old.placements))
    new = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # holds the new parameter
    x = torch.ones(2, 4)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    want = (x @ value.T + full["0.bias"]) @ full["1.weight"].T + full["1.bias"]
    out = model(x)
    before = out.detach().clone()
    out.sum().backward()
    opt.step()
    return {
        "forward_uses_it": torch.allclose(before, want),
        "kept_object": model[0].weight is new,
        "stepped": not torch.equal(model[0].weight.full_tensor(), value),
    }


def _no_forward(lib: Any) -> dict[str, Any]:
    """A module used only through a registered method (no forward) is accepted."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    torch.manual_seed(0)
    enc = Encoder()
    want = enc.proj(torch.ones(2, 4)).detach()
    lib.fully_shard(enc)
    lib.register_fsdp_forward_method(enc, "encode")
    return {"same": torch.allclose(enc.encode(torch.ones(2, 4)).detach(), want)}


def _reassigned_mixed_dtypes(lib: Any) -> dict[str, Any]:
    """A group with two dtypes (an unused float16 parameter beside float32 ones): a
    parameter reassigned before the first forward is adopted all the same."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.register_parameter("extra", nn.Parameter(torch.zeros(2, dtype=torch.float16)))
    lib.fully_shard(model[0])
    lib.fully_shard(model)
    old = model[1].weight
    value = torch.full((4, 4), 0.5)
    model[1].weight = nn.Parameter(distribute_tensor(value, old.device_mesh, old.placements))
    x = torch.ones(2, 4)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    want = (x @ full["0.weight"].T + full["0.bias"]) @ value.T + full["1.bias"]
    return {"forward_uses_it": torch.allclose(model(x).detach(), want)}


def _int_reshard(lib: Any, rank: int, world: int) -> dict[str, Any]:
    out = {}
    for value in (1, world):
        torch.manual_seed(0)
        ref, model = ToyModel(scalar_gate=False).double(), ToyModel(scalar_gate=False).double()
        model.load_state_dict(ref.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # both libraries warn that 1 means False
            for block in model.blocks:
                lib.fully_shard(block, reshard_after_forward=value)
            lib.fully_shard(model, reshard_after_forward=value)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
        for step in range(2):
            ids, targets = batch(step, 2 * world)
            loss_fn(ref(ids), targets).backward()
            loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        got, want = full_params(model), full_params(ref)
        out[value] = max((got[n] - want[n]).abs().max().item() for n in want)
    return out


def _or_error(fn: Any, lib: Any) -> Any:
    try:
        return fn(lib)
    except AssertionError as e:
        return f"AssertionError: {e}"


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for lib_name in LIBS:
        lib = impl(lib_name)
        results[lib_name] = {
            "containers": _refuses_containers(lib),
            "slicing": _slicing(lib),
            "to_keeps_policy": _to_keeps_policy(lib),
            "reassigned": _reassigned(lib),
            "reassigned_mixed_dtypes": _or_error(_reassigned_mixed_dtypes, lib),
            "no_forward": _no_forward(lib),
            "int_reshard": _int_reshard(lib, rank, world),
        }
    return results


@functools.cache
def _spawned() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("lib_name", LIBS)
def test_containers_without_forward_are_refused_up_front(lib_name: str) -> None:
    for out in _spawned():
        for name, result in out[lib_name]["containers"].items():
            assert result.startswith("ValueError untouched=True"), (name, result)
    for out in _spawned():
        assert "container without forward" in out["fsdp2"]["containers"]["ModuleList"]


@pytest.mark.parametrize("lib_name", LIBS)
def test_slicing_a_sharded_sequential_gives_a_working_module(lib_name: str) -> None:
    for out in _spawned():
        assert out[lib_name]["slicing"] == {"type": "Sequential", "children_sharded": True, "values": True, "grads": True}


@pytest.mark.parametrize("lib_name", LIBS)
def test_to_dtype_keeps_an_explicit_policy(lib_name: str) -> None:
    for out in _spawned():
        assert out[lib_name]["to_keeps_policy"] == {"params": True, "output": "torch.bfloat16", "grads": True}


@pytest.mark.parametrize("lib_name", LIBS)
def test_parameter_reassigned_before_first_forward_is_adopted(lib_name: str) -> None:
    for out in _spawned():
        assert out[lib_name]["reassigned"] == {"forward_uses_it": True, "kept_object": True, "stepped": True}


@pytest.mark.parametrize("lib_name", LIBS)
def test_int_reshard_after_forward_of_one_or_the_shard_size(lib_name: str) -> None:
    for out in _spawned():
        for value, worst in out[lib_name]["int_reshard"].items():
            assert worst <= 1e-12, (value, worst)


@pytest.mark.parametrize("lib_name", LIBS)
def test_module_without_forward_used_through_a_registered_method(lib_name: str) -> None:
    for out in _spawned():
        assert out[lib_name]["no_forward"] == {"same": True}


def test_reassigned_in_a_group_of_two_dtypes_beyond_torch() -> None:
    """fsdp2 groups parameters of several dtypes (a bucket each); torch refuses them."""
    for out in _spawned():
        assert out["fsdp2"]["reassigned_mixed_dtypes"] == {"forward_uses_it": True}
        assert "uniform original parameter dtype" in str(out["torch"]["reassigned_mixed_dtypes"])
