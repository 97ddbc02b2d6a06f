"""``fsdp2.plan`` on the example's Mixture-of-Experts model, at 4 gloo ranks: with an
expert mesh (expert parallel 2: experts split over ``ep``, sharded over ``efsdp``) and
without one (2 experts, 4 ranks: experts sharded on dim 1, torchtitan's choice). The
plan applied is indistinguishable from the example's hand-written calls
(``examples/moe.py``'s ``expert_placement_fn``): every parameter has the same mesh,
placements and local values, and two training steps give bitwise equal losses and
parameters."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")


def _layouts(model: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    return {n: (p.device_mesh.mesh.tolist(), tuple(map(str, p.placements)), tuple(p.to_local().shape))
            for n, p in model.named_parameters()}


def _run(rank: int, world: int, ep: int, n_experts: int) -> dict[str, Any]:
    sys.path.insert(0, EXAMPLES)
    import torch.distributed as dist
    import torch.nn.functional as F
    from model import ModelArgs, Transformer
    from moe import expert_placement_fn, moe_meshes, parallelize_experts

    import fsdp2

    meshes = moe_meshes("cpu", world, 1, 1, ep)
    torch.manual_seed(0)
    base = Transformer(ModelArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32, hidden_dim=24, max_seq_len=8,
                                 n_experts=n_experts, top_k=1)).double()
    base.init_weights(seed=0)
    planned, hand = copy.deepcopy(base), copy.deepcopy(base)
    for m in (planned, hand):
        if meshes.ep is not None:
            parallelize_experts(m, meshes.ep)
    plan = fsdp2.plan(planned, mesh=meshes.dense, expert_mesh=meshes.experts)
    plan.apply(planned)
    for layer in hand.layers:
        fsdp2.fully_shard(layer, mesh=meshes.dense, shard_placement_fn=expert_placement_fn(layer, "fsdp2", meshes))
    fsdp2.fully_shard(hand.tok_embeddings, mesh=meshes.dense)  # torchtitan's order: these first
    fsdp2.fully_shard([hand.norm, hand.output], mesh=meshes.dense, reshard_after_forward=False)
    fsdp2.fully_shard(hand, mesh=meshes.dense)
    out: dict[str, Any] = {"same_layout": _layouts(planned) == _layouts(hand), "code": plan.code(),
                           "why": [g.why for g in plan.groups]}
    losses: dict[str, list[float]] = {"planned": [], "hand": []}
    for name, m in (("planned", planned), ("hand", hand)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(2):
            g = torch.Generator().manual_seed(step * world + rank)
            ids = torch.randint(0, 32, (2, 8), generator=g)
            loss = F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    out["losses"] = losses
    out["params_equal"] = all(torch.equal(a.to_local(), b.to_local())
                              for a, b in zip(planned.parameters(), hand.parameters()))
    dist.barrier()
    return out


@pytest.mark.parametrize("ep,n_experts", [(2, 4), (1, 2)])
def test_plan_places_experts_as_the_hand_written_calls(ep: int, n_experts: int) -> None:
    out = run_ranks(_run, 4, ep, n_experts)
    for r in out:
        assert r["same_layout"], "a parameter's mesh, placement or local shape differs"
        assert r["losses"]["planned"] == r["losses"]["hand"] and r["params_equal"]
    code, why = out[0]["code"], out[0]["why"]
    assert 'shard_placement_fn=experts_on(model.get_submodule("layers.1.feed_forward.experts")' in code
    if ep > 1:
        assert "expert_mesh)" in code and "on the expert mesh" in why[1]
    else:
        assert ", mesh)" in code and "sharded on dim 1: 2 experts, 4 ranks" in why[1]
