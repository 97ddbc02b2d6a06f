"""A reinforcement-learning loop's shape with fsdp2: the trained policy shares its ranks
with an inference engine that generates the next batch.

    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py
    torchrun --standalone --nproc-per-node 4 examples/rl_loop.py --iterations 5
    torchrun --standalone --nproc-per-node 2 examples/rl_loop.py --impl torch   # the hand-written export

Each iteration, as verl, TRL's GRPO or OpenRLHF do it:

1. the engine (a stand-in for vLLM or SGLang: an unsharded copy of the model in
   ``--engine-dtype``, generating greedily) completes this rank's prompts; with
   ``--generate-with policy`` the sharded policy itself does (TRL's GRPO without vLLM,
   verl's HF rollout), inside ``with fsdp2.gathered(model):``: one all-gather per group
   for the whole generation (torch's ``fully_shard``: one per group per token);
2. the policy, sharded with ``fully_shard``, comes back to the device (where there is
   one: ``model.to(device)`` and its optimizer state) and takes a policy-gradient step
   on the completions (a toy reward: the share of tokens below ``vocab / 2``);
3. the full weights go to the engine: ``fsdp2.full_weights(model, dtype=...)``, one
   all-gather per ``fully_shard`` group, cast before the gather; with ``--impl torch``
   the loop RL trainers write for torch's ``fully_shard``, one ``full_tensor()`` per
   parameter, cast after;
4. the policy leaves the device (``model.cpu()``, the optimizer state by hand,
   ``empty_cache()``) while the engine generates the next batch; fsdp2 reports what it
   still holds there (``fsdp2.held_bytes``).

Rank 0 prints each export's all-gathers, bytes and time, and each iteration checks that
the engine's weights equal the trained full weights (``p.full_tensor()`` cast to the
engine's dtype, bit for bit); the run fails otherwise. CPU + gloo by default (no device
moves there); GPUs + NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from model import ModelArgs, Transformer, init_weights
from train import setup

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="prompts per rank per iteration")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--engine-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--generate-with", choices=["engine", "policy"], default="engine",
                   help="who completes the prompts: the engine, or the sharded policy (fsdp2.gathered)")
    return p.parse_args(argv)


class GatherMeter(TorchDispatchMode):
    """All-gathers issued while active and their gathered bytes: c10d's own (fsdp2's
    export) and the functional ones (DTensor's ``full_tensor()``)."""

    OPS: ClassVar[set[str]] = {"c10d._allgather_base_", "c10d.allgather_", "c10d_functional.all_gather_into_tensor",
           "_c10d_functional.all_gather_into_tensor"}

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.bytes = 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if name in self.OPS:
            if name == "c10d._allgather_base_":  # (output, input, group, ...)
                gathered = [args[0]]
            elif name == "c10d.allgather_":  # ([[outputs]], [input], group, ...)
                gathered = list(args[0][0])
            else:  # functional: returns the gathered tensor
                gathered = [out]
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in gathered)
        return out


def export_fsdp2(model: torch.nn.Module, dtype: torch.dtype) -> Any:
    import fsdp2

    return fsdp2.full_weights(model, dtype=dtype)


def export_per_parameter(model: torch.nn.Module, dtype: torch.dtype) -> Any:
    """What RL trainers write for torch's ``fully_shard``: one all-gather per entry."""
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        yield name, full.to(dtype) if full.is_floating_point() else full


def load_into(engine: torch.nn.Module, weights: Any) -> None:
    """The engine's ``load_weights``: copy each full tensor in as it arrives."""
    own = engine.state_dict()
    with torch.no_grad():
        for name, value in weights:
            own[name].copy_(value)


def trained_equal(engine: torch.nn.Module, model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """The engine's weights are the policy's full weights in ``dtype``, bit for bit."""
    own = engine.state_dict()
    return all(torch.equal(own[name], value) for name, value in export_per_parameter(model, dtype))


def move_optimizer_state(opt: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


@torch.no_grad()
def generate(engine: torch.nn.Module, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    seqs = prompts
    for _ in range(steps):
        nxt = engine(seqs)[:, -1].argmax(-1, keepdim=True)
        seqs = torch.cat([seqs, nxt], dim=1)
    return seqs


def generate_with_policy(model: torch.nn.Module, prompts: torch.Tensor, args: argparse.Namespace,
                         summary: dict[str, Any]) -> torch.Tensor:
    """The sharded policy completes the prompts: fsdp2 keeps each group gathered for the
    whole generation (``fsdp2.gathered``); torch's ``fully_shard`` gathers the blocks
    again for every token. Records the all-gathers, their bytes and the time."""
    import fsdp2

    meter = GatherMeter()
    start = time.perf_counter()
    with meter, fsdp2.gathered(model) if args.impl == "fsdp2" else contextlib.nullcontext():
        seqs = generate(model, prompts, args.gen_len)
    summary["generations"].append((meter.calls, meter.bytes, (time.perf_counter() - start) * 1e3, seqs.tolist()))
    if dist.get_rank() == 0:
        print(f"generation ({args.impl}, the policy): {meter.calls} all-gathers, {meter.bytes / 2**20:.2f} MiB, "
              f"{summary['generations'][-1][2]:.1f} ms", flush=True)
    return seqs


def policy_loss(model: torch.nn.Module, seqs: torch.Tensor, prompt_len: int, vocab: int) -> tuple[torch.Tensor, float]:
    """REINFORCE with a toy reward (each completion's share of tokens below vocab / 2,
    centred on the batch mean): the completions' log-likelihood, weighted."""
    completions = seqs[:, prompt_len:]
    reward = (completions < vocab // 2).float().mean(1)
    advantage = reward - reward.mean()
    logits = model(seqs[:, :-1])[:, prompt_len - 1 :]
    logp = -F.cross_entropy(logits.flatten(0, 1).float(), completions.flatten(), reduction="none")
    return -(advantage * logp.view_as(completions).mean(1)).mean(), reward.mean().item()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    lib = importlib.import_module("fsdp2" if args.impl == "fsdp2" else "torch.distributed.fsdp")
    device = setup()
    rank = dist.get_rank()
    margs = ModelArgs(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      hidden_dim=-(-int(8 * args.dim / 3) // 8) * 8, max_seq_len=args.prompt_len + args.gen_len)
    dtype = DTYPES[args.engine_dtype]
    with torch.device(device):
        model = Transformer(margs)
        engine = Transformer(margs).to(dtype).eval().requires_grad_(False)
    for layer in model.layers:
        lib.fully_shard(layer)
    lib.fully_shard(model)
    init_weights(model, args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    export = export_fsdp2 if args.impl == "fsdp2" else export_per_parameter
    load_into(engine, export(model, dtype))
    moves = device.type != "cpu"
    summary: dict[str, Any] = {"exports": [], "equal": [], "held": [], "generations": []}
    for it in range(args.iterations):
        g = torch.Generator().manual_seed(args.seed * 1009 + it * 101 + rank)
        prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=g).to(device)
        if args.generate_with == "engine":
            seqs = generate(engine, prompts, args.gen_len)  # the policy is off the device meanwhile
        if moves:
            model.to(device)
            move_optimizer_state(opt, device)
        if args.generate_with == "policy":
            seqs = generate_with_policy(model, prompts, args, summary)
        loss, reward = policy_loss(model, seqs, args.prompt_len, args.vocab)
        loss.backward()
        opt.step()
        opt.zero_grad()
        meter = GatherMeter()
        start = time.perf_counter()
        with meter:
            load_into(engine, export(model, dtype))
        if moves:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        equal = trained_equal(engine, model, dtype)
        summary["exports"].append((meter.calls, meter.bytes, ms))
        summary["equal"].append(equal)
        if moves:
            model.cpu()
            move_optimizer_state(opt, "cpu")
            torch.cuda.empty_cache()
            held = lib.held_bytes(model, device) if args.impl == "fsdp2" else {}
            engine_bytes = sum(t.numel() * t.element_size() for t in engine.state_dict().values())
            allocated = torch.cuda.memory_allocated(device)
            summary["held"].append({**held, "device allocated": allocated, "engine": engine_bytes})
        if rank == 0:
            where = ""
            if moves:
                last = summary["held"][-1]
                where = (f" | after model.cpu(): {device} holds {last['device allocated'] / 2**20:.1f} MiB "
                         f"(the engine {last['engine'] / 2**20:.1f} MiB; fsdp2's: "
                         f"{ {k: v for k, v in last.items() if k not in ('device allocated', 'engine')} or 'nothing'})")
            print(f"iteration {it}: loss {loss.item():.4f} reward {reward:.3f} | export ({args.impl}): "
                  f"{meter.calls} all-gathers, {meter.bytes / 2**20:.2f} MiB, {ms:.1f} ms | "
                  f"engine == trained: {equal}{where}", flush=True)
        if not equal:
            raise SystemExit(f"iteration {it}: the engine's weights differ from the trained ones")
    return summary


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as examples/train.py: gloo's threads may abort a finalizing interpreter
