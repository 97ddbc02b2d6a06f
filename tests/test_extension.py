"""The tensor-subclass all-gather extension (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, as torchao's float8 weights use it), at 2 ranks, with fsdp2
and with torch's ``fully_shard`` in the same ranks: the hooks run on every gather, the
sharded parameters keep their class, and training matches local training in float64,
with uneven shards, mixed precision on and the older one-argument signature."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn

import _subclass
from _dist import run_ranks
from _models import batch, full_params, impl, loss_fn

LIBS = ("fsdp2", "torch")
CASES = {
    "even": dict(cls="Doubled", hidden=8),
    "uneven": dict(cls="Doubled", hidden=7),
    "old_signature": dict(cls="OldSignature", hidden=8),
    "reshard_false": dict(cls="Doubled", hidden=8, raf=False),
    # param_dtype float32 (passed to the hooks) against float64 local training
    "mixed_precision": dict(cls="Doubled", hidden=7, mp=True, tol=1e-5),
    # set_custom_all_gather: the extension's inputs travel through the user's collective
    "custom_all_gather": dict(cls="Doubled", hidden=8, custom=True),
}


class Gather:
    """torch's AllGather protocol over ``all_gather_into_tensor``, noting output sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        self.sizes.append(output_tensor.numel() * output_tensor.element_size())
        return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, hidden)
        self.fc2 = nn.Linear(hidden, 12)  # 12 classes (11 used): even rows over 2 ranks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(ids))))


def _wrap_weights(model: Net, cls: type) -> None:
    for layer in (model.fc1, model.fc2):
        layer.weight = nn.Parameter(cls(layer.weight.detach().clone()))


def _run(lib: Any, rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    ref, model = Net(cfg["hidden"]).double(), Net(cfg["hidden"]).double()
    model.load_state_dict(ref.state_dict())
    cls = getattr(_subclass, cfg["cls"])
    _wrap_weights(model, cls)
    mp = lib.MixedPrecisionPolicy(param_dtype=torch.float32) if cfg.get("mp") else lib.MixedPrecisionPolicy()
    for layer in (model.fc1, model.fc2):
        lib.fully_shard(layer, reshard_after_forward=cfg.get("raf", True), mp_policy=mp)
    lib.fully_shard(model, mp_policy=mp)
    gather = Gather()
    if cfg.get("custom"):
        for layer in (model.fc1, model.fc2):
            layer.set_custom_all_gather(gather)
    kept_class = all(type(layer.weight.to_local()) is cls for layer in (model.fc1, model.fc2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    _subclass.calls.update(pre=0, post=0, post_out=0)
    for step in range(3):
        ids, targets = batch(step, 2 * world)
        loss_fn(ref(ids), targets).backward()
        loss_fn(model(ids.chunk(world)[rank]).double(), targets.chunk(world)[rank]).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    worst = max((_plain(got[n]) - want[n]).abs().max().item() for n in want)
    return {
        "worst": worst,
        "kept_class": kept_class and all(type(layer.weight.to_local()) is cls for layer in (model.fc1, model.fc2)),
        "calls": dict(_subclass.calls),
        # bytes through the custom collective per call: the weights' inputs included
        "custom_bytes": max(gather.sizes, default=0),
    }


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._inner if isinstance(t, _subclass.Doubled) else t


def _worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {lib_name: {name: _run(impl(lib_name), rank, world, cfg) for name, cfg in CASES.items()} for lib_name in LIBS}


@functools.cache
def _spawned() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_worker, 2)


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("case", list(CASES))
def test_subclass_all_gather_extension(lib_name: str, case: str) -> None:
    for out in _spawned():
        res = out[lib_name][case]
        assert res["worst"] <= CASES[case].get("tol", 1e-12), res
        assert res["kept_class"], res
        calls = res["calls"]
        assert calls["pre"] >= 3 * 2 and calls["post"] + calls["post_out"] == calls["pre"], res
        if CASES[case].get("custom"):
            assert res["custom_bytes"] >= 2 * 8 * 6 * 16, res  # fc1's values (f64) and tags (i64), 2 ranks
