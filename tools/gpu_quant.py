"""Quantized communication on one device: kernel throughput and the step-time cost.

    python tools/gpu_quant.py            # CUDA (exits 0 saying so without one)
    python tools/gpu_quant.py --cpu      # the same on the CPU, small (the test suite's run)
    python tools/gpu_check.py --quant    # the same, from the GPU check

* throughput: ``fsdp2.bucket.quant`` quantize and dequantize of a float32 / bf16 row of 64M
  values (int8 and float8 e4m3, blocks of 128), in GB/s of the full-precision values.
* step cost: the GPU check's model (``tools/gpu_check.py``'s ``ARGS``) trained by fsdp2 on
  one device as one rank of 2 on the fake process group (collectives cost nothing, so
  the difference is the quantize / dequantize work), unquantized against ``int8`` and
  ``fp8`` gather + reduce, stepped alternately; median step times and their ratio
  (target: at most 1.05). On one real rank nothing is quantized: nothing travels.
"""

from __future__ import annotations

import argparse
import functools
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

from fsdp2.bucket.quant.spec import BlockQuantization, RowLayout  # noqa: E402


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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN alike."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def parity(device: torch.device) -> tuple[list[str], bool]:
    """The fused kernels against the torch-op reference, bit for bit: quantize (read back by
    the reference), dequantize rank-major and into regions, the rank-ordered sum."""
    from fsdp2.bucket.quant import blockwise, fused

    rows_out = ["| fused vs reference | quantize | dequantize | into regions | sum |", "| --- | --- | --- | --- | --- |"]
    probe = torch.empty(0, device=device)
    if not fused.usable(probe, BlockQuantization("int8")):
        return rows_out + ["| (no fused kernels on this device: nothing to compare) | - | - | - | - |"], True
    ok_all = True
    for kind in ("int8", "fp8"):
        for dtype in (torch.float32, torch.bfloat16):
            for sizes, block in (((300,), 128), ((5, 130, 0, 7, 256, 64), 64), ((4096, 1000, 3), 128)):
                spec = BlockQuantization(kind, block)
                rows = RowLayout.of(spec, sizes)
                n, world = rows.numel, 3
                g = torch.Generator().manual_seed(n)
                x = (torch.randn(world, n, generator=g) * torch.logspace(-20, 20, world)[:, None]).to(dtype).to(device)
                x[1, :5] = 0
                x[2, 3] = float("nan")
                table = fused.BlockTable.of(spec, rows, device)
                ref = torch.zeros(world, rows.nbytes, dtype=torch.uint8, device=device)
                blockwise.quantize_rows(x, spec, rows, ref)
                got = torch.zeros_like(ref)
                fused.quantize_rows(x, spec, rows, table, got)
                a, b = (torch.empty(world, n, device=device) for _ in range(2))
                blockwise.dequantize_into(ref, spec, rows, a)
                blockwise.dequantize_into(got, spec, rows, b)
                want = torch.empty(world, n, dtype=dtype, device=device)
                blockwise.dequantize_into(ref, spec, rows, want)
                flat = torch.empty(world * n, dtype=dtype, device=device)
                fused.dequantize_to(ref, spec, rows, table, flat, regions=False)
                ok2 = torch.equal(_bits(flat.view(world, n)), _bits(want))
                fused.dequantize_to(ref, spec, rows, table, flat, regions=True)
                ok3, off = True, 0
                for size in sizes:
                    region = flat[world * off : world * (off + size)].view(world, size)
                    ok3 = ok3 and torch.equal(_bits(region), _bits(want[:, off : off + size]))
                    off += size
                values = blockwise.dequantize_rows(ref, spec, rows)
                for row in values[1:]:
                    values[0].add_(row)
                want_sum = torch.empty(1, n, dtype=dtype, device=device)
                blockwise.unpack(values[:1], spec, rows, blockwise.segments_of(want_sum, rows))
                got_sum = torch.empty(n, dtype=dtype, device=device)
                fused.dequantize_sum(ref, spec, rows, table, got_sum)
                checks = [torch.equal(_bits(a), _bits(b)), ok2, ok3, torch.equal(_bits(got_sum), _bits(want_sum[0]))]
                ok_all = ok_all and all(checks)
                label = f"{kind} {str(dtype).removeprefix('torch.')} {sizes} / {block}"
                rows_out.append(f"| {label} | " + " | ".join("ok" if c else "MISMATCH" for c in checks) + " |")
    return rows_out, ok_all


def _paths(device: torch.device) -> list[str]:
    from fsdp2.bucket.quant import fused

    return ["reference", "fused"] if fused.usable(torch.empty(0, device=device), BlockQuantization("int8")) else ["reference"]


def _use(path: str) -> None:
    os.environ["FSDP2_QUANT_FUSED"] = "1" if path == "fused" else "0"


def throughput(device: torch.device, numel: int, repeat: int) -> list[str]:
    from fsdp2.bucket.quant.codec import BlockCodec

    rows = ["| kernel | path | dtype in | quantized | GB/s (full-precision bytes) |", "| --- | --- | --- | --- | ---: |"]
    for path in _paths(device):
        _use(path)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(1, numel, device=device).to(dtype)
            for kind in ("int8", "fp8"):
                spec = BlockQuantization(kind, 128)
                codec = BlockCodec(spec, RowLayout.of(spec, (numel,)))
                packed = torch.empty(1, codec.rows.nbytes, dtype=torch.uint8, device=device)
                out = torch.empty_like(x)
                q = _timed(functools.partial(codec.quantize, x, packed), device, repeat)
                d = _timed(functools.partial(codec.dequantize_blocks, packed, out), device, repeat)
                gb = numel * x.element_size() / 1e9
                name = str(dtype).removeprefix("torch.")
                rows.append(f"| quantize | {path} | {name} | {kind} | {gb / q:.1f} |")
                rows.append(f"| dequantize | {path} | {name} | {kind} | {gb / d:.1f} |")
    _use("fused")
    return rows


LARGE = {"vocab_size": 8192, "dim": 1024, "n_layers": 8, "n_heads": 8, "hidden_dim": 2816, "max_seq_len": 512}


def step_cost(device: torch.device, small: bool, steps: int, large: bool = False) -> list[str]:
    """Median step times of the variants, stepped alternately; each quantized one against
    its unquantized twin."""
    from gpu_check import ARGS, SMALL
    from model import ModelArgs, Transformer
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp2

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    args = SMALL if small else (ModelArgs(**LARGE) if large else ARGS)
    int8 = {"quantize_gather": "int8", "quantize_reduce": "int8"}
    bf16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    variants: dict[str, tuple[dict[str, Any], str, str]] = {"unquantized": ({}, "fused", "")}
    for path in _paths(device):
        variants[f"int8 gather+reduce, {path}"] = (int8, path, "unquantized")
        variants[f"fp8 gather+reduce, {path}"] = ({"quantize_gather": "fp8", "quantize_reduce": "fp8"}, path, "unquantized")
    variants["bf16"] = (bf16, "fused", "")
    variants[f"bf16 + int8 gather+reduce, {_paths(device)[-1]}"] = ({**bf16, **int8}, _paths(device)[-1], "bf16")
    built = {}
    mesh = init_device_mesh(device.type, (2,))
    for name, (kw, _, _) in variants.items():
        torch.manual_seed(0)
        with torch.device(device):
            model = Transformer(args)
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
            _use(variants[name][1])
            _sync(device)
            start = time.perf_counter()
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    _use("fused")
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    n_params = sum(p.numel() for p in Transformer(args).parameters()) if not large else None
    size = f"{n_params / 1e6:.1f}M" if n_params else "~117M"
    rows = [f"model {args.dim} wide x {args.n_layers} layers ({size} parameters), batch 4 x {args.max_seq_len}",
            "| variant | median step ms | x its unquantized twin |", "| --- | ---: | ---: |"]
    for name, ms in med.items():
        twin = variants[name][2]
        rows.append(f"| {name} | {ms:.2f} | {ms / med[twin]:.3f} |" if twin else f"| {name} | {ms:.2f} | - |")
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
    checked, ok = parity(device)
    print("\n".join(checked))
    print()
    print("\n".join(throughput(device, numel, 3 if args.cpu else 20)))
    print()
    print("\n".join(step_cost(device, args.cpu, 3 if args.cpu else args.steps)))
    if not args.cpu:
        print()
        print("\n".join(step_cost(device, False, args.steps, large=True)))
    dist.destroy_process_group()
    print("fused kernels agree with the reference bit for bit" if ok else "FUSED KERNELS DIFFER FROM THE REFERENCE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
