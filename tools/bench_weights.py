"""Weights out (reinforcement-learning loops): ``fsdp2.full_weights`` against the two
exports torch's ``fully_shard`` users write, in bf16 for an inference engine.

* ``per-parameter loop``: ``p.full_tensor().to(bf16)`` for each state-dict entry of
  torch's ``fully_shard`` model, handed over one by one;
* ``get_model_state_dict``: ``get_model_state_dict(model, options=StateDictOptions(
  full_state_dict=True))`` of torch's model, then each entry cast;
* ``fsdp2.full_weights``: ``fsdp2.full_weights(model, dtype=torch.bfloat16)`` of fsdp2's.

Each export is copied into an unsharded bf16 engine as it arrives, as an engine's
``load_weights`` does. Reported per export: all-gathers and their gathered bytes (c10d's
and DTensor's functional ones, counted by a dispatch mode), the median time, and the
peak bytes of tensors the export made that were alive at once (``MemoryTracker``: full-
size tensors held, on top of the model itself).

    python tools/bench_weights.py              # both parts
    python tools/bench_weights.py --part gloo  # the example model (examples/model.py) at 4 gloo ranks
    python tools/bench_weights.py --part fake  # one rank of 64, a ~1B-parameter model, fake process group

The fake process group moves no data (``fsdp2.estimate``'s machinery: collectives
deliver as if every rank held this one's shard), so there the time is each export's host
work and copies, not the network's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]

from model import ModelArgs, Transformer, rotary_tables
from rl_loop import GatherMeter, export_per_parameter, load_into

EXAMPLE = ModelArgs()  # examples/train.py's default: dim 128, 4 layers, vocab 512
BILLION = ModelArgs(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, hidden_dim=5632, max_seq_len=16)
METHODS = ("per-parameter loop", "get_model_state_dict", "fsdp2.full_weights")


def build(lib_name: str, args: ModelArgs) -> torch.nn.Module:
    if lib_name == "fsdp2":
        import fsdp2 as lib
    else:
        import torch.distributed.fsdp as lib  # type: ignore[no-redef]
    with torch.device("meta"):
        model = Transformer(args)
    for layer in model.layers:
        lib.fully_shard(layer)
    lib.fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().fill_(1.0) if name.endswith("norm.weight") else p.to_local().normal_(0, 0.02)
        cos, sin = rotary_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        model.rope_cos.copy_(cos)  # buffers: to_empty left them uninitialized (a forward reads them)
        model.rope_sin.copy_(sin)
    return model


def exports(models: dict[str, torch.nn.Module]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import fsdp2

    def full_state_dict() -> Any:
        sd = get_model_state_dict(models["torch"], options=StateDictOptions(full_state_dict=True))
        return ((k, v.to(torch.bfloat16)) for k, v in sd.items())

    return {
        "per-parameter loop": lambda: export_per_parameter(models["torch"], torch.bfloat16),
        "get_model_state_dict": full_state_dict,
        "fsdp2.full_weights": lambda: fsdp2.full_weights(models["fsdp2"], dtype=torch.bfloat16),
    }


def measure(args: ModelArgs, repeats: int) -> dict[str, dict[str, float]]:
    """Each export ``repeats`` times, alternating; rank 0's counts, median time, peak."""
    from fsdp2.memory.tracker import MemoryTracker

    models = {name: build(name, args) for name in ("torch", "fsdp2")}
    engine = Transformer(args).to(torch.bfloat16).requires_grad_(False)
    runs = exports(models)
    from fsdp2._module import groups_under

    existing = [b.sharded_flat for g in groups_under(models["fsdp2"]) for b in g.buckets]  # before its slices
    existing += [p.to_local() for m in models.values() for p in m.parameters()] + list(engine.parameters())
    out: dict[str, dict[str, Any]] = {m: {"times": []} for m in METHODS}
    for i in range(repeats):
        for method in METHODS if i % 2 == 0 else reversed(METHODS):
            dist.barrier()
            meter, tracker = GatherMeter(), MemoryTracker(lambda: "export", lambda: "")
            with tracker:  # what exists already (the engine, the shards): counted before, not as the export's
                for t in existing:
                    torch.ops.aten.alias(t)
                tracker.reset_peak()
            base = tracker.now
            start = time.perf_counter()
            with meter, tracker:
                load_into(engine, runs[method]())
            out[method]["times"].append(time.perf_counter() - start)
            out[method].update(gathers=meter.calls, bytes=meter.bytes, peak=tracker.peak - base)
    for method in METHODS:
        out[method]["ms"] = statistics.median(out[method].pop("times")) * 1e3
    return out


def _gloo_rank(rank: int, world: int, repeats: int) -> dict[str, Any]:
    return measure(EXAMPLE, repeats)


def gloo(repeats: int) -> dict[str, Any]:
    from _dist import run_ranks

    return run_ranks(_gloo_rank, 4, repeats, timeout=900)[0]


def fake(world: int, repeats: int) -> dict[str, Any]:
    from fsdp2.estimate.fake import fake_distributed

    undo = fake_distributed(0, world, 8)
    try:
        dist.init_process_group("gloo")
        return measure(BILLION, repeats)
    finally:
        undo()


def report(title: str, results: dict[str, Any]) -> None:
    print(f"\n== {title}")
    print(f"{'export':24s} {'all-gathers':>11s} {'gathered MiB':>13s} {'median ms':>10s} {'peak full-size MiB':>19s}")
    for method in METHODS:
        r = results[method]
        print(f"{method:24s} {r['gathers']:11d} {r['bytes'] / 2**20:13.1f} {r['ms']:10.1f} {r['peak'] / 2**20:19.1f}")
    mine, loop = results["fsdp2.full_weights"], results["per-parameter loop"]
    print(f"fsdp2 / per-parameter loop: all-gathers {mine['gathers'] / loop['gathers']:.3f}, "
          f"bytes {mine['bytes'] / loop['bytes']:.2f}, time {mine['ms'] / loop['ms']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["gloo", "fake", "all"], default="all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=64, help="ranks of the fake process group")
    ns = p.parse_args()
    if ns.part in ("gloo", "all"):
        n = sum(v.numel() for v in Transformer(EXAMPLE).parameters())
        report(f"the example model ({n / 1e6:.2f}M parameters, 4 blocks + root), 4 gloo ranks", gloo(ns.repeats))
    if ns.part in ("fake", "all"):
        with torch.device("meta"):
            n = sum(v.numel() for v in Transformer(BILLION).parameters())
        report(f"one rank of {ns.world}, {n / 1e9:.2f}B parameters (16 blocks + root), fake process group",
               fake(ns.world, max(1, ns.repeats // 2)))


if __name__ == "__main__":
    main()
