"""fsdp2 vs torch's fully_shard, side by side in one invocation.

    python tools/bench.py                 # all three models
    python tools/bench.py --model deep    # one of: deep, wide, big, local

* deep / wide (world 2): both implementations are built in the same processes from the
  same weights and stepped alternately (A/B/B/A...), so machine noise hits both alike.
  Prints the median step time (forward + backward + AdamW), collectives and bytes per
  step, and fsdp2/torch ratios.
* big (~100M parameters, world 4): peak memory per rank (max over ranks) above the
  process baseline, each implementation in its own processes (a process' peak RSS cannot
  be split between two models), built on the meta device so no full copy inflates it.
* local (world 1): fsdp2 against plain local training of the same model.
* optim (world 4 for Muon, 2 for clipping): ``fsdp2.optim.Muon`` on an fsdp2 model
  against ``torch.optim.Muon`` on torch's (4 blocks of a 256x512 and a 512x256 matrix):
  median optimizer step, Newton-Schulz FLOPs per rank, collectives per step; and
  ``fsdp2.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on the deep
  model (1-D, where torch's works): median time of one call.
* host (one rank on the fake process group, where collectives cost nothing): the time
  each library adds to the plain local step, for the deep model at 8 and 64 ranks and a
  4-block model of 32 experts each at 8 ranks, and 4 blocks of width 1024 at 1,024 ranks
  (every dim divides evenly; the accelerator path's host overhead).
* moe (gloo at 4 ranks with ep 2, the fake process group at 64 with ep 8): a
  Mixture-of-Experts with expert parallel and per-parameter meshes, step time,
  collectives, peak memory and host time against torch's (``tools/bench_moe.py``).
* quant: quantized all-gather / reduce (``MixedPrecisionPolicy(quantize_gather=...)``)
  against fsdp2 in float32 and bf16: bytes per step, step time at 4 gloo ranks, host time
  on the fake process group (``tools/bench_quant.py``).
* estimate: ``python -m fsdp2.estimate`` of rank 0 at world size 4 against a real 4-rank
  gloo run of the example (``--measure``): its tracked live-tensor peak and its peak RSS
  above the process's baseline (the real run takes gloo's own strategies, the estimate
  the accelerator's, so the two differ by what those strategies save).

Collectives are counted by wrapping the ``torch.distributed`` functions both libraries
call; bytes are the logical payload: all-gather output, reduce-scatter input (fsdp2 on
gloo reduces with an all-reduce of the same buffer, which moves about twice the bytes
on the wire: see tools/bench_collectives.py for why).
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples"), os.path.join(ROOT, "tools")]

from _comm import CommCounter  # noqa: E402
from _dist import run_ranks  # noqa: E402
from alternate import Alternated, alternate, in_fresh_process, median_ms  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

MODELS = {
    "deep": dict(args=ModelArgs(vocab_size=256, dim=64, n_layers=32, n_heads=4, hidden_dim=172, max_seq_len=32), batch=2, seq=32, world=2),
    "wide": dict(args=ModelArgs(vocab_size=1024, dim=512, n_layers=4, n_heads=8, hidden_dim=1376, max_seq_len=64), batch=2, seq=64, world=2),
    "big": dict(args=ModelArgs(vocab_size=8192, dim=768, n_layers=12, n_heads=12, hidden_dim=2048, max_seq_len=64), batch=1, seq=64, world=4),
    "local": dict(args=ModelArgs(vocab_size=256, dim=64, n_layers=8, n_heads=4, hidden_dim=172, max_seq_len=32), batch=4, seq=32, world=1),
}
FOREACH = os.environ.get("BENCH_FOREACH", "0") == "1"


def build(lib_name: str, spec: dict, meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with torch.device("meta" if meta else "cpu"):
        model = Transformer(spec["args"])
    if lib_name != "local":
        if lib_name == "fsdp2":
            import fsdp2 as lib
        else:
            import torch.distributed.fsdp as lib  # type: ignore[no-redef]
        for layer in model.layers:
            lib.fully_shard(layer)
        lib.fully_shard(model)
    if meta:
        model.to_empty(device="cpu")
    model.init_weights(0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=FOREACH or None)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def tokens_of(spec: dict, gen: torch.Generator) -> Callable[[], torch.Tensor]:
    """A batch of random token ids for ``spec``'s model, drawn from ``gen``."""
    return lambda: torch.randint(0, spec["args"].vocab_size, (spec["batch"], spec["seq"] + 1), generator=gen)


def _speed_worker(rank: int, world: int, name: str, libs: list[str], steps: int, warmup: int) -> Alternated:
    spec = MODELS[name]
    torch.manual_seed(0)
    built = {lib: build(lib, spec) for lib in libs}
    gen = torch.Generator().manual_seed(rank)
    return alternate(built, lambda b, tokens: step(*b, tokens), tokens_of(spec, gen), steps, warmup, count=True)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _memory_worker(rank: int, world: int, name: str, lib: str, steps: int) -> float:
    spec = MODELS[name]
    base = _rss_mb()
    model, opt = build(lib, spec, meta=True)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        step(model, opt, torch.randint(0, spec["args"].vocab_size, (spec["batch"], spec["seq"] + 1), generator=gen))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base


def bench_speed(name: str, steps: int, warmup: int) -> None:
    spec = MODELS[name]
    libs = ["local", "fsdp2"] if name == "local" else ["torch", "fsdp2"]
    results = run_ranks(_speed_worker, spec["world"], name, libs, steps, warmup, timeout=1800)
    n_params = sum(p.numel() for p in Transformer(spec["args"]).parameters())
    print(f"\n== {name}: {n_params / 1e6:.2f}M params, {spec['args'].n_layers} blocks of width {spec['args'].dim}, world {spec['world']}, {steps} steps")
    med = median_ms({lib: [t for r in results for t in r.times[lib]] for lib in libs})
    base = libs[0]
    for lib in libs:
        calls, nbytes = results[0].comms[lib]
        comm = ", ".join(f"{k} {calls[k]} calls {nbytes[k] / 2**20:.2f} MiB" for k in sorted(calls)) or "none"
        print(f"  {lib:6s} median step {med[lib]:8.2f} ms | per step: {comm}")
    ratio = med["fsdp2"] / med[base]
    print(f"  ratio fsdp2/{base} step time: {ratio:.3f}")
    same = all(abs(a - b) < 1e-4 for r in results for a, b in zip(r.losses[base], r.losses["fsdp2"]))
    print(f"  losses agree with {base}: {same}")


def bench_memory(name: str, steps: int) -> None:
    spec = MODELS[name]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # fixed threshold: RSS follows live tensors
    peaks = {}
    for lib in ("torch", "fsdp2"):
        peaks[lib] = max(run_ranks(_memory_worker, spec["world"], name, lib, steps, timeout=1800, fresh=True))
    n_params = sum(p.numel() for p in Transformer(copy.deepcopy(spec["args"])).parameters())
    print(f"\n== {name}: {n_params / 1e6:.1f}M params, world {spec['world']}, AdamW, {steps} steps")
    for lib, mb in peaks.items():
        print(f"  {lib:6s} peak memory above baseline (max over ranks): {mb:8.1f} MiB")
    print(f"  ratio fsdp2/torch peak memory: {peaks['fsdp2'] / peaks['torch']:.3f}")


class _MuonNet(torch.nn.Module):
    """The issue's model: 4 blocks of a 256x512 and a 512x256 matrix, a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False), torch.nn.ReLU(), torch.nn.Linear(512, 256, bias=False))
            for _ in range(4)
        )
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def _muon_worker(rank: int, world: int, steps: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp
    from torch.utils.flop_counter import FlopCounterMode

    import fsdp2

    built = {}
    for lib_name, lib, muon_cls in (("torch", torch_fsdp, torch.optim.Muon), ("fsdp2", fsdp2, fsdp2.optim.Muon)):
        torch.manual_seed(0)
        model = _MuonNet()
        for block in model.blocks:
            lib.fully_shard(block)
        lib.fully_shard(model)
        matrices = [p for p in model.parameters() if p.dim() == 2]
        built[lib_name] = (model, muon_cls(matrices, lr=0.02))
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {lib: [] for lib in built}
    flops, comms = {}, {}
    for i in range(steps + 1):
        x = torch.randn(8, 256, generator=gen)
        for lib in (list(built) if i % 2 == 0 else list(built)[::-1]):
            model, opt = built[lib]
            model(x).square().mean().backward()
            dist.barrier()
            start = time.perf_counter()
            if i == 0:  # warm-up step, counted
                with FlopCounterMode(display=False) as fc, CommCounter().active() as counter:
                    opt.step()
                flops[lib], comms[lib] = fc.get_total_flops(), sum(counter.calls.values())
            else:
                opt.step()
                times[lib].append(time.perf_counter() - start)
            opt.zero_grad()
    return {"times": times, "flops": flops, "comms": comms}


def _clip_worker(rank: int, world: int, steps: int) -> dict:
    import fsdp2

    spec = MODELS["deep"]
    fns = {"torch": torch.nn.utils.clip_grad_norm_, "fsdp2": fsdp2.clip_grad_norm_}
    built = {}
    for lib in fns:
        torch.manual_seed(0)
        model, _ = build(lib, spec)
        tokens = torch.randint(0, spec["args"].vocab_size, (spec["batch"], spec["seq"] + 1), generator=torch.Generator().manual_seed(rank))
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        built[lib] = (fns[lib], model)

    def clip(entry: tuple[Callable, torch.nn.Module], _: None) -> float:
        fn, model = entry
        norm = fn(model.parameters(), 1e9)  # max_norm above the norm: nothing changes
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    run = alternate(built, clip, lambda: None, steps, 2)
    return {"times": run.times, "norms": {lib: losses[-1] for lib, losses in run.losses.items()}}


def bench_optim(steps: int) -> None:
    res = run_ranks(_muon_worker, 4, steps, timeout=1800)
    med = {lib: statistics.median(t for r in res for t in r["times"][lib]) * 1e3 for lib in ("torch", "fsdp2")}
    print(f"\n== optim: Muon on 4 blocks of 256x512 + 512x256 (world 4), {steps} steps")
    for lib in ("torch", "fsdp2"):
        gflop = max(r["flops"][lib] for r in res) / 1e9
        print(f"  {lib:6s} median Muon step {med[lib]:8.2f} ms | {gflop:.2f} GFLOP per rank | {res[0]['comms'][lib]} c10d collectives")
    print(f"  ratio fsdp2/torch Muon step time: {med['fsdp2'] / med['torch']:.3f}")
    res = run_ranks(_clip_worker, 2, steps, timeout=1800)
    med = {lib: statistics.median(t for r in res for t in r["times"][lib]) * 1e3 for lib in ("torch", "fsdp2")}
    print(f"== optim: clip_grad_norm_ on deep (world 2), {steps} calls")
    for lib in ("torch", "fsdp2"):
        print(f"  {lib:6s} median clip_grad_norm_ {med[lib]:8.3f} ms | norm {res[0]['norms'][lib]:.6f}")
    print(f"  ratio fsdp2/torch clip_grad_norm_ time: {med['fsdp2'] / med['torch']:.3f}")


class _MoEBlock(torch.nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(e(x) for e in self.experts) / len(self.experts)


class _MoE(torch.nn.Module):
    """Many parameters per group: 4 blocks of 32 small experts (all run: host work, not
    routing, is what this measures)."""

    def __init__(self, blocks: int = 4, experts: int = 32, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_MoEBlock(experts, dim, hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


HOST = {  # fake process group: one rank of a job of ``world`` ranks, collectives free
    "deep@8": ("deep", 8), "deep@64": ("deep", 64), "moe@8": ("moe", 8),
    "even@1024": ("even", 1024),  # every dim divides by 1024: no padding to copy
}
# 4 blocks of width 1024 (hidden 2048, vocab 1024), one sequence of 16 tokens.
EVEN = ModelArgs(vocab_size=1024, dim=1024, n_layers=4, n_heads=8, hidden_dim=2048, max_seq_len=16)


def _host_model(kind: str) -> tuple[torch.nn.Module, Any]:
    if kind in ("deep", "even"):
        spec = MODELS["deep"] if kind == "deep" else dict(args=EVEN, batch=1, seq=16)
        model = Transformer(spec["args"])
        model.init_weights(0)
        tokens = torch.randint(0, spec["args"].vocab_size, (spec["batch"], spec["seq"] + 1))

        def loss(m: torch.nn.Module) -> torch.Tensor:
            return F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

        return model, loss
    model = _MoE()
    x = torch.randn(16, 64)
    return model, lambda m: m(x).square().mean()


def _host_worker(kind: str, world: int, steps: int, queue: Any) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # gathered buffers hold whatever memory held: keep compute speed fair
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    import torch.distributed.fsdp as torch_fsdp

    import fsdp2

    built = {}
    for lib_name, lib in (("local", None), ("torch", torch_fsdp), ("fsdp2", fsdp2)):
        torch.manual_seed(0)
        model, loss = _host_model(kind)
        if lib is not None:
            for block in model.layers:
                lib.fully_shard(block)
            lib.fully_shard(model)
        built[lib_name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss)
    queue.put(median_step_ms(built, steps))
    dist.destroy_process_group()


def median_step_ms(built: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, Any]], steps: int) -> dict[str, float]:
    """Each entry's median step (loss, backward, optimizer step) in ms: ``steps`` after 2
    warm-up ones, the entries stepped alternately."""

    def loss_step(entry: tuple[torch.nn.Module, torch.optim.Optimizer, Any], _: None) -> None:
        model, opt, loss = entry
        loss(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return median_ms(alternate(built, loss_step, lambda: None, steps, 2).times)


def bench_host(steps: int) -> None:
    """fsdp2's and torch's time added to the plain local step, on the fake process group
    (collectives free: what remains is compute and each library's host work)."""
    print(f"\n== host overhead: one rank on the fake process group, {steps} steps, AdamW")
    for label, (kind, world) in HOST.items():
        med = in_fresh_process(_host_worker, kind, world, steps)
        added = {lib: med[lib] - med["local"] for lib in ("torch", "fsdp2")}
        print(
            f"  {label:8s} local {med['local']:7.2f} ms | torch +{added['torch']:7.2f} ms | fsdp2 +{added['fsdp2']:7.2f} ms"
            f" | ratio fsdp2/torch added time: {added['fsdp2'] / added['torch']:.3f}"
        )


ESTIMATE_ARGS = ["--dim", "512", "--layers", "8", "--heads", "8", "--vocab", "8192", "--seq-len", "256",
                 "--batch-size", "4", "--meta-init", "--steps", "3"]


def bench_estimate() -> None:
    """``python -m fsdp2.estimate`` at world size 4 against a real 4-rank gloo run of the
    same script: rank 0's tracked live-tensor peak, and its peak RSS above what the
    process held before the script (large blocks mmapped, so RSS follows live memory)."""
    import json
    import subprocess

    script = os.path.join(ROOT, "examples", "train.py")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    est_cmd = [sys.executable, "-m", "fsdp2.estimate", "--nproc-per-node", "4", "--json", "--", script, *ESTIMATE_ARGS]
    real_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                "-m", "fsdp2.estimate", "--measure", "--json", "--", script, *ESTIMATE_ARGS]
    out = {}
    for label, cmd in (("estimate", est_cmd), ("real", real_cmd)):
        done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              cwd=ROOT, env=env)
        out[label] = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
    est, real = out["estimate"]["peak"]["peak"], out["real"]["peak"]["peak"]
    rss = out["real"]["rss"]["peak"] - out["real"]["rss"]["baseline"]
    print(f"\n== memory estimate: examples/train.py {' '.join(ESTIMATE_ARGS)}, rank 0 of 4")
    print(f"  estimate (fake PG) {est / 2**20:8.1f} MiB | real gloo run: tracked {real / 2**20:8.1f} MiB"
          f" (estimate/tracked {est / real:.3f}), peak RSS above baseline {rss / 2**20:8.1f} MiB"
          f" (estimate/RSS {est / rss:.3f})")


def bench_moe(steps: int, warmup: int) -> None:
    import bench_moe as moe

    moe.bench_speed(steps, warmup)
    moe.bench_memory()
    moe.bench_host(steps)


def bench_quant(steps: int, warmup: int) -> None:
    """``tools/bench_quant.py`` (which builds on this file's models), in a process of its own."""
    import subprocess

    script = os.path.join(ROOT, "tools", "bench_quant.py")
    subprocess.run([sys.executable, script, "--steps", str(steps), "--warmup", str(warmup)], check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["deep", "wide", "big", "local", "optim", "host", "moe", "estimate", "quant", "all"],
                   default="all")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    names = ["deep", "wide", "local", "big", "optim", "host", "moe", "estimate"] if args.model == "all" else [args.model]
    for name in names:
        if name == "moe":
            bench_moe(args.steps, args.warmup)
        elif name == "quant":
            bench_quant(args.steps, args.warmup)
        elif name == "estimate":
            bench_estimate()
        elif name == "host":
            bench_host(args.steps)
        elif name == "optim":
            bench_optim(args.steps)
        elif name == "big":
            bench_memory(name, steps=3)
        else:
            bench_speed(name, args.steps, args.warmup)


if __name__ == "__main__":
    main()
