"""The planner at scale: a Llama-3.2-1B-shaped model (1.24B parameters, tied embeddings)
at 1,024 ranks, fitted to budgets from loose to tight on this CPU.

    python tools/plan_scale.py            # the 1B model, 4096 tokens per rank, 1024 ranks
    python tools/plan_scale.py --quick    # a small model (what the test runs)

Prints, per budget: the choices (groups resharded after forward, blocks under selective
and full checkpointing, offload), the estimated peak, the seconds the planning took; then
checks that every fitted plan fits, that the choices only get more conservative as the
budget shrinks, and reports the whole run's time (the issue's bound: 2 minutes).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

import fsdp2
from fsdp2.planning import BudgetError

_MIB = 2**20


def build(quick: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor], int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True)
        tokens, world = 256, 64
    else:  # Llama-3.2-1B's shape
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
        tokens, world = 4096, 1024
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}, world


def choices(plan: Any) -> tuple[int, int, int, int]:
    g = plan.groups
    return (sum(x.reshard_after_forward is True for x in g), sum(x.ac == "selective" for x in g),
            sum(x.ac == "full" for x in g), sum(x.offload for x in g))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small model at 64 ranks")
    ns = p.parse_args(argv)
    model, inputs, world = build(ns.quick)
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    start = time.perf_counter()
    unfitted = fsdp2.plan(model, world_size=world, mp_policy=mp, inputs=inputs)
    assert unfitted.estimate is not None
    top = unfitted.estimate.peak
    n = sum(t.numel() for t in model.parameters())
    print(f"{type(model).__name__}: {n / 1e9:.2f}B parameters, {world} ranks, "
          f"{inputs['input_ids'].shape[1]} tokens per rank; the default plan's peak {top / _MIB:,.0f} MiB")
    print(f"{'budget MiB':>10s}  {'resharded':>9s}  {'selective':>9s}  {'full AC':>7s}  {'offload':>7s}  "
          f"{'peak MiB':>8s}  {'fits':>4s}  {'seconds':>7s}")
    previous: list[tuple[Any, ...]] | None = None
    ok = True
    for share in (1.5, 1.0, 0.8, 0.6, 0.45, 0.3, 0.1):
        budget = int(top * share)
        t = time.perf_counter()
        try:
            plan = fsdp2.plan(model, world_size=world, mp_policy=mp, inputs=inputs, memory_budget=budget)
        except BudgetError as e:
            plan = e.plan
        seconds = time.perf_counter() - t
        assert plan.estimate is not None
        c = choices(plan)
        print(f"{budget / _MIB:10,.0f}  {c[0]:9d}  {c[1]:9d}  {c[2]:7d}  {c[3]:7d}  "
              f"{plan.estimate.peak / _MIB:8,.0f}  {'yes' if plan.estimate.fits else 'no':>4s}  {seconds:7.1f}")
        settings = [(int(g.reshard_after_forward is True), ("none", "selective", "full").index(g.ac), int(g.offload))
                    for g in plan.groups]
        if previous is not None and any(a < b for now, before in zip(settings, previous) for a, b in zip(now, before)):
            print("  a choice got less conservative than at the larger budget")
            ok = False
        previous = settings
    total = time.perf_counter() - start
    print(f"whole planning run: {total:.1f} s; choices monotone: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
