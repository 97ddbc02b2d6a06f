"""Quantized communication on one device: kernel throughput and the step-time cost.

    python tools/gpu_quant.py            # CUDA (exits 0 saying so without one)
    python tools/gpu_quant.py --cpu      # the same on the CPU, small (the test suite's run)
    python tools/gpu_check.py --quant    # the same, from the GPU check

* throughput: ``fsdp2.quant`` quantize and dequantize of a float32 / bf16 row of 64M
  values (int8 and float8 e4m3, blocks of 128), in GB/s of the full-precision values.
* step cost: the GPU check's model (``tools/gpu_check.py``'s ``ARGS``) trained by fsdp2 on
  one device as one rank of 2 on the fake process group (collectives cost nothing, so
  the difference is the quantize / dequantize work), unquantized against ``int8`` and
  ``fp8`` gather + reduce, stepped alternately; median step times and their ratio
  (target: at most 1.05). On one real rank nothing is quantized: nothing travels.
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
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.join(ROOT, "tools")]

from fsdp2.quant.blockwise import dequantize_into, quantize_rows  # noqa: E402
from fsdp2.quant.spec import BlockQuantization, RowLayout  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, device: torch.device, repeat: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(device: torch.device, numel: int, repeat: int) -> list[str]:
    rows = ["| kernel | dtype in | quantized | GB/s (full-precision bytes) |", "| --- | --- | --- | ---: |"]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, numel, device=device).to(dtype)
        for kind in ("int8", "fp8"):
            spec = BlockQuantization(kind, 128)
            layout = RowLayout.of(spec, (numel,))
            packed = torch.empty(1, layout.nbytes, dtype=torch.uint8, device=device)
            out = torch.empty_like(x)
            q = _timed(lambda: quantize_rows(x, spec, layout, packed), device, repeat)
            d = _timed(lambda: dequantize_into(packed, spec, layout, out), device, repeat)
            gb = numel * x.element_size() / 1e9
            rows.append(f"| quantize | {dtype} | {kind} | {gb / q:.1f} |")
            rows.append(f"| dequantize | {dtype} | {kind} | {gb / d:.1f} |")
    return rows


def step_cost(device: torch.device, small: bool, steps: int) -> list[str]:
    import fsdp2
    from gpu_check import ARGS, SMALL
    from model import Transformer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    args = SMALL if small else ARGS
    variants = {
        "unquantized": {},
        "int8 gather+reduce": {"quantize_gather": "int8", "quantize_reduce": "int8"},
        "fp8 gather+reduce": {"quantize_gather": "fp8", "quantize_reduce": "fp8"},
        "bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
        "bf16 + int8 gather+reduce": {
            "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "quantize_gather": "int8", "quantize_reduce": "int8"
        },
    }
    built = {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(args)
        mesh = init_device_mesh(device.type, (2,))
        mp = fsdp2.MixedPrecisionPolicy(**kw)
        for layer in model.layers:
            fsdp2.fully_shard(layer, mesh=mesh, mp_policy=mp)
        fsdp2.fully_shard(model, mesh=mesh, mp_policy=mp)
        built[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len + 1), device=device)
    times: dict[str, list[float]] = {n: [] for n in built}
    for i in range(steps + 2):
        for name in list(built) if i % 2 == 0 else list(built)[::-1]:
            model, opt = built[name]
            _sync(device)
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    rows = ["| variant | median step ms | x its unquantized step |", "| --- | ---: | ---: |"]
    for name, ms in med.items():
        base = med["bf16"] if name.startswith("bf16") else med["unquantized"]
        rows.append(f"| {name} | {ms:.2f} | {ms / base:.3f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run on the CPU, small sizes")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_quant: no CUDA device here; nothing measured (pass --cpu to run on the CPU)")
        return 0
    device = torch.device("cpu" if args.cpu else "cuda")
    numel = (1 << 16) if args.cpu else (64 << 20)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'CPU'}")
    print("\n".join(throughput(device, numel, 3 if args.cpu else 20)))
    print()
    print("\n".join(step_cost(device, args.cpu, 3 if args.cpu else args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
