"""Train a small Llama-style transformer with fsdp2.

    torchrun --standalone --nproc-per-node 2 examples/train.py

CPU + gloo by default; GPUs + NCCL when CUDA is available (one GPU per rank).
Each block is its own fsdp2 group, plus the root (embeddings, final norm, output).
``--impl torch`` runs the same script on torch's fully_shard, for comparison.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
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
    return p.parse_args()


def setup() -> torch.device:
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    dist.init_process_group("nccl" if use_cuda else "gloo")
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
    for step in range(args.steps):
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
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
