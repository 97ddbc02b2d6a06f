"""``fsdp2.plan``: the groups it picks, the table and code it prints, ``apply`` being exactly
that code, editing, bad input, fitting to a budget (choices only more conservative as the
budget shrinks, every fitted plan within its budget by the tracker's own measure), and
training at parity with one local replica in float64 with fsdp2 and with torch's
``fully_shard`` running the same plan."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import run_ranks
from _models import ToyModel, batch, full_params, impl, loss_fn

import fsdp2
from fsdp2.planning import BudgetError
from fsdp2.planning.dryrun import DryRun
from fsdp2.planning.fit import ladder, measure

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from model import ModelArgs, Transformer  # noqa: E402

RTOL, ATOL = 1e-10, 1e-12


def _example(layers: int = 4, dim: int = 64, vocab: int = 512) -> nn.Module:
    with torch.device("meta"):
        return Transformer(ModelArgs(dim=dim, n_layers=layers, n_heads=4, vocab_size=vocab, max_seq_len=64))


def _structure(model: nn.Module) -> list[tuple[str, tuple[str, ...], Any, str]]:
    """Each fsdp2 group: its module, parameters, reshard setting and offload policy."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, fsdp2.FSDPModule):
            g = m._fsdp2_state.group
            params = tuple(sorted(p.fqn for b in g.buckets for p in b.params))
            out.append((name, params, g.settings.reshard_after_forward, type(g.offload_policy).__name__))
    return out


class _FakeWorld:
    """The fake process group of ``world`` ranks for the test's duration (this rank 0)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __enter__(self) -> _FakeWorld:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world)
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.destroy_process_group()


# ------------------------------------------------------------------------ groups
def test_groups_of_the_example_follow_torchtitan() -> None:
    p = fsdp2.plan(_example(layers=3))
    assert [g.name for g in p.groups] == [
        "tok_embeddings", "layers.0", "layers.1", "layers.2", "[norm, output]", "<root>"]
    assert [g.reshard_after_forward for g in p.groups] == [True, True, True, True, False, None]
    assert sum(g.params for g in p.groups) == sum(t.numel() for t in _example(layers=3).parameters())
    assert p.groups[-1].params == 0 and "TransformerBlock" in p.blocks_from


def test_repeated_class_blocks_tied_weights_and_ignored_params() -> None:
    model = ToyModel(n_blocks=3, tie=True)
    p = fsdp2.plan(model, ignored_params={model.blocks[1].gate})
    names = [g.name for g in p.groups]
    # No _no_split_modules: Block repeats and holds the most parameters. The head shares
    # the embedding's weight: embeddings, the extra layer and the head form one group.
    assert names == ["[emb, extra, head]", "blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert p.groups[0].kind == "tied" and p.groups[0].reshard_after_forward is False
    assert "blocks.1.gate" not in [f for g in p.groups for f in g.fqns]
    assert p.groups[0].fqns.count("emb.weight") == 1 and "head.weight" not in p.groups[0].fqns


def test_blocks_given_by_class_and_errors() -> None:
    model = ToyModel(n_blocks=2)
    p = fsdp2.plan(model, blocks=[nn.Linear])
    assert [g.name for g in p.groups if g.kind == "block"] == [
        "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "extra"]
    assert p.groups[0].name == "[emb, head]" and p.groups[0].kind == "tied"  # the head is a Linear block
    with pytest.raises(ValueError, match="no module of the classes"):
        fsdp2.plan(model, blocks=["NoSuchBlock"])
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fsdp2.plan([model])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs inputs="):
        fsdp2.plan(model, memory_budget="1GiB")
    with pytest.raises(ValueError, match="memory_budget must be"):
        fsdp2.plan(model, memory_budget="lots", inputs=torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="memory_budget must be"):
        fsdp2.plan(model, memory_budget=-5, inputs=torch.zeros(1, 2, dtype=torch.long))


def test_edit_checks_before_changing() -> None:
    p = fsdp2.plan(ToyModel(n_blocks=3))
    p.edit(r"blocks\.[01]", ac="full", reshard_after_forward=False)
    assert [(g.ac, g.reshard_after_forward) for g in p.groups[1:4]] == [("full", False), ("full", False), ("none", True)]
    p["blocks.2"].ac = "selective"
    with pytest.raises(ValueError, match="no group name matches"):
        p.edit("nothing", ac="full")
    with pytest.raises(TypeError, match="takes reshard_after_forward, ac and offload"):
        p.edit("blocks.0", mesh=None)
    with pytest.raises(ValueError, match="ac must be one of"):
        p.edit("blocks.0", ac="some")
    with pytest.raises(KeyError, match="no group named"):
        p["nothing"]


# --------------------------------------------------------------- apply == code
def test_apply_is_exactly_the_printed_code() -> None:
    with _FakeWorld(4):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = ToyModel(n_blocks=4)
        twin = copy.deepcopy(model)
        mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        p = fsdp2.plan(model, mesh=mesh, mp_policy=mp)
        p.edit(r"blocks\.[12]", ac="full").edit(r"blocks\.3", reshard_after_forward=False, offload=True)
        code = p.code()
        assert "for i in range(1, 3):" not in code  # two blocks do not make a loop
        p.apply(model)
        exec(code, {"model": twin, "mesh": mesh, "mp_policy": mp})
        assert _structure(model) == _structure(twin)
        groups = {id(m._fsdp2_state.group) for m in model.modules() if isinstance(m, fsdp2.FSDPModule)}
        assert len(groups) == len(p.groups)
        for a, b in zip(model.modules(), twin.modules()):
            assert type(a).__name__ == type(b).__name__
            assert [h.__qualname__ for h in a._forward_pre_hooks.values()] == [
                h.__qualname__ for h in b._forward_pre_hooks.values()]
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ToyModel(n_blocks=4).named_parameters()]
        with pytest.raises(ValueError, match="already sharded"):
            p.apply(model)
        with pytest.raises(ValueError, match="other than the one planned"):
            p.apply(ToyModel(n_blocks=2))


def test_code_prints_runs_of_blocks_as_a_loop() -> None:
    p = fsdp2.plan(_example(layers=6))
    p.edit(r"layers\.[0-2]", ac="full")
    code = p.code()
    assert "for i in range(0, 3):" in code and "for i in range(3, 6):" in code
    assert code.count("checkpoint(block)") == 1 and "from torch.distributed._composable import checkpoint" in code


# ------------------------------------------------------------------ the budget
def _rank_of(g: Any) -> tuple[int, int, int]:
    """How conservative a group's setting is, per choice."""
    return (int(g.reshard_after_forward is True), ("none", "selective", "full").index(g.ac), int(g.offload))


def test_fitted_plans_fit_and_only_get_more_conservative() -> None:
    model = _example(layers=4, dim=128, vocab=1024)
    inputs = (torch.zeros(4, 64, dtype=torch.long, device="meta"),)
    loose = fsdp2.plan(model, world_size=64, inputs=inputs)
    assert loose.estimate is not None and loose.estimate.peak > 0
    full = loose.estimate.peak
    previous = None
    seen_rungs = []
    for share in (2.0, 0.7, 0.45, 0.05):
        budget = int(full * share)
        try:
            p = fsdp2.plan(model, world_size=64, inputs=inputs, memory_budget=budget)
        except BudgetError as e:
            assert "no plan fits" in str(e) and "MiB over" in str(e) and "largest part is" in str(e)
            assert e.plan.estimate is not None and e.plan.estimate.peak > budget
            assert all(g.offload for g in e.plan.groups) and not e.plan.estimate.fits
            seen_rungs.append(math.inf)
            continue
        assert p.estimate is not None and p.estimate.peak <= budget and p.estimate.fits
        with DryRun(model, (64,), None, inputs, None, None) as run:  # the plan as it stands, measured anew
            assert measure(run, p).peak == p.estimate.peak
        settings = [_rank_of(g) for g in p.groups]
        if previous is not None:
            assert all(a >= b for now, before in zip(settings, previous) for a, b in zip(now, before)), (
                f"budget {budget}: a choice got less conservative")
        previous = settings
        seen_rungs.append(sum(map(sum, settings)))
        assert "fitted: rung" in str(p)
    assert seen_rungs == sorted(seen_rungs) and len(set(seen_rungs)) >= 3  # the budgets did choose differently


def test_ladder_rungs_only_add_conservative_settings() -> None:
    p = fsdp2.plan(_example(layers=4))
    steps = ladder(p.groups)
    order = {None: 0, False: 0, True: 1}
    for before, after in zip(steps.rungs, steps.rungs[1:]):
        changed = [(b, a) for b, a in zip(before, after) if b != a]
        assert len(changed) >= 1
        for (r0, ac0, off0), (r1, ac1, off1) in changed:
            assert order[r1] >= order[r0] and ("none", "selective", "full").index(ac1) >= (
                "none", "selective", "full").index(ac0) and off1 >= off0
    # The last block and the head stay gathered (backward needs them at once).
    last = steps.rungs[-1]
    assert last[p.groups.index(p["layers.3"])][0] is False and last[p.groups.index(p["[norm, output]"])][0] is False


def test_plan_cannot_fit_inside_a_job() -> None:
    with _FakeWorld(2):
        with pytest.raises(RuntimeError, match="cannot start while a process group is initialized"):
            fsdp2.plan(_example(layers=2), inputs=torch.zeros(1, 8, dtype=torch.long), memory_budget="1GiB")


# ------------------------------------------------------------------ training
STEPS = 3


def _train(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    torch.manual_seed(0)
    fsdp_lib = lib_name == "fsdp2"
    ref = ToyModel(n_blocks=4, scalar_gate=fsdp_lib).double()
    model = copy.deepcopy(ref)
    p = fsdp2.plan(model, mp_policy=lib.MixedPrecisionPolicy())
    p.edit(r"blocks\.0", ac="full").edit(r"blocks\.1", ac="selective").edit(r"blocks\.2", reshard_after_forward=False)
    p.apply(model, fully_shard=lib.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(STEPS):
        ids, targets = batch(step, 4 * world)
        mine = slice(rank * 4, (rank + 1) * 4)
        loss = loss_fn(model(ids[mine]), targets[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(ids), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.detach().clone())
        ref_losses.append(ref_loss.item())
    mean = [loss.clone() for loss in losses]
    for m in mean:
        dist.all_reduce(m)
    return {"losses": [m.item() / world for m in mean], "ref_losses": ref_losses,
            "params": full_params(model), "ref": {n: t.detach().clone() for n, t in ref.named_parameters()},
            "groups": len({id(m._fsdp2_state.group) for m in model.modules() if isinstance(m, fsdp2.FSDPModule)})
            if fsdp_lib else None}


@pytest.mark.parametrize("lib_name", ["fsdp2", "torch"])
def test_planned_training_matches_one_local_replica(lib_name: str) -> None:
    out = run_ranks(_train, 2, lib_name)[0]
    for got, want in zip(out["losses"], out["ref_losses"]):
        assert not math.isnan(got) and abs(got - want) <= ATOL + RTOL * abs(want), (got, want)
    for name, want in out["ref"].items():
        got = out["params"][name]
        excess = ((got - want).abs() / (ATOL + RTOL * want.abs())).max().item()
        assert not math.isnan(excess) and excess <= 1, (name, excess)
    if lib_name == "fsdp2":
        assert out["groups"] == 6  # [emb, extra, head], four blocks, the root


def test_estimate_refuses_what_the_dry_run_cannot_copy() -> None:
    with _FakeWorld(2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        with pytest.raises(ValueError, match="does not run models with an expert_mesh"):
            fsdp2.plan(_example(layers=2), expert_mesh=mesh, inputs=torch.zeros(1, 8, dtype=torch.long))


def test_a_bad_edit_changes_nothing() -> None:
    p = fsdp2.plan(ToyModel(n_blocks=3))
    before = [(g.reshard_after_forward, g.ac, g.offload) for g in p.groups]
    with pytest.raises(ValueError, match="reshard_after_forward must be"):
        p.edit(r"blocks\.\d", ac="full", reshard_after_forward=1)
    assert [(g.reshard_after_forward, g.ac, g.offload) for g in p.groups] == before


class _Routed(nn.Module):
    """Reads values in forward (data-dependent routing): no meta dry run can."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x[torch.nonzero(x[:, 0] > 0).flatten()]


def test_a_model_the_dry_run_cannot_step_says_why() -> None:
    with pytest.raises(fsdp2.planning.DryRunError, match="dry run of one training step on the meta device failed"):
        fsdp2.plan(_Routed(), world_size=4, inputs=torch.zeros(4, 8))
    assert not dist.is_initialized()  # the fake process group is gone again


def test_adopt_takes_a_fitted_plans_settings_and_a_stale_estimate_says_so() -> None:
    model = _example(layers=3)
    inputs = torch.zeros(2, 16, dtype=torch.long)
    fitted = fsdp2.plan(model, world_size=(2, 4), inputs=inputs)  # HSDP: 2 replicas of 4 shards
    assert fitted.estimate is not None and "measured before" not in str(fitted)
    fitted.edit(r"layers\.[01]", ac="full")
    assert fitted.estimate is None
    fitted.estimate = fsdp2.plan(model, world_size=(2, 4), inputs=inputs).estimate
    assert "measured before the groups' settings changed" in str(fitted)
    later = fsdp2.plan(model).adopt(fitted)
    assert [g.ac for g in later.groups] == [g.ac for g in fitted.groups] and later.estimate is fitted.estimate
    with pytest.raises(ValueError, match="same groups"):
        fsdp2.plan(_example(layers=2)).adopt(fitted)
    with pytest.raises(ValueError, match="world_size must be"):
        fsdp2.plan(model, world_size=(2, 2, 2))


def test_offloaded_runs_of_blocks_print_as_one_loop() -> None:
    p = fsdp2.plan(_example(layers=5))
    p.edit(r"layers\.\d", offload=True)
    code = p.code()
    assert "for i in range(0, 5):" in code and code.count("offload_policy=fsdp2.CPUOffloadPolicy()") == 1


def test_the_estimate_counts_frozen_and_ignored_parameters_as_the_job_holds_them() -> None:
    inputs = torch.zeros(2, 16, dtype=torch.long)
    model = _example(layers=3)
    base = fsdp2.plan(model, world_size=4, inputs=inputs).estimate
    for p in model.layers[0].parameters():
        p.requires_grad_(False)
    frozen = fsdp2.plan(model, world_size=4, inputs=inputs).estimate
    assert base is not None and frozen is not None
    shard_bytes = sum(p.numel() for p in model.layers[0].parameters()) * 4 // 4  # float32, 4 ranks
    # AdamW keeps two states per trainable element: the frozen block's shards have none.
    assert base.split["optimizer state"] - frozen.split["optimizer state"] >= 2 * shard_bytes * 0.95
    ignored = fsdp2.plan(model, world_size=4, inputs=inputs, ignored_params=set(model.output.parameters())).estimate
    assert ignored is not None
    # The output head, not sharded, is held whole by every rank.
    head = sum(p.numel() for p in model.output.parameters()) * 4
    assert ignored.split["sharded parameters"] >= frozen.split["sharded parameters"] + head * 0.7
