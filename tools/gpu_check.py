"""The GPU check: fsdp2 against torch's fully_shard on CUDA, one table.

    python tools/gpu_check.py                # every visible GPU: world 1, then world N over NCCL
    python tools/gpu_check.py --gloo-world 2 # 2 ranks sharing the GPUs over gloo (one GPU: NCCL cannot)
    python tools/gpu_check.py --cpu          # the same checks over gloo on the CPU (CI: --cpu --small)
    python tools/gpu_check.py --quant        # quantized communication: throughput, step cost (gpu_quant.py)

For each world size: a small Llama-style model (examples/model.py) trained for a few
steps by both libraries from the same weights on the same data, in float32 and with a
bf16 ``MixedPrecisionPolicy``, and with ``CPUOffloadPolicy``: the losses and final
parameters compared (parity), the float32 runs' parameters also against one unsharded
replica fed the global batch, the median step time and peak ``max_memory_allocated``
of each; at world >= 2 on CUDA, how much of fsdp2's all-gather kernel time overlaps
compute kernels (from a profiler trace). Prints one table; exits 1 if a parity check
fails, 0 otherwise. Without CUDA (and without ``--cpu``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import pickle
import queue
import socket
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]

from model import ModelArgs, Transformer  # noqa: E402

ARGS = ModelArgs(vocab_size=1024, dim=256, n_layers=4, n_heads=8, hidden_dim=688, max_seq_len=128)
STEPS, BATCH, SEQ = 6, 4, 128
SMALL = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=88, max_seq_len=16)  # --small
# (name, mixed precision, offload, loss tolerance (relative), parameter tolerance (absolute))
MODES = [
    ("fp32", False, False, 1e-5, 1e-5),
    ("bf16", True, False, 2e-2, 5e-3),
    ("fp32 + CPU offload", False, True, 1e-5, 1e-5),
]


def _build(lib: Any, device: torch.device, mixed: bool, offload: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ARGS)
    model.init_weights(0)
    if lib is not None:  # else the unsharded replica
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        kwargs: dict[str, Any] = {}
        if mixed:
            kwargs["mp_policy"] = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if offload:
            kwargs["offload_policy"] = lib.CPUOffloadPolicy()
        for layer in model.layers:
            lib.fully_shard(layer, mesh=mesh, **kwargs)
        lib.fully_shard(model, mesh=mesh, **kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _train(lib: Any, device: torch.device, mixed: bool, offload: bool, rank: int) -> dict[str, Any]:
    """One library's run: losses, final full parameters, step times, peak memory (above
    what was allocated before it: the last run's model may outlive it until a collection)."""
    gc.collect()
    base = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    model, opt = _build(lib, device, mixed, offload)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, times = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=gen).to(device)
        _sync(device)
        start = time.perf_counter()
        losses.append(_step(model, opt, tokens))
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    # Offloaded shards live on the CPU: gathered on the mesh's device.
    # (Over gloo from the host: torch 2.11's functional all-gather of CUDA tensors on gloo
    # crashed there.)
    where = torch.device("cpu") if dist.get_backend() == "gloo" else device
    params = {n: p.detach().to(where).full_tensor().float().cpu() for n, p in model.named_parameters()}
    overlap = _overlap(model, opt, device) if lib.__name__ == "fsdp2" else float("nan")
    return {"losses": losses, "params": params, "time": statistics.median(times[1:]) * 1e3, "peak": peak,
            "overlap": overlap}


def _warm_up(device: torch.device) -> None:
    """Matrix products in both dtypes, forward and backward, before any run: the first
    ones allocate cuBLAS's workspaces (tens of MiB, kept), which the first library's
    peak would otherwise count."""
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()


def _local(device: torch.device, world: int) -> dict[str, torch.Tensor]:
    """One unsharded replica fed every rank's batch at once (float32): final parameters."""
    model, opt = _build(None, device, False, False)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world)]
    for _ in range(STEPS):
        tokens = torch.cat([torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g) for g in gens])
        _step(model, opt, tokens.to(device))
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}


def _overlap(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> float:
    """Share of the all-gather kernels' time during which a compute kernel also ran
    (one profiled step; CUDA at world >= 2 only)."""
    if device.type != "cuda" or dist.get_world_size() < 2:
        return float("nan")
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(model, opt, tokens)
        _sync(device)
    gathers, compute = [], []
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        span = (e.time_range.start, e.time_range.end)
        name = e.name.lower()
        if "nccl" in name:
            if "allgather" in name.replace("_", ""):
                gathers.append(span)
        else:
            compute.append(span)
    total = sum(end - start for start, end in gathers)
    if not total:
        return float("nan")
    covered = 0
    for start, end in gathers:
        for cs, ce in compute:
            covered += max(0, min(end, ce) - max(start, cs))
    return min(1.0, covered / total)


def _compare(ours: dict[str, Any], theirs: dict[str, Any], loss_tol: float, param_tol: float) -> tuple[bool, float, float]:
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], theirs["losses"]))
    param_err = _param_err(ours["params"], theirs["params"])
    ok = loss_err <= loss_tol and param_err <= param_tol  # NaN compares False: a failure
    return ok, loss_err, param_err


def _worker(rank: int, world: int, port: int, use_cuda: bool, small: bool, gloo: bool, hang_s: int,
            results: Any) -> None:
    global ARGS, STEPS, SEQ
    faulthandler.enable()  # a crash prints the stack
    faulthandler.dump_traceback_later(hang_s, exit=True)  # a hung rank prints its stacks and exits
    if small:
        ARGS, STEPS, SEQ = SMALL, 3, SMALL.max_seq_len
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        if use_cuda:
            index = rank % torch.cuda.device_count()  # --gloo-world: ranks may share a GPU
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        else:
            torch.set_num_threads(1)
            device = torch.device("cpu")
        dist.init_process_group("nccl" if use_cuda and not gloo else "gloo", rank=rank, world_size=world)
        import torch.distributed.fsdp as torch_fsdp

        import fsdp2

        _warm_up(device)
        rows = []
        for name, mixed, offload, loss_tol, param_tol in MODES:
            # Over gloo on CUDA fsdp2 runs alone (against the local replica): a crash inside
            # torch there (2.11's functional all-gather of CUDA tensors over gloo segfaulted)
            # would lose the whole world.
            libs = (("fsdp2", fsdp2),) if gloo and use_cuda else (("fsdp2", fsdp2), ("torch", torch_fsdp))
            runs: dict[str, Any] = {"torch": "not run over gloo on CUDA"}
            for label, lib in libs:
                try:
                    runs[label] = _train(lib, device, mixed, offload, rank)
                except Exception as e:  # noqa: BLE001 - one row reports it
                    runs[label] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:90]}"
            if not mixed and rank == 0:
                runs["local"] = _local(device, world)
            rows.append((name, loss_tol, param_tol, runs))
        # Pickled here: tensors put on the queue as they are would travel as shared
        # memory that vanishes when this process exits.
        results.put((rank, pickle.dumps(rows)))
    except BaseException:  # noqa: BLE001
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world: int, use_cuda: bool, small: bool, gloo: bool = False, hang_s: int = 300) -> list[tuple]:
    # Without CUDA in this process the ranks fork from it (torch and fsdp2 imported once,
    # not once per rank: most of a --cpu --small run); with CUDA, fresh interpreters.
    ctx = mp.get_context("spawn" if torch.cuda.is_available() else "fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, use_cuda, small, gloo, hang_s, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + hang_s + 30
    while len(out) < world:
        try:
            rank, value = results.get(timeout=1)
            out[rank] = value
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"rank {dead[0][0]} died (exit code {dead[0][1]})" if dead else f"no result in {hang_s} s"
                raise RuntimeError(f"{why}; the ranks' stacks, if any, are above") from None
    for p in procs:
        p.join()
    for value in out.values():
        if isinstance(value, str):
            raise RuntimeError(value)
    return pickle.loads(out[0])


def _param_err(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((ours[n] - v).abs().max().item() for n, v in ref.items())


def _row(world: int, name: str, loss_tol: float, param_tol: float, runs: dict[str, Any]) -> str:
    """Print one row; its verdict: "ok", "FAIL" (a NaN error fails: it compares False) or
    "unchecked" (neither torch's run nor a local replica to compare against)."""
    ours, theirs, local = runs["fsdp2"], runs["torch"], runs.get("local")
    label = f"| {world} | {name:19s} |"
    if isinstance(ours, str):
        known = "NotImplementedError" in ours  # a known gap, reported, not a wrong result
        note = "  (not implemented in fsdp2 yet)" if known else ""
        print(f"{label} {'ok' if known else 'FAIL'} | fsdp2: {ours}{note} | torch: {theirs if isinstance(theirs, str) else 'ok'} |")
        return "ok" if known else "FAIL"
    checks, errors = [], []
    if isinstance(theirs, str):
        errors.append(f"torch: {theirs}")
    else:
        ok, loss_err, param_err = _compare(ours, theirs, loss_tol, param_tol)
        checks.append(ok)
        errors.append(f"vs torch: loss rel {loss_err:.1e}, params {param_err:.1e}")
    if local is not None:
        err = _param_err(ours["params"], local)
        checks.append(err <= param_tol)
        errors.append(f"vs local: params {err:.1e}")
    verdict = ("ok" if all(checks) else "FAIL") if checks else "unchecked"
    time = f"{ours['time']:7.1f}" + ("" if isinstance(theirs, str) else
                                     f" / {theirs['time']:7.1f} ms ({ours['time'] / theirs['time']:.2f}x)")
    peak = f"{ours['peak']:8.1f}" + ("" if isinstance(theirs, str) else f" / {theirs['peak']:8.1f} MiB")
    print(f"{label} {verdict} | {'; '.join(errors)} | {time} | {peak} | overlap {ours['overlap']:.2f} |")
    return verdict


def _table(world: int, rows: list[tuple]) -> list[str]:
    return [_row(world, *row) for row in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the checks over gloo on the CPU (worlds 1 and 2)")
    p.add_argument("--small", action="store_true", help="a tiny model, 3 steps (the test suite's run)")
    p.add_argument("--gloo-world", type=int, default=0, metavar="N",
                   help="instead: N ranks sharing the visible GPUs over gloo (multi-rank CUDA streams on one GPU)")
    p.add_argument("--hang-seconds", type=int, default=300,
                   help="a rank still running after this prints its threads' stacks and exits")
    p.add_argument("--quant", action="store_true",
                   help="instead: quantized communication's kernel throughput and step cost (tools/gpu_quant.py)")
    args = p.parse_args()
    if args.quant:  # its own process: it starts the fake process group, which it builds on this file's models
        import subprocess

        script = os.path.join(ROOT, "tools", "gpu_quant.py")
        return subprocess.run([sys.executable, script, *(["--cpu"] if args.cpu else [])], check=False).returncode
    use_cuda = torch.cuda.is_available() and not args.cpu
    if not use_cuda and not args.cpu:
        print("gpu_check: no CUDA device here; nothing to check (run with --cpu to exercise the checks over gloo)")
        return 0
    worlds = [1] + ([torch.cuda.device_count()] if use_cuda and torch.cuda.device_count() > 1 else [])
    if args.cpu:
        worlds = [1, 2]
    gloo = args.gloo_world > 0
    if gloo:
        worlds = [args.gloo_world]
    device = torch.cuda.get_device_name(0) if use_cuda else "CPU (gloo)"
    if use_cuda and gloo:
        device += f" x {torch.cuda.device_count()}, ranks over gloo"
    print(f"gpu_check on {device}, torch {torch.__version__}; fsdp2 / torch per row")
    print("| world | mode | parity | errors | step time fsdp2 / torch | peak memory fsdp2 / torch | all-gather overlap |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    verdicts: list[str] = []
    for world in worlds:
        verdicts += _table(world, _run_world(world, use_cuda, args.small, gloo, args.hang_seconds))
    ok = "FAIL" not in verdicts
    unchecked = verdicts.count("unchecked")
    print(("all parity checks passed" if ok else "PARITY FAILURE")
          + (f" ({unchecked} row(s) unchecked: nothing to compare against)" if unchecked else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
