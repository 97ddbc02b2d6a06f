"""Mixture-of-Experts with expert parallel: fsdp2 against torch's ``fully_shard``
(``python tools/bench.py --model moe``, or this file alone).

* speed (gloo, 4 ranks, ep 2): the example's Transformer with MoE MLPs (experts split
  over 2 ranks, sharded over the other 2 by a per-parameter mesh, the rest over all 4),
  both libraries built in the same processes from the same weights and stepped
  alternately: median step time, collectives per step (the token dispatch's
  all-to-alls included: the same in both), losses.
* memory (gloo, 4 ranks, ep 2): a wider model, each library in processes of its own:
  peak RSS above the process baseline, max over ranks.
* host (fake process group, one rank of 64, ep 8): the time each library adds to the
  same step without ``fully_shard`` (experts still split over ep), collectives free and
  the token dispatch replaced by the local routing it would do (the fake group delivers
  nothing): what is left is each library's host work.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]

from _dist import run_ranks  # noqa: E402
from alternate import Alternated, alternate, in_fresh_process, median_ms  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402
from moe import expert_placement_fn, moe_meshes, parallelize_experts, scale_expert_grads  # noqa: E402

SPEED = ModelArgs(vocab_size=1024, dim=128, n_layers=4, n_heads=4, hidden_dim=256, max_seq_len=64, n_experts=8, top_k=2)
MEMORY = ModelArgs(vocab_size=4096, dim=512, n_layers=4, n_heads=8, hidden_dim=1024, max_seq_len=64, n_experts=8, top_k=2)
HOST = ModelArgs(vocab_size=1024, dim=256, n_layers=4, n_heads=4, hidden_dim=512, max_seq_len=16, n_experts=64, top_k=4)
BATCH, SEQ = 4, 64


def build(lib_name: str, args: ModelArgs, ep: int, meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The example's MoE Transformer, experts split over ``ep`` ranks, each block and the
    root sharded by ``lib_name`` (``local``: not sharded)."""
    meshes = moe_meshes("cpu", dist.get_world_size(), 1, 1, ep)
    with torch.device("meta" if meta else "cpu"):
        model = Transformer(args)
    if meshes.ep is not None:
        parallelize_experts(model, meshes.ep)
    if lib_name != "local":
        if lib_name == "fsdp2":
            import fsdp2 as lib
        else:
            import torch.distributed.fsdp as lib  # type: ignore[no-redef]
        for layer in model.layers:
            lib.fully_shard(layer, mesh=meshes.dense, shard_placement_fn=expert_placement_fn(layer, lib_name, meshes))
        lib.fully_shard(model, mesh=meshes.dense)
    if meta:
        model.to_empty(device="cpu")
    model.init_weights(0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, ep: int) -> float:
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    scale_expert_grads(model, ep)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _speed_worker(rank: int, world: int, ep: int, steps: int, warmup: int) -> Alternated:
    built = {lib: build(lib, SPEED, ep) for lib in ("torch", "fsdp2")}
    gen = torch.Generator().manual_seed(rank)
    tokens = lambda: torch.randint(0, SPEED.vocab_size, (BATCH, SEQ + 1), generator=gen)  # noqa: E731
    return alternate(built, lambda b, t: step(*b, t, ep), tokens, steps, warmup, count=True)


def _memory_worker(rank: int, world: int, lib: str, ep: int, steps: int) -> float:
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    model, opt = build(lib, MEMORY, ep, meta=True)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        step(model, opt, torch.randint(0, MEMORY.vocab_size, (BATCH, SEQ + 1), generator=gen), ep)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base


def bench_speed(steps: int, warmup: int, ep: int = 2) -> None:
    res = run_ranks(_speed_worker, 4, ep, steps, warmup, timeout=1800)
    n_params = sum(p.numel() for p in Transformer(SPEED).parameters())
    print(f"\n== moe: {n_params / 1e6:.2f}M params, {SPEED.n_layers} blocks of {SPEED.n_experts} experts "
          f"(top-{SPEED.top_k}), world 4, ep {ep}, {steps} steps")
    med = median_ms({lib: [t for r in res for t in r.times[lib]] for lib in ("torch", "fsdp2")})
    for lib in ("torch", "fsdp2"):
        print(f"  {lib:6s} median step {med[lib]:8.2f} ms | collectives per step: {res[0].comms[lib][0]}")
    same = all(abs(a - b) < 1e-4 for r in res for a, b in zip(r.losses["torch"], r.losses["fsdp2"]))
    print(f"  ratio fsdp2/torch step time: {med['fsdp2'] / med['torch']:.3f} | losses agree: {same}")


def bench_memory(steps: int = 3, ep: int = 2) -> None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # RSS follows live tensors
    peaks = {lib: max(run_ranks(_memory_worker, 4, lib, ep, steps, timeout=1800, fresh=True)) for lib in ("torch", "fsdp2")}
    n_params = sum(p.numel() for p in Transformer(MEMORY).parameters())
    print(f"\n== moe memory: {n_params / 1e6:.1f}M params, world 4, ep {ep}, AdamW, {steps} steps")
    for lib, mb in peaks.items():
        print(f"  {lib:6s} peak memory above baseline (max over ranks): {mb:8.1f} MiB")
    print(f"  ratio fsdp2/torch peak memory: {peaks['fsdp2'] / peaks['torch']:.3f}")


def _local_dispatch(moe: Any, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The fake process group's stand-in for the all-to-all dispatch: this rank's experts
    take the rows of every rank's copy of them (expert ``e`` -> local ``e % local``)."""
    local = moe.experts.w1.to_local().shape[0]
    grid = counts.view(-1, local)  # [ep block][local expert]
    chunks = rows.split(counts.tolist())
    order = [s * local + j for j in range(local) for s in range(grid.shape[0])]
    out = moe.experts(torch.cat([chunks[i] for i in order]), grid.sum(0).tolist())
    pieces = dict(zip(order, out.split([int(counts[i]) for i in order])))
    return torch.cat([pieces[i] for i in range(len(chunks))])


def _host_worker(world: int, ep: int, steps: int, queue: Any) -> None:
    import model as model_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    model_module._dispatch = _local_dispatch  # this process only: the fake group delivers nothing
    built = {}
    for lib in ("local", "torch", "fsdp2"):
        torch.manual_seed(0)
        built[lib] = build(lib, HOST, ep)
    tokens = torch.randint(0, HOST.vocab_size, (1, 17))
    queue.put(median_ms(alternate(built, lambda b, t: step(*b, t, ep), lambda: tokens, steps, 2).times))
    dist.destroy_process_group()


def bench_host(steps: int, world: int = 64, ep: int = 8) -> None:
    med = in_fresh_process(_host_worker, world, ep, steps)
    added = {lib: med[lib] - med["local"] for lib in ("torch", "fsdp2")}
    print(f"\n== moe host overhead: one rank of {world} on the fake process group, ep {ep}, "
          f"{HOST.n_layers} blocks of {HOST.n_experts} experts, {steps} steps, AdamW")
    print(f"  local {med['local']:7.2f} ms | torch +{added['torch']:7.2f} ms | fsdp2 +{added['fsdp2']:7.2f} ms"
          f" | ratio fsdp2/torch added time: {added['fsdp2'] / added['torch']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["speed", "memory", "host", "all"], default="all")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if args.part in ("speed", "all"):
        bench_speed(args.steps, args.warmup)
    if args.part in ("memory", "all"):
        bench_memory()
    if args.part in ("host", "all"):
        bench_host(args.steps)


if __name__ == "__main__":
    main()
