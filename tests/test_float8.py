"""torchao's float8 training (``convert_to_float8_training`` with
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``, emulated matmuls on CPU) under
fsdp2 and under torch's ``fully_shard``, in the same ranks from the same weights, on 2
and 4 ranks, in three recipes: plain, with ``precompute_float8_dynamic_scale_for_fsdp``
after each optimizer step (torchtitan's), and that with ``param_dtype=bfloat16`` (and
``reduce_dtype=float32``, as torchtitan sets them).

Per step, fsdp2 issues no more all-gathers than torch (one per group unshard: the float8
weights and the plain biases travel together), of no more bytes, no more reduces (one
per group, float8 weights' and biases' gradients together), and the losses and
final parameters match torch's. With precompute, no scale all-reduce runs in the step
(the hook reads the scale kept on the parameter's own local tensor: before, fsdp2 called
it on a rebuilt tensor without the scale, and each float8 gather all-reduced its amax);
without it, one per float8 weight gather, as with torch.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from _comm import CommCounter
from _dist import cached_outcome, run_scenarios
from _models import impl
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from typing_extensions import Self

RECIPES: dict[str, dict[str, Any]] = {
    "plain": {"precompute": False, "mp": None},
    "precompute": {"precompute": True, "mp": None},
    "precompute_bf16": {"precompute": True, "mp": torch.bfloat16},
}
LIBS = ("fsdp2", "torch")
# The first step (no scale precomputed yet) and one after a precompute (a third step
# repeated the second: dynamic scaling keeps no history).
STEPS = 2
# Rows divide 2 and 4 ranks: the one-argument hook cannot pad. Two blocks (4 cost twice
# as much): the first block's groups gathered ahead, the last kept gathered for backward.
DIM, HIDDEN, BLOCKS = 32, 64, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, DIM)  # left in high precision, as torchtitan leaves its output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ScaleAllReduces:
    """Counts the functional all-reduces: torchao's amax all-reduce (``float8_utils``
    imported the function by name) and any other (DTensor's, through the module)."""

    def __init__(self) -> None:
        import torch.distributed._functional_collectives as funcol
        from torchao.float8 import float8_utils

        self.targets = [(float8_utils, "all_reduce"), (funcol, "all_reduce")]
        self.saved = [getattr(m, name) for m, name in self.targets]
        self.count = 0

    def __enter__(self) -> Self:
        for (module, name), fn in zip(self.targets, self.saved):
            setattr(module, name, self._counting(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for (module, name), fn in zip(self.targets, self.saved):
            setattr(module, name, fn)

    def _counting(self, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return fn(*args, **kwargs)

        return wrapped


def _train(lib: Any, model: Net, rank: int, world: int, recipe: dict[str, Any]) -> dict[str, Any]:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    mesh = init_device_mesh("cpu", (world,))
    # torchtitan's mixed precision: bfloat16 compute, float32 reduce
    mp = lib.MixedPrecisionPolicy()
    if recipe["mp"]:
        mp = lib.MixedPrecisionPolicy(param_dtype=recipe["mp"], reduce_dtype=torch.float32)
    for block in model.blocks:
        lib.fully_shard(block, mesh=mesh, mp_policy=mp)
    lib.fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, per_step = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(2 * world, 8, DIM, generator=g).chunk(world)[rank]
        counter, scales = CommCounter(), ScaleAllReduces()
        with counter.active(), scales:
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        with ScaleAllReduces() as precomputes:
            if recipe["precompute"]:
                precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
        per_step.append({
            "all_gathers": counter.calls["all_gather"], "all_gather_bytes": counter.bytes["all_gather"],
            "reduces": counter.calls["reduce"], "reduce_bytes": counter.bytes["reduce"],
            "scale_all_reduces": scales.count, "precompute_all_reduces": precomputes.count,
        })
    params = {n: _plain(p.full_tensor()).detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "per_step": per_step, "n_params": len(params)}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._tensor if hasattr(t, "_tensor") else t  # WeightWithDynamicFloat8CastTensor's data


def _recipe(rank: int, world: int, name: str) -> dict[str, Any]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    base = Net()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)  # no float8 matmul on CPU
    convert_to_float8_training(base, config=config, module_filter_fn=lambda _, fqn: fqn != "head")
    models = {lib: copy.deepcopy(base) for lib in LIBS}
    return {lib: _train(impl(lib), models[lib], rank, world, RECIPES[name]) for lib in LIBS}


@cached_outcome
def _at(world: int) -> dict[str, list[dict[str, Any]]]:
    return run_scenarios(world, {name: (_recipe, (name,)) for name in RECIPES})


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs().max().item()
    return math.inf if math.isnan(d) else d


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_float8_matches_torch(world: int, recipe: str) -> None:
    """Losses and parameters as torch's: bitwise on 2 ranks; on 4 within float32
    rounding (the reduce sums the ranks' gradients in its own order: a few ulps)."""
    tol = 0.0 if world == 2 else 1e-6
    for out in _at(world)[recipe]:
        ours, theirs = out["fsdp2"], out["torch"]
        gaps = [_gap(torch.tensor(a), torch.tensor(b)) for a, b in zip(ours["losses"], theirs["losses"])]
        assert max(gaps) <= tol, (ours["losses"], theirs["losses"])
        for n, want in theirs["params"].items():
            got = ours["params"][n]
            assert got.dtype == want.dtype and _gap(got, want) <= tol, (n, _gap(got, want))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_float8_communication_as_torch(world: int, recipe: str) -> None:
    """Per step: all-gathers and their bytes no more than torch's (fsdp2 keeps the last
    block gathered for backward: one fewer after the first step); scale all-reduces
    no more than torch's, and with precompute none at all once a scale was precomputed
    (after the first step), as with torch."""
    for out in _at(world)[recipe]:
        for step, (ours, theirs) in enumerate(zip(out["fsdp2"]["per_step"], out["torch"]["per_step"])):
            assert ours["all_gathers"] <= theirs["all_gathers"], (step, ours, theirs)
            assert ours["all_gather_bytes"] <= theirs["all_gather_bytes"], (step, ours, theirs)
            assert ours["scale_all_reduces"] <= theirs["scale_all_reduces"], (step, ours, theirs)
            assert ours["precompute_all_reduces"] == theirs["precompute_all_reduces"], (step, ours, theirs)
            if RECIPES[recipe]["precompute"] and step > 0:
                assert ours["scale_all_reduces"] == 0 == theirs["scale_all_reduces"], (step, ours, theirs)
            else:
                assert ours["scale_all_reduces"] >= 2 * BLOCKS, (step, ours)  # the count sees them


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_float8_reduces_as_torch(world: int, recipe: str) -> None:
    """Per step: no more reduces than torch's, one per group (a block's float8 weights
    and plain biases reduce together: before, one reduce per bucket, ``2 x BLOCKS + 1``
    against ``BLOCKS + 1``), of no more bytes than torch's plus fsdp2's "used" flags (one
    float32 per parameter, in each of the ``world`` rows: ``world x n_params x 4`` bytes
    a step)."""
    for out in _at(world)[recipe]:
        flags = world * out["fsdp2"]["n_params"] * 4
        for step, (ours, theirs) in enumerate(zip(out["fsdp2"]["per_step"], out["torch"]["per_step"])):
            assert ours["reduces"] <= theirs["reduces"] == BLOCKS + 1, (step, ours, theirs)
            assert ours["reduce_bytes"] <= theirs["reduce_bytes"] + flags, (step, ours, theirs, flags)
