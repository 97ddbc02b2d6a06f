"""Which formulation of fsdp2's collectives is fastest on this machine's backend?

    python tools/bench_collectives.py [--world 2] [--backend gloo]

For a range of per-rank sizes, times (median of repeated calls, ranks synchronized
before each) the all-gather as ``all_gather_single`` and as the list ``all_gather``,
each followed by the copy-out into a parameter-major buffer, and as fsdp2's in-place
gather (fill with -0.0, copy this rank's rows in, ``all_reduce``: no copy-out, and none
of the output-sized temporary gloo's all-gather allocates); and the gradient reduction
as ``reduce_scatter_single``, as an in-place ``all_reduce`` of the same buffer (what
fsdp2 uses for buckets reduced in place), and as ``all_to_all_single`` followed by a
local sum of the received rows (what fsdp2 uses for pooled reduces on gloo).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _dist import run_ranks  # noqa: E402

SIZES = [1_000, 10_000, 100_000, 1_000_000, 3_000_000]


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def _worker(rank: int, world: int, repeats: int) -> dict:
    out = {}
    for n in SIZES:
        shard, gathered, full = torch.ones(n), torch.empty(world * n), torch.ones(world * n)
        unsharded = torch.empty(world * n)
        received = torch.empty(world, n)
        pieces = list(gathered.chunk(world))

        def gather_then_copy(gather) -> None:  # noqa: ANN001
            gather()
            unsharded.copy_(gathered)

        def all_to_all_then_sum() -> None:
            dist.all_to_all_single(received, full.view(world, n))
            torch.add(received[0], received[1], out=shard)
            for row in received[2:]:
                shard.add_(row)

        def gather_in_place() -> None:
            unsharded.fill_(-0.0)
            unsharded[rank * n : (rank + 1) * n].copy_(shard)
            dist.all_reduce(unsharded)

        out[n] = {
            "all_gather_single+copy": _time(
                lambda: gather_then_copy(lambda: dist.all_gather_single(gathered, shard)), repeats
            ),
            "all_gather (list)+copy": _time(lambda: gather_then_copy(lambda: dist.all_gather(pieces, shard)), repeats),
            "in-place all_reduce gather": _time(gather_in_place, repeats),
            "reduce_scatter_single": _time(lambda: dist.reduce_scatter_single(shard, full), repeats),
            "all_reduce (W*n)": _time(lambda: dist.all_reduce(full), repeats),
            "all_to_all+sum": _time(all_to_all_then_sum, repeats),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    result = run_ranks(_worker, args.world, args.repeats)[0]
    print(f"gloo, world {args.world}: median ms per call (per-rank elements)")
    for n, row in result.items():
        cells = "  ".join(f"{k} {v:7.3f}" for k, v in row.items())
        print(f"  {n:>9,d}: {cells}")
        print(f"             reduce_scatter / all_reduce: {row['reduce_scatter_single'] / row['all_reduce (W*n)']:.2f}")
        print(f"             all_to_all+sum / all_reduce: {row['all_to_all+sum'] / row['all_reduce (W*n)']:.2f}")
        ratio = row["in-place all_reduce gather"] / row["all_gather_single+copy"]
        print(f"             in-place gather / all_gather_single+copy: {ratio:.2f}")


if __name__ == "__main__":
    main()
