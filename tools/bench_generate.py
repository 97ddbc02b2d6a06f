"""Generation with the sharded model itself (TRL's GRPO without vLLM, verl's HF rollout,
evaluation with ``generate``): N tokens, greedily, each a forward of the sharded policy.

* ``torch fully_shard``: torch's, as its users generate (the blocks are gathered again
  for every token; the root stays gathered by its default);
* ``fsdp2 per forward``: fsdp2 without anything more (the same schedule as torch's);
* ``fsdp2 gathered``: inside ``with fsdp2.gathered(model):`` (each group once);
* ``fsdp2 gathered, half``: ``fsdp2.gathered(model, max_bytes=...)`` with half the
  model's gathered bytes (the groups that fit once, the rest per token).

Reported per generation, on rank 0: all-gathers and their gathered bytes (counted on the
process group's methods, ``tests/_comm.py``), the median time (variants alternate), and
the peak bytes of tensors alive at once during the generation on top of the sharded
model (``MemoryTracker``: gathered parameters, activations, communication buffers).

    python tools/bench_generate.py               # both parts
    python tools/bench_generate.py --part gloo   # 2 and 4 gloo ranks, the example's model at dim 256
    python tools/bench_generate.py --part fake   # one rank of 64, a ~1B-parameter model, fake process group

The fake process group moves no data (``fsdp2.estimate``'s machinery), so there the time
is the host's work and the compute, not the network's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, *(os.path.join(ROOT, d) for d in ("tests", "examples", "tools"))]

from bench_weights import build  # the model sharded by either library, weights and rope tables set
from model import ModelArgs, Transformer

GLOO = ModelArgs(vocab_size=512, dim=256, n_layers=4, n_heads=4, hidden_dim=688, max_seq_len=32)
BILLION = ModelArgs(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, hidden_dim=5632, max_seq_len=16)
VARIANTS = ("torch fully_shard", "fsdp2 per forward", "fsdp2 gathered", "fsdp2 gathered, half")


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: torch.Tensor, tokens: int) -> torch.Tensor:
    seqs = prompts
    for _ in range(tokens):
        seqs = torch.cat([seqs, model(seqs)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seqs


@contextlib.contextmanager
def torch_resizes_seen() -> Any:
    """torch's ``fully_shard`` frees and re-allocates its unsharded parameters by resizing
    their storage, which no op shows ``MemoryTracker``: its two helpers are wrapped to tell
    the tracker, as fsdp2's buckets do (without this, torch's freed parameters would count
    as alive to the end)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fsdp2.memory.tracker import MemoryTracker

    saved = (_fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage)

    def told(fn: Any) -> Any:
        def wrapped(tensor: torch.Tensor) -> None:
            fn(tensor)
            for mode in _get_current_dispatch_mode_stack():
                if isinstance(mode, MemoryTracker):
                    mode.resized(tensor.untyped_storage())

        return wrapped

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = told(saved[0]), told(saved[1])
    _fsdp_param_group.alloc_storage = _fsdp_param.alloc_storage
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage, _fsdp_param_group.alloc_storage = saved


def measure(args: ModelArgs, tokens: int, repeats: int) -> dict[str, dict[str, Any]]:
    from _comm import CommCounter

    import fsdp2
    from fsdp2._module import groups_under
    from fsdp2.memory.tracker import MemoryTracker

    models = {"torch": build("torch", args).eval(), "fsdp2": build("fsdp2", args).eval()}
    half = sum(g.gathered_bytes() for g in groups_under(models["fsdp2"])) // 2  # a budget of half the model
    prompts = torch.randint(
        0, args.vocab_size, (2, 4), generator=torch.Generator().manual_seed(dist.get_rank())
    )
    runs = {
        "torch fully_shard": (models["torch"], contextlib.nullcontext),
        "fsdp2 per forward": (models["fsdp2"], contextlib.nullcontext),
        "fsdp2 gathered": (models["fsdp2"], lambda: fsdp2.gathered(models["fsdp2"])),
        "fsdp2 gathered, half": (models["fsdp2"], lambda: fsdp2.gathered(models["fsdp2"], max_bytes=half)),
    }
    out: dict[str, dict[str, Any]] = {v: {"times": []} for v in VARIANTS}
    for i in range(repeats):
        for variant in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
            model, block = runs[variant]
            for m in models.values():
                m.reshard()  # every generation starts from the sharded model (the root too)
            dist.barrier()
            counter, tracker = CommCounter(), MemoryTracker(lambda: "generate", lambda: "")
            tracker.note_module(model)
            with tracker:
                tracker.reset_peak()
            base = tracker.now
            start = time.perf_counter()
            with counter.active(), torch_resizes_seen(), tracker, block():
                seqs = generate(model, prompts, tokens)
            out[variant]["times"].append(time.perf_counter() - start)
            out[variant].update(
                gathers=counter.calls["all_gather"],
                bytes=counter.bytes["all_gather"],
                peak=tracker.peak - base,
                tokens=seqs.tolist(),
            )
    for variant in VARIANTS:
        out[variant]["ms"] = statistics.median(out[variant].pop("times")) * 1e3
    return out


def _gloo_rank(rank: int, world: int, tokens: int, repeats: int) -> dict[str, Any]:
    return measure(GLOO, tokens, repeats)


def gloo(world: int, tokens: int, repeats: int) -> dict[str, Any]:
    from _dist import run_ranks

    return run_ranks(_gloo_rank, world, tokens, repeats, timeout=900)[0]


def fake(world: int, tokens: int, repeats: int) -> dict[str, Any]:
    from fsdp2.estimate.fake import fake_distributed

    undo = fake_distributed(0, world, 8)
    try:
        dist.init_process_group("gloo")
        return measure(BILLION, tokens, repeats)
    finally:
        undo()


def report(title: str, results: dict[str, Any]) -> None:
    print(f"\n== {title}")
    print(f"{'':22s} {'all-gathers':>11s} {'gathered MiB':>13s} {'median ms':>10s} {'peak MiB':>9s}")
    for variant in VARIANTS:
        r = results[variant]
        mib, peak = r["bytes"] / 2**20, r["peak"] / 2**20
        print(f"{variant:22s} {r['gathers']:11d} {mib:13.1f} {r['ms']:10.1f} {peak:9.1f}")
    mine, theirs = results["fsdp2 gathered"], results["torch fully_shard"]
    print(
        f"fsdp2 gathered / torch: all-gathers {mine['gathers'] / theirs['gathers']:.3f}, bytes "
        f"{mine['bytes'] / theirs['bytes']:.3f}, time {mine['ms'] / theirs['ms']:.2f}, peak "
        f"{mine['peak'] / theirs['peak']:.2f}; tokens: gathered == per forward "
        f"{mine['tokens'] == results['fsdp2 per forward']['tokens']}, "
        f"== torch's {mine['tokens'] == theirs['tokens']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["gloo", "fake", "all"], default="all")
    p.add_argument("--tokens", type=int, default=8, help="tokens generated (N)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=64, help="ranks of the fake process group")
    ns = p.parse_args()
    if ns.part in ("gloo", "all"):
        n = sum(v.numel() for v in Transformer(GLOO).parameters())
        for world in (2, 4):
            report(
                f"{n / 1e6:.1f}M parameters (4 blocks + root), {world} gloo ranks, {ns.tokens} tokens",
                gloo(world, ns.tokens, ns.repeats),
            )
    if ns.part in ("fake", "all"):
        with torch.device("meta"):
            n = sum(v.numel() for v in Transformer(BILLION).parameters())
        report(
            f"one rank of {ns.world}, {n / 1e9:.2f}B parameters (16 blocks + root), fake process group, "
            f"{ns.tokens} tokens",
            fake(ns.world, ns.tokens, max(1, ns.repeats // 2)),
        )


if __name__ == "__main__":
    main()
