"""Autograd as torch runs it, at 2 ranks, float64 against one local replica fed the
global batch, with fsdp2 and with torch's ``fully_shard`` in the same ranks:

- post-accumulate-grad hooks on the sharded parameters fire once per step, after the
  reduce, on the sharded gradient: an optimizer stepped from the hook (optimizer in
  backward) trains as a local one; accumulation steps without synchronization fire none;
- ``torch.func.jvp`` and ``torch.func.hessian`` through sharded modules (resharding after
  forward or not) give the local model's values; plain forward-mode AD
  (``torch.autograd.forward_ad``) too, with fsdp2 (torch's node has no view-returning jvp);
- structured inputs and outputs (dataclass, dict, ``OrderedDict``, ``deque``, namedtuple,
  nested; ``defaultdict`` with fsdp2, which torch's input routing fails on) and ``ModuleDict``/``ModuleList`` subclasses with their
  own ``forward`` sharded as groups: same losses and gradients as the local replica.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn
from _dist import run_scenarios
from _models import full_params, impl
from _models import worst as _worst

LIBS = ("fsdp2", "torch")
WORLD = 2
TOL = 1e-10


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _shard_layers(lib: Any, model: nn.Module, raf: bool = True) -> nn.Module:
    for layer in model:
        if isinstance(layer, nn.Linear):
            lib.fully_shard(layer, reshard_after_forward=raf)
    lib.fully_shard(model, reshard_after_forward=raf)
    return model


def _data(step: int, rows: int = 2 * WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, 4, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g, dtype=torch.float64)


def _mine(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD)[rank]


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return _worst([((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b])


# -- optimizer in backward ------------------------------------------------------------


def _in_backward(model: nn.Module) -> dict[str, int]:
    """One AdamW per parameter, stepped (and its gradient cleared) from the parameter's
    post-accumulate-grad hook; returns how often each hook fired."""
    fired: dict[str, int] = collections.Counter()
    for name, p in model.named_parameters():
        opt = torch.optim.AdamW([p], lr=0.05)

        def hook(param: torch.Tensor, opt: Any = opt, name: str = name) -> None:
            fired[name] += 1
            opt.step()
            opt.zero_grad()

        p.register_post_accumulate_grad_hook(hook)
    return fired


def _optimizer_in_backward(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    ref, model = _mlp(), _shard_layers(lib, _mlp())
    ref_fired, fired = _in_backward(ref), _in_backward(model)
    counts = []
    for step in range(3):
        x, y = _data(step)
        (ref(x) - y).pow(2).mean().backward()
        # A micro-batch without synchronization first: no reduce, so no hook yet.
        model.set_requires_gradient_sync(False)
        (model(_mine(x, rank)[:1]) - _mine(y, rank)[:1]).pow(2).sum().mul(0).backward()
        counts.append(sum(fired.values()))
        model.set_requires_gradient_sync(True)
        (model(_mine(x, rank)) - _mine(y, rank)).pow(2).mean().backward()
    return {
        "err": _rel(full_params(model), full_params(ref)),
        "fired": dict(fired),
        "ref_fired": dict(ref_fired),
        "after_unsynced": counts,
        "grads_cleared": all(p.grad is None for p in model.parameters()),
    }


# -- forward-mode AD ------------------------------------------------------------------


def _forward_mode(rank: int, world: int, lib_name: str, raf: bool) -> dict[str, float]:
    lib = impl(lib_name)
    ref, model = _mlp(), _shard_layers(lib, _mlp(), raf)
    x, _ = _data(0)
    x = x.requires_grad_()
    t = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    errs = {}
    # A training step first: the groups are set up and reshard as they do in training.
    model(x).sum().backward()
    ref(x).sum().backward()
    for name, f in {"jvp": torch.func.jvp, "jvp_again": torch.func.jvp}.items():
        (o, jo), (r, jr) = f(model, (x,), (t,)), f(ref, (x,), (t,))
        errs[name] = _worst([((o - r).norm() / r.norm()).item(), ((jo - jr).norm() / jr.norm()).item()])
    h, hr = (torch.func.hessian(lambda v, m=m: m(v).pow(2).sum())(x[:1]) for m in (model, ref))
    errs["hessian"] = ((h - hr).norm() / hr.norm()).item()
    if lib_name == "fsdp2":  # beyond torch, whose node's jvp returns no view
        import torch.autograd.forward_ad as fwad

        with fwad.dual_level():
            jo = fwad.unpack_dual(model(fwad.make_dual(x, t))).tangent
            jr = fwad.unpack_dual(ref(fwad.make_dual(x, t))).tangent
        errs["forward_ad"] = ((jo - jr).norm() / jr.norm()).item()
    # Training still works after the transforms. With reshard_after_forward=False the
    # forward-mode forward (no backward) leaves the modules gathered: zero_grad() must
    # still clear the sharded gradients (torch's keeps them and adds the next step's).
    model.zero_grad()
    ref.zero_grad()
    model(_mine(x, rank)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    errs["grads_after"] = _rel(grads, {n: p.grad for n, p in ref.named_parameters()})
    return errs


# -- structured inputs and outputs ----------------------------------------------------


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    aux: dict


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class Heads(nn.ModuleDict):
    """A ``ModuleDict`` subclass with a forward of its own, taking and returning structures."""

    def forward(self, inp: dict) -> Out:
        h = self["a"](inp["x"]) * inp["scale"][0]
        extras = inp["extras"]
        h = h + extras["bias"][0] + extras["shift"][0]
        return Out(y=self["b"](torch.tanh(h)), aux={"h": [h], "pair": Pair(h, h * 2)})


class Stack(nn.ModuleList):
    """A ``ModuleList`` subclass with a forward of its own."""

    def forward(self, pair: Pair) -> Pair:
        a, b = pair
        for layer in self:
            a = torch.tanh(layer(a))
        return Pair(a, b)


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = Heads({"a": nn.Linear(4, 6), "b": nn.Linear(6, 4)})
        self.stack = Stack([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.double()

    def forward(self, x: torch.Tensor, extras: collections.OrderedDict) -> torch.Tensor:
        inp = {"x": x, "scale": collections.deque([extras["scale"]]), "extras": extras["more"]}
        out = self.heads(inp)
        pair = self.stack(Pair(out.y, out.aux["pair"].b))
        return pair.a.pow(2).mean() + out.aux["h"][0].mean() + pair.b.mean()


def _extras(x: torch.Tensor, lib_name: str) -> collections.OrderedDict:
    # A defaultdict input fails in torch's fully_shard (its input routing rebuilds it as
    # ``defaultdict(dict)``): fsdp2 only.
    more: dict = collections.defaultdict(list) if lib_name == "fsdp2" else {"bias": [], "shift": []}
    more["bias"].append(x[:, :1] * 0.25)  # per row: the loss stays a mean over rows
    more["shift"].append(torch.tanh(x[:, 1:2]))
    return collections.OrderedDict(scale=torch.tensor(1.5, dtype=torch.float64, requires_grad=True), more=more)


def _structured(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    ref, model = Structured(), Structured()
    lib.fully_shard(model.heads)
    lib.fully_shard(model.stack)
    lib.fully_shard(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    losses = []
    for step in range(3):
        x, _ = _data(step)
        x.requires_grad_()
        mx = _mine(x, rank).detach().requires_grad_()
        ref_loss, loss = ref(x, _extras(x, lib_name)), model(mx, _extras(mx, lib_name))
        ref_loss.backward()
        loss.backward()
        glob = loss.detach().clone()
        torch.distributed.all_reduce(glob)
        losses.append(abs(glob.item() / world - ref_loss.item()) / abs(ref_loss.item()))
        for o in opts:
            o.step()
            o.zero_grad()
    return {"loss": _worst(losses), "params": _rel(full_params(model), full_params(ref))}


def _all(lib_name: str) -> dict[str, tuple]:
    return {
        "in_backward": (_optimizer_in_backward, (lib_name,)),
        "forward_mode_raf": (_forward_mode, (lib_name, True)),
        "forward_mode_keep": (_forward_mode, (lib_name, False)),
        "structured": (_structured, (lib_name,)),
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, list[Any]]]:
    scenarios = {f"{lib}:{name}": s for lib in LIBS for name, s in _all(lib).items()}
    flat = run_scenarios(WORLD, scenarios)
    return {lib: {name: flat[f"{lib}:{name}"] for name in _all(lib)} for lib in LIBS}


@pytest.mark.parametrize("lib_name", LIBS)
def test_optimizer_in_backward_trains_as_local(results: dict, lib_name: str) -> None:
    for res in results[lib_name]["in_backward"]:
        assert res["err"] < TOL, res
        assert res["fired"] == res["ref_fired"] == {n: 3 for n in res["ref_fired"]}, res
        assert res["after_unsynced"] == [0, 6, 12], res  # unsynchronized micro-batches fire none
        assert res["grads_cleared"], res


@pytest.mark.parametrize("raf", ["forward_mode_raf", "forward_mode_keep"])
@pytest.mark.parametrize("lib_name", LIBS)
def test_jvp_hessian_and_forward_ad(results: dict, lib_name: str, raf: str) -> None:
    for errs in results[lib_name][raf]:
        expected = {"jvp", "jvp_again", "hessian", "grads_after"} | ({"forward_ad"} if lib_name == "fsdp2" else set())
        assert set(errs) == expected, errs
        assert _worst(list(errs.values())) < TOL, errs


@pytest.mark.parametrize("lib_name", LIBS)
def test_structured_inputs_outputs_and_container_subclasses(results: dict, lib_name: str) -> None:
    for res in results[lib_name]["structured"]:
        assert _worst(list(res.values())) < TOL, res
