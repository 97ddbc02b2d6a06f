"""How fast a backward's gradients land in the reduce-scatter input, per way of writing them.

    python tools/bench_deposit.py [--world 8] [--dim 4096] [--device cuda]

A Llama block's gradients (attention, MLP, two norms) cut into ``world`` rank-major
chunks, as fsdp2's reduce input lays them out: ``torch._chunk_cat`` into the input's
gradient columns (what fsdp2 does; not dense when the input has columns after them:
scalars and flags), ``torch._chunk_cat`` into a dense tensor of exactly those columns,
one copy per parameter (what fsdp2 did before) and a zero-padded copy per parameter. Prints the median time of each (CUDA events on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _shapes(dim: int) -> list[tuple[int, ...]]:
    hidden = int(8 * dim / 3 + 255) // 256 * 256
    return [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim), (dim,), (dim,)]


def _time(fn, device: torch.device, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device, dtype, world = torch.device(args.device), getattr(torch, args.dtype), args.world
    grads = [torch.randn(s, device=device, dtype=dtype) for s in _shapes(args.dim)]
    # Each parameter's shard: ceil(rows / world) rows, the columns of a row.
    widths = [-(-g.shape[0] // world) * (g.numel() // g.shape[0]) for g in grads]
    numel = sum(widths)
    buf = torch.zeros(world, numel + 3, device=device, dtype=dtype)  # + scalars and flags
    dense = torch.zeros(world, numel, device=device, dtype=dtype)
    offsets = [sum(widths[:i]) for i in range(len(widths))]

    def per_param() -> None:  # fsdp2 before _chunk_cat (``ShardLayout.write_blocks``)
        for g, off, width in zip(grads, offsets, widths):
            flat, region = g.reshape(-1), buf[:, off : off + width]
            full, rest = divmod(flat.numel(), width)
            region[:full].copy_(flat[: full * width].view(full, width))
            if rest:  # padding is left as it is (the reduce's result zeroes it)
                region[full, :rest].copy_(flat[full * width :])

    def padded_per_param() -> None:
        for g, off, width in zip(grads, offsets, widths):
            rows = -(-g.shape[0] // world)
            padded = g.new_zeros(rows * world, *g.shape[1:])
            padded[: g.shape[0]].copy_(g)
            buf[:, off : off + width].copy_(padded.view(world, width))

    ways = {
        "_chunk_cat into the input's columns (fsdp2)": lambda: torch._chunk_cat(grads, 0, world, out=buf[:, :numel]),
        "_chunk_cat into a dense tensor": lambda: torch._chunk_cat(grads, 0, world, out=dense),
        "one copy per parameter (fsdp2 before)": per_param,
        "per parameter: zero-pad, then copy": padded_per_param,
    }
    expected = torch._chunk_cat(grads, 0, world)
    moved = sum(g.numel() for g in grads) * grads[0].element_size()
    print(f"deposit of {moved / 2**20:.0f} MiB of gradients, world {world}, {args.dtype}, {device}")
    for name, fn in ways.items():
        buf.zero_()
        dense.zero_()
        fn()
        wrote = dense if "dense" in name else buf[:, :numel]
        t = _time(fn, device)
        verdict = "" if torch.equal(wrote, expected) else "  WRONG LAYOUT"
        print(f"  {name:45s} {t * 1e3:8.3f} ms  {2 * moved / t / 1e9:7.1f} GB/s{verdict}")


if __name__ == "__main__":
    main()
