"""Memory: gathered parameters that nothing can read any more are freed in backward
(the root's, once the output layer's backward ran), and never while something can."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
from _comm import CommCounter
from _dist import cached_outcome, run_ranks, run_scenarios
from _models import ToyModel, batch, in_place_worker, loss_fn

import fsdp2


def _shard(model: nn.Module) -> nn.Module:
    for block in model.blocks:
        fsdp2.fully_shard(block)
    return fsdp2.fully_shard(model)


def _gathered_bytes(module: nn.Module) -> int:
    return sum(b.unsharded_bytes() for b in module._fsdp2_state.group.buckets)


def _grads_match(model: nn.Module, ref: nn.Module, scale: float = 1.0) -> bool:
    for p, r in zip(model.parameters(), ref.parameters()):
        if (p.grad is None) != (r.grad is None):
            return False
        if p.grad is not None and not torch.allclose(p.grad.full_tensor(), scale * r.grad, rtol=1e-10, atol=1e-12):
            return False
    return True


def _root_freed_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    ref = ToyModel(n_blocks=3).double()
    model = _shard(copy.deepcopy(ref))
    seen: list[int] = []

    def probe(module: nn.Module, args: tuple) -> None:  # after the block's backward, so after its pre_backward
        args[0].register_hook(lambda g: seen.append(_gathered_bytes(model)))

    for block in model.blocks:
        block.register_forward_pre_hook(probe)
    ids, targets = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()  # warm-up: records the order
    model.zero_grad()
    seen.clear()
    with CommCounter().active() as counter:
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    loss_fn(ref(ids), targets).backward()
    return {"seen": seen, "gathers": counter.calls["all_gather"], "grads": _grads_match(model, ref)}


def test_root_parameters_are_freed_once_the_head_backward_ran() -> None:
    for out in _at2()["root_freed"]:
        # Every block's backward runs with the root's gathered parameters already freed,
        # without any extra all-gather (4 groups forward + 2 blocks again in backward:
        # the last block keeps its parameters for backward).
        assert out["seen"] == [0, 0, 0], out
        assert out["gathers"] == 4 + 2, out
        assert out["grads"], out


def _retain_graph_worker(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    ref = ToyModel(n_blocks=2).double()
    model = _shard(copy.deepcopy(ref))
    ids, targets = batch(0, 2 * world)
    loss = loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank])
    loss.backward(retain_graph=True)  # the head's saved weight stays referenced
    loss.backward()
    loss_fn(ref(ids), targets).backward()
    return _grads_match(model, ref, scale=2.0)


@pytest.mark.parametrize("in_place", [False, True])
def test_retained_graph_keeps_reading_the_root_parameters(in_place: bool) -> None:
    worker = functools.partial(in_place_worker, _retain_graph_worker) if in_place else _retain_graph_worker
    assert all(run_ranks(worker, 2))


class _DetachedScale(torch.autograd.Function):
    """``x * w`` that saves a detached alias of ``w``, as fused kernels often do: it shares
    the storage without being the parameter view fsdp2 handed out."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w = w.detach()
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (x,) = ctx.saved_tensors
        return grad * ctx.w, (grad * x).flatten(0, -2).sum(0)


class EarlyRootUse(ToyModel):
    """A root parameter read at the very end of backward: a scale applied right after the
    embedding, saved by autograd as the view fsdp2 handed out or as a detached alias."""

    def __init__(self, alias: bool) -> None:
        super().__init__(n_blocks=2, tie=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.alias = alias

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = self.emb(ids)
        x = _DetachedScale.apply(x, self.scale) if self.alias else x * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(self.extra(x))


def _second_step_grads_worker(rank: int, world: int, model_cls: type, *args: object) -> bool:
    """Gradients of a second step (forward order known, so freeing early is on) against a
    local float64 replica fed the global batch."""
    torch.manual_seed(0)
    ref = model_cls(*args).double()
    model = _shard(copy.deepcopy(ref))
    ids, targets = batch(0, 2 * world)
    for _ in range(2):
        model.zero_grad()
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    loss_fn(ref(ids), targets).backward()
    return _grads_match(model, ref)


def test_root_parameters_still_saved_for_backward_stay_gathered() -> None:
    for alias in (False, True):
        assert all(_at2()[f"EarlyRootUse{alias}"]), alias


class FrozenRootBetweenBlocks(ToyModel):
    """Trainable blocks; the root's parameters all frozen, one of them (``mid``) applied
    between the blocks: autograd saves it and reads it late in backward."""

    def __init__(self) -> None:
        super().__init__(n_blocks=2, tie=False)
        self.mid = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        for p in (self.emb.weight, self.mid, self.extra.weight, self.extra.bias, self.head.weight):
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = self.blocks[0](self.emb(ids)) * self.mid
        return self.head(self.extra(self.blocks[1](x)))


def test_frozen_root_parameters_saved_by_autograd_stay_gathered() -> None:
    assert all(_at2()["FrozenRootBetweenBlocks"])


class _HeldOnCtx(_DetachedScale):
    """``x * w`` keeping ``w`` itself as a ``ctx`` attribute (not saved for backward), as
    custom kernels sometimes do: no saved tensor and no storage view shows it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.w = w
        ctx.save_for_backward(x)
        return x * w


class RootHeldOnCtx(EarlyRootUse):
    """The root's scale, right after the embedding, kept on an autograd ``ctx``."""

    def __init__(self) -> None:
        super().__init__(alias=False)

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = _HeldOnCtx.apply(self.emb(ids), self.scale)
        for block in self.blocks:
            x = block(x)
        return self.head(self.extra(x))


class _BlockUsingShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, shared: nn.Module) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + shared(x)


class RootModuleInBlocks(ToyModel):
    """A LayerNorm of the root's called inside each block's forward (it saves its weight
    for backward, read at the very end of backward by the first block)."""

    def __init__(self) -> None:
        super().__init__(n_blocks=0, tie=False)
        self.shared = nn.LayerNorm(6)
        with torch.no_grad():
            self.shared.weight.uniform_(0.5, 1.5)
        self.blocks = nn.ModuleList(_BlockUsingShared() for _ in range(3))

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, self.shared)
        return self.head(x)


class RootLayerCheckpointed(ToyModel):
    """The root's own layer under activation checkpointing before the blocks: its
    recompute, at the end of backward, needs the root's parameters again."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(n_blocks=2, tie=False)
        self.reentrant = reentrant

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = torch.utils.checkpoint.checkpoint(self.extra, self.emb(ids), use_reentrant=self.reentrant)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_root_parameters_held_or_recomputed_outside_its_hooks_stay_readable() -> None:
    """Held on an autograd ``ctx``, used by a module called inside other groups' forwards,
    or recomputed by a checkpoint after the root was freed: gradients equal local
    training (a read of freed storage would raise or give garbage)."""
    for name in HELD_OR_RECOMPUTED:
        assert all(_at2()[name]), name


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class NestedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.proj(x))


class Variants(nn.Module):
    """Blocks and sub-blocks both sharded, checkpointed (non-reentrant) or called twice."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(NestedBlock() for _ in range(2))
        self.head = nn.Linear(6, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            if self.kind == "checkpoint":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            elif self.kind == "twice":
                x = block(block(x))
            else:
                x = block(x)
        return self.head(x)


def _gathers_worker(rank: int, world: int, kind: str) -> dict:
    from unittest import mock

    from fsdp2.runtime.root import RootContext

    counts = {}
    for early in (True, False):
        torch.manual_seed(0)
        model = Variants(kind)
        for block in model.blocks:
            fsdp2.fully_shard(block.mlp)
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
        ids, targets = batch(0, 2 * world)
        never_free = mock.patch.object(RootContext, "free_unreferenced", lambda self, current: None)
        with never_free if not early else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "twice"):
                loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()  # warm-up
                with CommCounter().active() as counter:
                    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        counts[early] = counter.calls["all_gather"]
    return counts


def test_freeing_early_never_adds_all_gathers() -> None:
    for kind in ("plain", "checkpoint", "twice"):
        for out in _at2()[f"gathers_{kind}"]:
            assert out[True] == out[False], (kind, out)


HELD_OR_RECOMPUTED = ("RootHeldOnCtx", "RootModuleInBlocks", "RootLayerCheckpointedFalse", "RootLayerCheckpointedTrue")


@cached_outcome
def _at2() -> dict[str, list]:
    """The scenarios at 2 ranks that need no environment, one after the other in one spawn."""
    return run_scenarios(2, {
        "root_freed": (_root_freed_worker, ()),
        "EarlyRootUseFalse": (_second_step_grads_worker, (EarlyRootUse, False)),
        "EarlyRootUseTrue": (_second_step_grads_worker, (EarlyRootUse, True)),
        "FrozenRootBetweenBlocks": (_second_step_grads_worker, (FrozenRootBetweenBlocks,)),
        "RootHeldOnCtx": (_second_step_grads_worker, (RootHeldOnCtx,)),
        "RootModuleInBlocks": (_second_step_grads_worker, (RootModuleInBlocks,)),
        "RootLayerCheckpointedFalse": (_second_step_grads_worker, (RootLayerCheckpointed, False)),
        "RootLayerCheckpointedTrue": (_second_step_grads_worker, (RootLayerCheckpointed, True)),
        **{f"gathers_{kind}": (_gathers_worker, (kind,)) for kind in ("plain", "checkpoint", "twice")},
    })
