"""Behaviours users rely on: eval, structured outputs, forward methods, explicit
unshard, gradient accumulation knobs.

The scenarios run one after the other in one set of ranks per world size (``_at``):
spawning ranks costs more than most of them, and models built after one another in one
process must not affect each other anyway."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn as nn
from _dist import cached_outcome, run_ranks, run_scenarios
from _models import ToyModel, batch, full_params, in_place_worker, loss_fn

import fsdp2
from fsdp2.runtime.group import ShardState, TrainingState


def _groups(model: nn.Module) -> list:
    return list({id(m._fsdp2_state.group): m._fsdp2_state.group for m in model.modules() if isinstance(m, fsdp2.FSDPModule)}.values())


def _shard(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        fsdp2.fully_shard(block)
    return fsdp2.fully_shard(model)


def _eval_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ToyModel().double()
    model = _shard(copy.deepcopy(ref))
    ids, _ = batch(0, 2)
    with torch.no_grad():
        got = model(ids)
    want = ref(ids)
    root = model._fsdp2_state.group
    # As torch's: the root (``reshard_after_forward=None`` keeps it) stays gathered for the
    # next forward, the blocks are freed, nothing waits for a backward.
    clean = all(
        (g.shard_state is ShardState.UNSHARDED) == (g is root)
        and g.training_state is TrainingState.IDLE and g.calls.pending == 0
        for g in _groups(model)
    )
    blocks_sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.blocks.parameters())
    model.reshard()
    registered_sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    return {
        "match": torch.allclose(got, want, rtol=1e-12, atol=1e-12), "clean": clean,
        "sharded": blocks_sharded and registered_sharded,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_eval_under_no_grad_leaves_no_state_but_the_roots_kept_parameters(world: int) -> None:
    for out in _at(world)["eval"]:
        assert all(out.values()), out


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: dict


class StructuredBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> Out:
        return Out(self.a(x), {"pair": (self.b(x), x.sum())})


class StructuredModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = StructuredBlock()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return (out.logits * self.scale + out.extra["pair"][0]).pow(2).mean()


def _structured_worker(rank: int, world: int) -> float:
    torch.manual_seed(0)
    ref = StructuredModel().double()
    model = copy.deepcopy(ref)
    fsdp2.fully_shard(model.block)
    fsdp2.fully_shard(model)
    x = torch.randn(4 * world, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref(x).backward()
    model(x.chunk(world)[rank]).backward()
    worst = 0.0
    for p, q in zip(model.parameters(), ref.parameters()):
        worst = max(worst, (p.grad.full_tensor() - q.grad).abs().max().item())
    return worst


def test_dataclass_and_dict_outputs_train() -> None:
    assert max(_at(2)["structured"]) < 1e-12


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.proj.weight.t() * 2


def _forward_method_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = Generator().double()
    model = copy.deepcopy(ref)
    fsdp2.fully_shard(model)  # generate() reads proj.weight directly: one group for all
    fsdp2.register_fsdp_forward_method(model, "generate")
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.no_grad():
        got = model.generate(x)
    # The root keeps its gathered parameters after a forward (as torch's root does),
    # without grad too (the next forward, e.g. the next token, needs them), and shows them
    # until it is resharded.
    kept_without_grad = type(model.proj.weight) is nn.Parameter and model.proj.weight.shape == (4, 4)
    got_grad = model.generate(x)
    kept = type(model.proj.weight) is nn.Parameter and model.proj.weight.shape == (4, 4)
    model.reshard()
    return {
        "match": torch.allclose(got, ref.generate(x)) and torch.allclose(got_grad, ref.generate(x)),
        "kept_without_grad": kept_without_grad,
        "kept_with_grad": kept,
        "sharded_after_reshard": isinstance(model.proj.weight, torch.distributed.tensor.DTensor),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_register_fsdp_forward_method(world: int) -> None:
    for out in _at(world)["forward_method"]:
        assert all(out.values()), out


def _unshard_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = _shard(ToyModel())
    block = model.blocks[0]
    group = block._fsdp2_state.group
    handle = block.unshard(async_op=True)
    issued = group.shard_state is ShardState.GATHERING
    assert isinstance(handle, fsdp2.UnshardHandle)
    handle.wait()
    gathered = group.shard_state is ShardState.UNSHARDED
    full = group.buckets[0].unsharded_views[0].clone()
    block.reshard()
    freed = group.shard_state is ShardState.SHARDED and group.buckets[0].unsharded_bytes() == 0
    sync_none = block.unshard() is None
    block.reshard()
    return {
        "issued_async": issued,
        "gathered": gathered,
        "values": torch.equal(full, block.norm_weight.full_tensor()),
        "freed": freed,
        "sync_returns_none": sync_none,
    }


def test_explicit_unshard_and_reshard() -> None:
    for out in _at(2)["unshard"]:
        assert all(out.values()), out


def _reshard_after_backward_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ToyModel().double()
    model = _shard(copy.deepcopy(ref))
    model.set_reshard_after_backward(False)
    ids, tg = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()
    kept = all(g.shard_state is ShardState.UNSHARDED for g in _groups(model))
    model.set_reshard_after_backward(True)
    model.set_gradient_divide_factor(3.0)  # this module's own only, as torch's
    root_only = [g.settings.gradient_divide_factor for g in _groups(model)].count(3.0) == 1
    for m in model.modules():  # every one sums instead of averaging
        if isinstance(m, fsdp2.FSDPModule):
            m.set_gradient_divide_factor(1.0)
    loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()
    loss_fn(ref(ids), tg).backward()
    # First backward averaged (divide by W), second summed: grad = g + W * g.
    worst = max(
        (p.grad.full_tensor() - q.grad * (1 + world)).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    return {"kept_unsharded": kept, "resharded": all(g.shard_state is ShardState.SHARDED for g in _groups(model)), "grad_ok": worst < 1e-12, "root_only": root_only}


@pytest.mark.parametrize("world", [1, 2])
def test_reshard_after_backward_and_divide_factor(world: int) -> None:
    for out in _at(world)["reshard_after_backward"]:
        assert all(out.values()), out


class Checkpointed(nn.Module):
    """Wraps a block in non-reentrant activation checkpointing (recomputed in backward)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def _checkpointing_worker(rank: int, world: int) -> float:
    torch.manual_seed(0)
    ref = ToyModel().double()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    for i in range(len(model.blocks)):
        model.blocks[i] = Checkpointed(model.blocks[i])
    fsdp2.fully_shard(model)
    for step in range(2):  # gradients accumulate over two steps
        ids, tg = batch(step, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()
        loss_fn(ref(ids), tg).backward()
    got = {n.replace(".block.", "."): p.grad.full_tensor() for n, p in model.named_parameters()}
    return max((got[n] - p.grad).abs().max().item() for n, p in ref.named_parameters())


@pytest.mark.parametrize("world", [1, 2])
def test_activation_checkpointing_matches_local(world: int) -> None:
    assert max(_at(world)["checkpointing"]) < 1e-12


class ReentrantCheckpointed(ToyModel):
    """Blocks under reentrant checkpointing: forward runs under no_grad, the recompute
    inside backward builds the graph that gradients flow through."""

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return self.head(self.extra(x))


def _reentrant_and_list_meta_worker(rank: int, world: int) -> bool:
    from _models import copy_full_into_sharded

    torch.manual_seed(0)
    ref = ReentrantCheckpointed().double()
    init = full_params(ref)
    with torch.device("meta"):
        model = ReentrantCheckpointed().double()
    fsdp2.fully_shard([model.blocks[0], model.blocks[1]])  # one group over two modules
    fsdp2.fully_shard(model.blocks[2])
    fsdp2.fully_shard(model)
    model.to_empty(device="cpu")
    copy_full_into_sharded(model, init, rank, world)
    ids, tg = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), tg.chunk(world)[rank]).backward()
    loss_fn(ref(ids), tg).backward()
    worst = max(
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
    )
    return worst < 1e-12


@pytest.mark.parametrize("world", [1, 2])
def test_reentrant_checkpointing_and_list_group_meta_init(world: int) -> None:
    assert all(_at(world)["reentrant_and_list_meta"])


def _dropped_forward_worker(rank: int, world: int) -> list[int]:
    torch.manual_seed(0)
    model = _shard(ToyModel())
    ids, _ = batch(0, 2 * world)
    out = model(ids.chunk(world)[rank])  # grad-enabled forward that never gets a backward
    del out  # its graph is freed: no group may keep waiting for it
    return [g.calls.pending for g in _groups(model)]


def test_forward_without_backward_leaves_no_pending_gradients() -> None:
    for counts in _at(2)["dropped_forward"]:
        assert all(n == 0 for n in counts), counts


def _last_backward_worker(rank: int, world: int) -> float:
    torch.manual_seed(0)
    ref = ToyModel().double()
    model = _shard(copy.deepcopy(ref))
    micro = 3
    ids, tg = batch(0, 2 * world * micro)
    for mb, (i, t) in enumerate(zip(ids.chunk(micro), tg.chunk(micro))):
        model.set_is_last_backward(mb == micro - 1)  # reduce-scatters stay in flight until the last
        loss_fn(model(i.chunk(world)[rank]), t.chunk(world)[rank]).backward()
        loss_fn(ref(i), t).backward()
    return max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("world,in_place", [(1, False), (2, False), (2, True)])
def test_is_last_backward_false_over_micro_batches(world: int, in_place: bool) -> None:
    # In place, reduces in flight hold the parameters' storage: the next forward waits.
    worker = functools.partial(in_place_worker, _last_backward_worker) if in_place else _last_backward_worker
    assert max(run_ranks(worker, world)) < 1e-12


def _one_rank_worker(rank: int, world: int, param_dtype: torch.dtype | None) -> dict:
    torch.manual_seed(0)
    ref = ToyModel().double()
    model = copy.deepcopy(ref)
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype)
    for block in model.blocks:
        fsdp2.fully_shard(block, mp_policy=mp)
    fsdp2.fully_shard(model, mp_policy=mp)
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(m.fc1.weight.is_leaf))
    ids, tg = batch(0, 2)
    out = model(ids)
    nodes, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack.extend(n for n, _ in node.next_functions)
    loss_fn(out.double(), tg).backward()
    loss_fn(ref(ids), tg).backward()
    worst = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {
        "leaf_params": seen == [True],
        "our_nodes": sum("PostBackward" in type(n).__name__ for n in nodes),
        "worst": worst,
    }


def test_one_rank_computes_on_leaf_aliases_of_the_shards() -> None:
    """World 1 without a dtype change: modules see leaves sharing the shards' storage and
    autograd accumulates their gradients itself (no node of ours in the graph); with a
    compute dtype the regular path runs: leaves over the gathered copy, and one node per
    block call (the root's input needs no grad). Both match local training."""
    direct = _at(1)["one_rank_direct"][0]
    assert direct["leaf_params"] and direct["our_nodes"] == 0 and direct["worst"] < 1e-12, direct
    cast = _at(1)["one_rank_cast"][0]
    assert cast["leaf_params"] and cast["our_nodes"] == 3 and cast["worst"] < 1e-5, cast


def _reinit_worker(rank: int, world: int, port: int) -> list:
    import os

    import torch.distributed as dist
    from _models import force_in_place

    force_in_place()  # in-place buckets: fsdp2 makes a gloo group for their gathers
    losses = []
    for attempt in range(2):
        if attempt:  # a fresh default group in the same processes (e.g. an in-process restart)
            dist.destroy_process_group()
            os.environ["MASTER_PORT"] = str(port)
            dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.manual_seed(0)
        model = ToyModel()
        for block in model.blocks:
            fsdp2.fully_shard(block, reshard_after_forward=2)  # makes sub-groups of 2 ranks
        fsdp2.fully_shard(model)
        ids, targets = batch(0, 2 * world)
        loss = loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank])
        loss.backward()
        losses.append(loss.item())
        group = model.blocks[0]._fsdp2_state.group
        made = [group.buckets[0].gather.target.group] + [b.in_place.gather_group for b in group.buckets]
        known = []
        for pg in made:  # torch.distributed knows (registered) every group fsdp2 uses
            try:
                known.append(len(dist.get_process_group_ranks(pg)))
            except (ValueError, RuntimeError, KeyError):
                known.append(0)
        losses.append(known)
    return losses


def test_groups_fsdp2_made_are_made_anew_after_reinit() -> None:
    """Process groups fsdp2 creates (partial-reshard sub-groups, in-place gather groups)
    belong to one default group: after destroy and init, new ones are made. (A stale
    one still moved data on gloo here, but torch.distributed no longer knew it.)"""
    from _dist import free_port

    for out in run_ranks(_reinit_worker, 4, free_port()):
        assert out[0] == out[2], out  # the same loss
        assert out[1] == out[3] == [2, 4], out  # a sub-group of 2, the gather group of 4


class _TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _unused_branch_worker(rank: int, world: int) -> float:
    torch.manual_seed(0)
    ref = _TwoBranches().double()
    model = copy.deepcopy(ref)
    fsdp2.fully_shard(model.a)
    fsdp2.fully_shard(model.b)
    fsdp2.fully_shard(model)
    x = torch.randn(2 * world * 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for mb, xs in enumerate(x.chunk(2)):
        model.set_is_last_backward(mb == 1)  # the first micro-batch's reduces stay in flight
        ya, yb = model(xs.chunk(world)[rank])
        # The second micro-batch ignores b's output (kept alive): b's backward never runs,
        # and its reduce is issued at the end of backward, behind the one in flight.
        ((ya + yb).sum() if mb == 0 else ya.sum()).backward()
        ra, rb = ref(xs)
        ((ra + rb).sum() if mb == 0 else ra.sum()).backward()
    return max(
        (p.grad.full_tensor() * world - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
    )


@pytest.mark.parametrize("world", [1, 2])
def test_reduce_at_the_end_of_backward_waits_for_the_one_in_flight(world: int) -> None:
    assert max(_at(world)["unused_branch"]) < 1e-12


def _metrics_forward_worker(rank: int, world: int, blocks_reshard: bool | None) -> float:
    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=False).double()
    model = copy.deepcopy(ref)
    for block in model.blocks:
        fsdp2.fully_shard(block, reshard_after_forward=blocks_reshard)
    fsdp2.fully_shard(model)  # the root keeps its parameters after forward
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(4):
        ids, targets = batch(step, 2 * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        loss_fn(ref(ids), targets).backward()
        model(ids.chunk(world)[rank])  # a metrics forward, grad mode on, no backward
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("blocks_reshard", [None, False])
def test_forward_after_an_optimizer_step_gathers_fresh_parameters(blocks_reshard: bool | None) -> None:
    """Groups still gathered from a forward that no backward followed (the root, the
    last block, ``reshard_after_forward=False``) are gathered afresh once the shards
    changed (here by the optimizer), not reused with the old values."""
    assert max(_at(2)[f"metrics_forward_{blocks_reshard}"]) < 1e-12


@cached_outcome
def _at(world: int) -> dict[str, list]:
    """Every scenario of this file that runs at ``world`` ranks, in one spawn."""
    both = {
        "eval": (_eval_worker, ()),
        "forward_method": (_forward_method_worker, ()),
        "reshard_after_backward": (_reshard_after_backward_worker, ()),
        "checkpointing": (_checkpointing_worker, ()),
        "reentrant_and_list_meta": (_reentrant_and_list_meta_worker, ()),
        "unused_branch": (_unused_branch_worker, ()),
    }
    if world == 1:
        return run_scenarios(1, {
            **both,
            "one_rank_direct": (_one_rank_worker, (None,)),
            "one_rank_cast": (_one_rank_worker, (torch.float32,)),
        })
    return run_scenarios(2, {
        **both,
        "structured": (_structured_worker, ()),
        "unshard": (_unshard_worker, ()),
        "dropped_forward": (_dropped_forward_worker, ()),
        "metrics_forward_None": (_metrics_forward_worker, (None,)),
        "metrics_forward_False": (_metrics_forward_worker, (False,)),
    })
