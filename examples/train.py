"""Train a small Llama-style transformer with fsdp2.

    torchrun --standalone --nproc-per-node 2 examples/train.py

CPU + gloo by default; GPUs + NCCL when CUDA is available (one GPU per rank).
Each block is its own fsdp2 group, plus the root (embeddings, final norm, output).
``--impl torch`` runs the same script on torch's fully_shard, for comparison.

Checkpointing: ``--ckpt-dir DIR --save-every N`` saves model, optimizer, step and RNG
with torch.distributed.checkpoint into ``DIR/step-NNNNNN`` (written to a temporary
directory first and renamed into place, so an interrupted save never damages the latest
good checkpoint) and resumes from the latest one on start. Under
``torchrun --max-restarts=1`` a killed rank restarts the job, which resumes and ends
with the same parameters as an uninterrupted run. ``FSDP2_EXAMPLE_FAIL_AT=K`` makes rank
1 exit at step K once (to try that).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import resource
import shutil
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from model import ModelArgs, Transformer  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 reduce (MixedPrecisionPolicy)")
    p.add_argument("--meta-init", action="store_true", help="build on the meta device, shard, then materialize")
    p.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here and resume from the latest")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (needs --ckpt-dir)")
    p.add_argument("--final-params", default=None, help="rank 0 saves the full final parameters here (torch.save)")
    args = p.parse_args()
    if args.save_every and not args.ckpt_dir:
        p.error("--save-every needs --ckpt-dir")
    return args


def checkpoint_state(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank = dist.get_rank()
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim),
        "progress": {"step": step},  # the data position: batches are a function of the step
        f"rng_rank{rank}": torch.get_rng_state(),
    }


def save_checkpoint(ckpt_dir: str, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    final = os.path.join(ckpt_dir, f"step-{step:06d}")
    tmp = os.path.join(ckpt_dir, f".tmp-step-{step:06d}")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(checkpoint_state(model, optim, step), checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # atomic: the directory appears whole or not at all
    dist.barrier()


def latest_checkpoint(ckpt_dir: str) -> str | None:
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted(d for d in os.listdir(ckpt_dir) if re.fullmatch(r"step-\d{6}", d))
    return os.path.join(ckpt_dir, steps[-1]) if steps else None


def load_checkpoint(path: str, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    """Restore everything; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = checkpoint_state(model, optim, -1)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    torch.set_rng_state(state[f"rng_rank{dist.get_rank()}"])
    return int(state["progress"]["step"]) + 1


def maybe_fail(step: int, ckpt_dir: str | None) -> None:
    """FSDP2_EXAMPLE_FAIL_AT=K: rank 1 exits at step K, once (a marker file remembers)."""
    fail_at = os.environ.get("FSDP2_EXAMPLE_FAIL_AT")
    if fail_at is None or int(fail_at) != step or dist.get_rank() != 1 or ckpt_dir is None:
        return
    marker = os.path.join(ckpt_dir, ".failed-once")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    print(f"rank 1: simulated failure at step {step}", flush=True)
    os._exit(1)


def setup() -> torch.device:
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    backend = "nccl" if use_cuda else "gloo"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        dist.init_process_group(backend)
    else:
        # After a torchrun restart the rendezvous store still holds the previous
        # attempt's addresses; a prefix per attempt keeps gloo from dialing dead peers.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
            is_master=(rank == 0 and not agent_store),
        )
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"attempt-{restart}", store), rank=rank, world_size=world
        )
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def synthetic_batch(step: int, rank: int, args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that follow ``next = (3 * tok + 1) % vocab``: learnable, so loss falls."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    seq = [start]
    for _ in range(args.seq_len):
        seq.append((seq[-1] * 3 + 1) % args.vocab)
    tokens = torch.cat(seq, dim=1).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    args = parse_args()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    lib = importlib.import_module("fsdp2" if args.impl == "fsdp2" else "torch.distributed.fsdp")
    margs = ModelArgs(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        hidden_dim=int(8 * args.dim / 3), max_seq_len=args.seq_len,
    )
    with torch.device("meta" if args.meta_init else device):
        model = Transformer(margs)
    mp = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else lib.MixedPrecisionPolicy()
    for layer in model.layers:
        lib.fully_shard(layer, mp_policy=mp)
    lib.fully_shard(model, mp_policy=mp)
    if args.meta_init:
        model.to_empty(device=device)
    model.init_weights(args.seed)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"{args.impl}: {n_params / 1e6:.2f}M parameters, world size {world}, device {device.type}", flush=True)
    start_step = 0
    if args.ckpt_dir:
        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
        dist.barrier()
        latest = latest_checkpoint(args.ckpt_dir)
        if latest is not None:
            start_step = load_checkpoint(latest, model, optim)
            if rank == 0:
                print(f"resumed from {latest} at step {start_step}", flush=True)
    for step in range(start_step, args.steps):
        maybe_fail(step, args.ckpt_dir)
        inputs, targets = synthetic_batch(step, rank, args, device)
        start = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(
            f"rank {rank} step {step:3d} loss {loss.item():.4f} step_time {elapsed * 1e3:7.1f} ms "
            f"peak_mem {peak_memory_mb(device):8.1f} MB",
            flush=True,
        )
        if args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(args.ckpt_dir, model, optim, step)
    if args.final_params:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.final_params)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo worker threads can still hold async work objects when the
    # interpreter finalizes, which aborts the process ("terminate called without an
    # active exception") with torch's fully_shard as well as ours: leave before that.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
