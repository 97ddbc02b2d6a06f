"""Quantized communication against full precision, fsdp2 against itself (and torch's
``fully_shard`` in float32 as the yardstick), in the same processes, stepped alternately:

    python tools/bench.py --model quant      # or: python tools/bench_quant.py [--steps N]

* wire (gloo, 4 ranks, the ``wide`` model: 4 blocks of width 512): bytes per step of the
  all-gathers and of the reduces, counted where every collective ends up
  (``tests/_comm.py``), and their ratio to float32's and to bf16's; the median step time
  (what quantizing costs on these CPUs against what the smaller messages save over
  localhost, where bandwidth is nearly free: on a network the bytes are the point).
* host (one rank of 8 on the fake process group, the ``deep`` model, 32 blocks): the time
  fsdp2 adds to the local step with and without quantization (collectives cost nothing
  there, so what remains is the quantize / dequantize work and its host overhead).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples"), os.path.join(ROOT, "tools")]

import bench  # noqa: E402
from _dist import run_ranks  # noqa: E402
from alternate import Alternated, alternate, in_fresh_process, median_ms  # noqa: E402
from model import Transformer  # noqa: E402

# name -> MixedPrecisionPolicy keywords (``torch``: torch's fully_shard, float32)
VARIANTS: dict[str, dict[str, Any]] = {
    "torch fp32": {},
    "fp32": {},
    "bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "int8 gather": {"quantize_gather": "int8"},
    "int8 gather+reduce": {"quantize_gather": "int8", "quantize_reduce": "int8"},
    "fp8 gather+reduce": {"quantize_gather": "fp8", "quantize_reduce": "fp8"},
    "bf16 + int8 gather": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "quantize_gather": "int8"},
}
WORLD = 4


def build(variant: str, args: Any, meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed.fsdp as torch_fsdp

    import fsdp2

    with torch.device("meta" if meta else "cpu"):
        model = Transformer(args)
    lib = torch_fsdp if variant.startswith("torch") else fsdp2
    mp = lib.MixedPrecisionPolicy(**VARIANTS[variant])
    for layer in model.layers:
        lib.fully_shard(layer, mp_policy=mp)
    lib.fully_shard(model, mp_policy=mp)
    if meta:
        model.to_empty(device="cpu")
    model.init_weights(0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _wire_worker(rank: int, world: int, steps: int, warmup: int) -> Alternated:
    spec = bench.MODELS["wide"]
    torch.manual_seed(0)
    built = {v: build(v, spec["args"]) for v in VARIANTS}
    gen = torch.Generator().manual_seed(rank)
    return alternate(built, lambda b, tokens: bench.step(*b, tokens), bench.tokens_of(spec, gen), steps, warmup, count=True)


def bench_wire(steps: int, warmup: int) -> None:
    results = run_ranks(_wire_worker, WORLD, steps, warmup, timeout=3600)
    args = bench.MODELS["wide"]["args"]
    n_params = sum(p.numel() for p in Transformer(args).parameters())
    print(f"\n== quantized communication: wide model {n_params / 1e6:.2f}M params, gloo {WORLD} ranks, {steps} steps")
    comms = {v: nbytes for v, (_, nbytes) in results[0].comms.items()}
    base = comms["fp32"]
    bf16 = comms["bf16"]
    med = median_ms({v: [t for r in results for t in r.times[v]] for v in VARIANTS})
    print("  | variant | all-gather MiB/step | x fp32 | x bf16 | reduce MiB/step | x fp32 | step ms | x fp32 step |")
    print("  | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in VARIANTS:
        g, r = comms[v].get("all_gather", 0), comms[v].get("reduce", 0)
        print(
            f"  | {v} | {g / 2**20:.2f} | {g / base['all_gather']:.3f} | {g / bf16['all_gather']:.3f} | "
            f"{r / 2**20:.2f} | {r / base['reduce']:.3f} | {med[v]:.1f} | {med[v] / med['fp32']:.3f} |"
        )


def _host_worker(world: int, steps: int, queue: Any) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    variants = ["fp32", "int8 gather", "int8 gather+reduce", "fp8 gather+reduce"]
    built: dict[str, Any] = {}
    torch.manual_seed(0)
    model, loss = bench._host_model("deep")
    built["local"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss)
    for v in variants:
        torch.manual_seed(0)
        model, loss = bench._host_model("deep")
        import fsdp2

        mp = fsdp2.MixedPrecisionPolicy(**VARIANTS[v])
        for block in model.layers:
            fsdp2.fully_shard(block, mp_policy=mp)
        fsdp2.fully_shard(model, mp_policy=mp)
        built[v] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss)
    queue.put(bench.median_step_ms(built, steps))
    dist.destroy_process_group()


def bench_host(steps: int, world: int = 8) -> None:
    med = in_fresh_process(_host_worker, world, steps)
    print(f"\n== quantized communication, host: deep model, one rank of {world} on the fake process group, {steps} steps")
    total = {v: med[v] for v in med if v != "local"}
    for v, ms in total.items():
        print(
            f"  {v:20s} step {ms:7.2f} ms (local {med['local']:.2f}, fsdp2 adds {ms - med['local']:6.2f}) "
            f"| x unquantized fsdp2 step: {ms / total['fp32']:.3f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=["wire", "host"], default=None)
    args = p.parse_args()
    if args.only != "host":
        bench_wire(args.steps, args.warmup)
    if args.only != "wire":
        bench_host(max(args.steps, 10))


if __name__ == "__main__":
    main()
