"""Train a small Llama-style transformer with fsdp2.

    torchrun --standalone --nproc-per-node 2 examples/train.py
    torchrun --standalone --nproc-per-node 2 examples/train.py --ac selective   # or --ac full
    torchrun --standalone --nproc-per-node 4 examples/train.py --pp 2           # pp 2 x dp 2
    torchrun --standalone --nproc-per-node 4 examples/train.py --tp 2           # dp 2 x tp 2
    torchrun --standalone --nproc-per-node 4 examples/train.py --hsdp 2         # HSDP: 2 replicas x 2 shards
    torchrun --standalone --nproc-per-node 2 examples/train.py --optim muon --clip 1.0
    torchrun --standalone --nproc-per-node 4 examples/train.py --moe --experts 4 --top-k 2 --ep 2
    torchrun --standalone --nproc-per-node 2 examples/train.py --data text --eval-every 10
    torchrun --standalone --nproc-per-node 2 examples/train.py --auto-plan --memory-budget 40  # GiB per rank

CPU + gloo by default; GPUs + NCCL when CUDA is available (one GPU per rank).
Each block is its own fsdp2 group, plus the root (embeddings, final norm, output).
``--impl torch`` runs the same script on torch's fully_shard, for comparison.

``--compile`` compiles each block (inductor; ``--compile aot_eager``: graph capture and
AOTAutograd with eager kernels, torchtitan's ``compile.backend``) before ``fully_shard``,
after its activation checkpointing wrapper (torchtitan's order); with ``--tp`` the block
inside the wrapper, and with a zero-bubble schedule without donated buffers (torch 2.13
needs both).

``--ac full`` wraps each block in ``checkpoint_wrapper`` before ``fully_shard`` (as
torchtitan does), ``--ac selective`` also saves the matmuls' outputs and recomputes the
rest. ``--pp N`` splits the blocks into pipeline stages on a (pp N, dp world/N) mesh,
each stage's blocks and the stage itself sharded over dp, run by ``--pp-schedule``
(micro-batches: ``--microbatches``); the data-parallel ranks see the same data as a
plain run on world/N ranks, so the losses agree.

``--tp N`` adds tensor parallelism, torchtitan style: on a (dp world/N, tp N) mesh the
model is first parallelized over ``mesh["tp"]`` (rowwise embedding, colwise q/k/v and
w1/w3, rowwise wo and w2, sequence-parallel norms, colwise output with replicated
logits), then each block and the root are sharded with ``fully_shard`` over
``mesh["dp"]``. The ranks of one tp group train on the same data, the dp rank's, so the
losses agree with a plain run on world/N ranks. ``--hsdp N`` shards over a
(replicate N, shard world/N) mesh instead of a flat one (HSDP: reduce-scatter within a
replica, all-reduce across replicas); the data is the plain run's on the same world.
Both together make a (replicate, shard, tp) mesh. Neither combines with ``--pp``.

``--optim muon`` trains the blocks' matrices with ``fsdp2.optim.Muon`` (each matrix
orthogonalized once, by one rank) and the rest with AdamW; ``--clip X`` clips the total
gradient norm with ``fsdp2.clip_grad_norm_`` (across tensor-parallel meshes and pipeline
stages). Both combine with ``--tp``, ``--hsdp``, ``--pp`` and checkpoints.

``--moe`` replaces each block's MLP by a Mixture-of-Experts (``--experts E`` SwiGLU
experts, token choice, ``--top-k K``); ``--ep N`` splits the experts over N ranks of the
data-parallel shard dim (expert parallel: tokens dispatched by all-to-all) and shards
them over the rest of it with a per-parameter mesh (``examples/moe.py``). It combines
with ``--hsdp``, ``--tp`` (the MoE layers compute their tp group's whole sequence, alike
on each of its ranks), ``--pp``, ``--ac``, ``--optim muon``, ``--clip``, ``--bf16``,
checkpoints and ``--impl torch``.

``--data text`` trains on real text instead of the synthetic sequences: the bytes of the
Python standard library's own source (``examples/data.py``; no download, vocab 256),
split by file into training and held-out text. ``--eval-every N`` prints the held-out
loss every N steps and at the end (``--eval-batches K`` fixed batches per data rank, the
forward only, averaged over the data ranks); not with ``--pp``.

``--quantize-gather`` / ``--quantize-reduce`` (``int8`` or ``fp8``) quantize fsdp2's
parameter all-gather / gradient reduce-scatter (``MixedPrecisionPolicy``'s fields of
those names; with ``--bf16`` too). torch's fully_shard has no such thing.

``--auto-plan`` shards with ``fsdp2.plan`` (``docs/planning.md``) instead of the
per-block loop: the embeddings, each block, the final norm with the output head, then the
root, each with the planner's settings; rank 0 prints the plan's table.
``--memory-budget G`` (GiB, or a size such as ``800MiB``) fits that plan to G per rank
before the process group starts: dry runs on torch's fake process group at ``WORLD_SIZE``
ranks and this rank's batch shape choose each group's resharding and activation
checkpointing (CPU offload last); every rank computes the same plan. When nothing fits,
rank 0 prints why and the job exits with status 1. Not with ``--impl torch``, ``--pp``,
``--tp``, ``--ac`` or ``--compile``; the budget not with ``--moe`` (the routing reads
values, which the dry run has not) or ``--optim muon`` (the fit counts AdamW's state).

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
import dataclasses
import functools
import importlib
import math
import os
import re
import resource
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from data import VOCAB, TextData  # noqa: E402
from model import ModelArgs, MoE, Transformer, TransformerStage, init_weights  # noqa: E402
from moe import expert_placement_fn, moe_meshes, moe_tp_plan, parallelize_experts, scale_expert_grads  # noqa: E402

# Schedules with two stages per rank, and which of them place them as a V.
LOOPED = {"Interleaved1F1B", "ZBVZeroBubble"}
V_SHAPED = {"ZBVZeroBubble"}
SPLIT_BACKWARD = {"ZBVZeroBubble"}  # input and weight gradients in two passes (add new such schedules here)


def ffn_hidden_dim(dim: int, multiple_of: int = 8) -> int:
    """SwiGLU's 8/3 * dim, rounded up to a multiple of 8 as Llama does (to 256 there):
    tensor parallel splits it evenly (torch's TP plans need even shards)."""
    return -(-int(8 * dim / 3) // multiple_of) * multiple_of


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None, help="default 512; --data text needs 256 (bytes)")
    p.add_argument("--data", choices=["synthetic", "text"], default="synthetic",
                   help="text: bytes of the Python standard library's source (examples/data.py)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out loss every N steps and at the end (0: off)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches per data rank for --eval-every")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="constant",
                   help="cosine: from --lr down to --lr/10 over --steps")
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 reduce (MixedPrecisionPolicy)")
    p.add_argument("--quantize-gather", choices=["int8", "fp8"], default=None,
                   help="quantized parameter all-gather (MixedPrecisionPolicy.quantize_gather)")
    p.add_argument("--quantize-reduce", choices=["int8", "fp8"], default=None,
                   help="quantized gradient reduce-scatter (MixedPrecisionPolicy.quantize_reduce)")
    p.add_argument("--meta-init", action="store_true", help="build on the meta device, shard, then materialize")
    p.add_argument("--auto-plan", action="store_true",
                   help="shard with fsdp2.plan (groups, resharding, activation checkpointing chosen by the "
                        "planner) instead of the per-block loop; rank 0 prints the plan")
    p.add_argument("--memory-budget", type=budget_bytes, default=None, metavar="GIB",
                   help="with --auto-plan: fit the plan to this many GiB per rank (or a size such as "
                        "'800MiB') by dry runs before the process group starts")
    p.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none", help="activation checkpointing")
    p.add_argument("--compile", nargs="?", const="inductor", choices=["inductor", "aot_eager"], default=None,
                   metavar="BACKEND", help="torch.compile each block before fully_shard, with BACKEND (default "
                                           "inductor; aot_eager: eager kernels, no code generation)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (divides the world size)")
    p.add_argument("--pp-schedule", choices=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"], default="1F1B")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches (divide --batch-size)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: a (dp world/N, tp N) mesh, torchtitan's Llama plan")
    p.add_argument("--hsdp", type=int, default=1,
                   help="HSDP replicas: fully_shard over a (replicate N, shard world/N) mesh")
    p.add_argument("--optim", choices=["adamw", "muon"], default="adamw",
                   help="muon: Muon on the blocks' matrices, AdamW on the rest")
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradients' total norm to this (0: off)")
    p.add_argument("--moe", action="store_true", help="Mixture-of-Experts MLPs (see --experts, --top-k, --ep)")
    p.add_argument("--experts", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides the data-parallel shard dim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here and resume from the latest")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (needs --ckpt-dir)")
    p.add_argument("--final-params", default=None, help="rank 0 saves the full final parameters here (torch.save)")
    args = p.parse_args(argv)
    check_data_args(p, args)
    if args.impl == "torch" and (args.quantize_gather or args.quantize_reduce):
        p.error("--quantize-gather / --quantize-reduce need --impl fsdp2: torch's fully_shard has no "
                "quantized communication")
    if args.save_every and not args.ckpt_dir:
        p.error("--save-every needs --ckpt-dir")
    if args.pp > 1 and args.ac == "selective" and args.pp_schedule in SPLIT_BACKWARD:
        p.error(f"--ac selective cannot run with {args.pp_schedule}: its split backward runs twice over each "
                "block, which torch's selective checkpointing refuses; use --ac full or another schedule")
    if args.tp < 1 or args.hsdp < 1 or args.pp < 1:
        p.error("--tp, --hsdp and --pp must be at least 1")
    if args.dim % (2 * args.heads):
        p.error(f"--dim ({args.dim}) must be a multiple of 2 x --heads ({args.heads}): "
                "rotary embeddings rotate pairs of each head's dimensions")
    if args.pp > 1 and (args.tp > 1 or args.hsdp > 1):
        p.error("--pp cannot be combined with --tp or --hsdp in this example")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world % (args.tp * args.hsdp):
        p.error(f"--tp {args.tp} x --hsdp {args.hsdp} must divide the world size {world}")
    if args.tp > 1 and (args.heads % args.tp or args.seq_len % args.tp):
        p.error(f"--tp {args.tp} must divide --heads ({args.heads}: each rank takes whole heads) and "
                f"--seq-len ({args.seq_len}: sequence parallelism splits the sequence)")
    if args.tp > 1 and (args.vocab % args.tp or ffn_hidden_dim(args.dim) % args.tp):
        p.error(f"--tp {args.tp} must divide --vocab ({args.vocab}) and the MLP's hidden size "
                f"({ffn_hidden_dim(args.dim)} for --dim {args.dim}): tensor parallel splits them evenly")
    check_moe_args(p, args, world)
    check_plan_args(p, args)
    stages = args.pp * (2 if args.pp_schedule in LOOPED else 1)
    if args.pp > 1 and (args.layers % stages or args.batch_size % args.microbatches):
        p.error(f"--pp {args.pp} with {args.pp_schedule} makes {stages} stages: --layers ({args.layers}) must be "
                f"a multiple of that, and --batch-size ({args.batch_size}) of --microbatches ({args.microbatches})")
    return args


def check_data_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolves ``--vocab`` (bytes for ``--data text``) and checks the evaluation flags."""
    if args.data == "text":
        if args.vocab not in (None, VOCAB):
            p.error(f"--data text has a vocab of {VOCAB} (bytes), got --vocab {args.vocab}: "
                    "leave --vocab out")
        args.vocab = VOCAB
    elif args.vocab is None:
        args.vocab = 512
    if args.eval_every < 0 or args.eval_batches < 1:
        p.error(f"--eval-every must be at least 0 and --eval-batches at least 1, got {args.eval_every} "
                f"and {args.eval_batches}")
    if args.eval_every and args.pp > 1:
        p.error("--eval-every cannot run with --pp in this example: the held-out forward would need a "
                "pipeline schedule of its own")


def budget_bytes(text: str) -> int:
    """``--memory-budget``: a number of GiB (``40``, ``0.5``) or a size with its unit
    (``800MiB``, ``80GB``), as bytes."""
    try:
        value = float(text)
    except ValueError:
        from fsdp2.planning import parse_budget

        try:
            return parse_budget(text)  # type: ignore[return-value]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text!r}")
    return int(value * 2**30)


def check_plan_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--auto-plan`` shards the plain model (one 1-D or HSDP mesh) with fsdp2's planner,
    which also chooses activation checkpointing; ``--memory-budget`` fits that plan."""
    if args.memory_budget is not None and not args.auto_plan:
        p.error("--memory-budget fits the plan of --auto-plan: add --auto-plan")
    if not args.auto_plan:
        return
    refused = [(args.impl == "torch", "--impl torch", "the plan's calls are fsdp2's fully_shard"),
               (args.pp > 1, "--pp", "pipeline stages are sharded stage by stage"),
               (args.tp > 1, "--tp", "the planner shards the plain model over one data-parallel mesh"),
               (args.ac != "none", f"--ac {args.ac}", "the plan chooses each block's activation checkpointing"),
               (args.compile, "--compile", ("the blocks would be compiled between the plan's checkpoint "
                                            "and fully_shard calls"))]
    for bad, flag, why in refused:
        if bad:
            p.error(f"--auto-plan cannot run with {flag}: {why}")
    if args.memory_budget is None:
        return
    if args.moe:
        p.error("--memory-budget cannot run with --moe: the dry run has no data, and the MoE's routing "
                "reads values (bincount, tolist)")
    if args.optim != "adamw":
        p.error(f"--memory-budget cannot run with --optim {args.optim}: the fit counts AdamW's state")


def check_moe_args(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    if not args.moe:
        if args.ep > 1:
            p.error("--ep needs --moe")
        return
    shard = world // (args.pp * args.hsdp * args.tp)
    if args.ep < 1 or args.experts % args.ep or shard % args.ep:
        p.error(f"--ep {args.ep} must divide --experts ({args.experts}) and the data-parallel shard dim ({shard} ranks)")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k ({args.top_k}) must lie in [1, --experts ({args.experts})]")


# Optimizer state keyed by parameter names, not positions: pipeline ranks hold different
# parameters, and position-keyed groups would overwrite each other in the checkpoint.
def _state_dict_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoint_state(model: torch.nn.Module, optims: list[torch.optim.Optimizer], step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank = dist.get_rank()
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optims, options=_state_dict_options()),
        "progress": {"step": step},  # the data position: batches are a function of the step
        f"rng_rank{rank}": torch.get_rng_state(),
    }


def save_checkpoint(ckpt_dir: str, model: torch.nn.Module, optims: list[torch.optim.Optimizer], step: int) -> None:
    import torch.distributed.checkpoint as dcp

    final = os.path.join(ckpt_dir, f"step-{step:06d}")
    tmp = os.path.join(ckpt_dir, f".tmp-step-{step:06d}")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(checkpoint_state(model, optims, step), checkpoint_id=tmp)
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


def load_checkpoint(path: str, model: torch.nn.Module, optims: list[torch.optim.Optimizer]) -> int:
    """Restore everything; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = checkpoint_state(model, optims, -1)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optims, state["optim"], options=_state_dict_options())
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
    if dist.is_initialized():
        pass  # the caller's process group (``main`` called in-process, as the tests do)
    elif restart is None:
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
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class Batches(NamedTuple):
    """Where the example's data comes from: ``(inputs, targets)`` on the device."""

    train: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (step, data rank)
    heldout: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (index, data rank)


def make_batches(args: argparse.Namespace, device: torch.device) -> Batches:
    """``--data``: the synthetic sequences (held out: steps no run reaches) or real text."""
    if args.data == "synthetic":
        return Batches(lambda step, rank: synthetic_batch(step, rank, args, device),
                       lambda index, rank: synthetic_batch(-1 - index, rank, args, device))
    text = TextData(args.batch_size, args.seq_len, args.seed)

    def on_device(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return pair[0].to(device), pair[1].to(device)

    return Batches(lambda step, rank: on_device(text.batch(step, rank)),
                   lambda index, rank: on_device(text.heldout_batch(index, rank)))


def heldout_loss(args: argparse.Namespace, model: nn.Module, batches: Batches, data_rank: int,
                 device: torch.device) -> float:
    """Mean loss of ``--eval-batches`` fixed held-out batches per data rank, forward only,
    averaged over every rank: the ranks of one tensor-parallel group hold the same value,
    so that is the mean over the data ranks."""
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for index in range(args.eval_batches):
            inputs, targets = batches.heldout(index, data_rank)
            total += loss_fn(model(inputs), targets)
    dist.all_reduce(total)  # sum over every rank
    return total.item() / (args.eval_batches * dist.get_world_size())


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Trainer(NamedTuple):
    model: nn.Module  # every parameter this rank holds, under the full model's names
    train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]  # forward + backward, the loss
    data_rank: int  # which slice of the data this rank trains on
    pp_mesh: Any = None  # the pipeline stages' mesh (--pp): gradient norms span it


def set_lr(args: argparse.Namespace, optims: list[torch.optim.Optimizer], step: int) -> None:
    """``--lr-schedule``: each step's learning rate, a function of the step alone (so a
    resumed run continues the same schedule)."""
    if args.lr_schedule == "constant":
        return
    lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(args.steps - 1, 1))))
    for optim in optims:
        for group in optim.param_groups:
            group["lr"] = lr


def make_optimizers(args: argparse.Namespace, model: nn.Module) -> list[torch.optim.Optimizer]:
    """``--optim adamw``: AdamW on everything. ``--optim muon``: Muon on the blocks'
    matrices (``fsdp2.optim.Muon``: each orthogonalized once, by one rank; with ``--impl
    torch``, ``torch.optim.Muon``), AdamW on the rest (embeddings, output, norms)."""
    if args.optim == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)]
    named = list(model.named_parameters())
    matrices = [p for n, p in named if p.dim() == 2 and n.startswith("layers.")]
    rest = [p for n, p in named if not (p.dim() == 2 and n.startswith("layers."))]
    if args.impl == "fsdp2":
        from fsdp2.optim import Muon
    else:
        Muon = torch.optim.Muon  # noqa: N806
    # "match_rms_adamw" scales Muon's update to AdamW's size, so both take --lr.
    muon = Muon(matrices, lr=args.lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    return [muon, torch.optim.AdamW(rest, lr=args.lr, weight_decay=0.01)]


def clip_gradients(args: argparse.Namespace, model: nn.Module, pp_mesh: Any) -> None:
    """``--clip X``: scale the gradients to a total norm of at most X, over every rank
    and pipeline stage (``fsdp2.clip_grad_norm_``; torch's own with ``--impl torch``,
    which fails across tensor-parallel meshes and does not span pipeline stages)."""
    if not args.clip:
        return
    if args.impl == "fsdp2":
        from fsdp2 import clip_grad_norm_

        clip_grad_norm_(model.parameters(), args.clip, pp_mesh=pp_mesh)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)


def checkpoint_blocks(model: Transformer, mode: str) -> None:
    """``--ac``: wrap each block in activation checkpointing before it is sharded."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs: dict[str, Any] = {}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, **kwargs)


def compile_blocks(model: Transformer, backend: str | None, tensor_parallel: bool = False) -> None:
    """``--compile``: compile each block (after its activation checkpointing wrapper, before
    fully_shard, as torchtitan does); fsdp2's hooks run eagerly around each block's graph.
    With tensor parallel the block inside the checkpoint wrapper is compiled instead:
    compiling a checkpointed region of DTensor ops fails in AOTAutograd (torch 2.13, with
    either fully_shard), while checkpointing a compiled block works."""
    if backend is not None:
        for layer in model.layers:
            inner = getattr(layer, "_checkpoint_wrapped_module", None)
            (inner if tensor_parallel and inner is not None else layer).compile(backend=backend)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    saved = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parallelize_tp(model: Transformer, tp_mesh: Any) -> None:
    """``--tp``: torchtitan's Llama plan. The sequence is sharded (``Shard(1)``) between
    the blocks and through the norms (sequence parallel), gathered before attention and
    the MLP, whose first matmuls are colwise (each rank its own heads and hidden units)
    and whose last are rowwise, reduce-scattered back to sequence shards. The logits
    come out replicated, so the loss is the plain one. The rotary tables stay plain
    tensors (the sequence is whole where they are used)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **({"feed_forward": moe_tp_plan()} if isinstance(layer.feed_forward, MoE) else {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }),
        })


def data_parallel_mesh(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, int]:
    """The mesh ``fully_shard`` shards over (None: its default, every rank), the tensor-
    parallel mesh (None without ``--tp``) and this rank's data index: its position in
    the data-parallel mesh, which is the global rank without ``--tp``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if args.tp == 1 and args.hsdp == 1:
        return None, None, dist.get_rank()
    if args.hsdp > 1:  # HSDP: replicas of world / (hsdp * tp) shards each
        shape, names = [args.hsdp, world // (args.hsdp * args.tp)], ["replicate", "shard"]
    else:
        shape, names = [world // args.tp], ["dp"]
    if args.tp == 1:
        return init_device_mesh(device.type, tuple(shape), mesh_dim_names=tuple(names)), None, dist.get_rank()
    mesh = init_device_mesh(device.type, (*shape, args.tp), mesh_dim_names=(*names, "tp"))
    dp_mesh = mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]
    return dp_mesh, mesh["tp"], mesh_rank(dp_mesh)


def mesh_rank(mesh: Any) -> int:
    """This rank's position in ``mesh``, its dims flattened in order: the data it trains on."""
    index = 0
    for size, coordinate in zip(mesh.shape, mesh.get_coordinate()):
        index = index * size + coordinate
    return index


def build_plain(args: argparse.Namespace, margs: ModelArgs, lib: Any, mp: Any, device: torch.device,
                fitted: Any = None) -> Trainer:
    """No pipeline: FSDP over every rank, or HSDP (``--hsdp``), over tensor parallel (``--tp``).
    ``--auto-plan``: the groups and their settings from ``fsdp2.plan`` (``fitted``: the plan
    ``fit_plan`` fitted to ``--memory-budget``, whose settings it takes)."""
    meshes = moe_meshes(device.type, dist.get_world_size(), 1, args.hsdp, args.ep, args.tp) if args.moe else None
    if meshes is not None:
        dp_mesh, tp_mesh, data_rank = meshes.dense, meshes.tp, mesh_rank(meshes.dense)
    else:
        dp_mesh, tp_mesh, data_rank = data_parallel_mesh(args, device)
    with torch.device("meta" if args.meta_init else device):
        model = Transformer(margs)
    if tp_mesh is not None:
        parallelize_tp(model, tp_mesh)  # before the checkpoint wrappers change the module paths
    if meshes is not None and meshes.ep is not None:
        parallelize_experts(model, meshes.ep)
    if args.auto_plan:
        apply_plan(model, dp_mesh, mp, fitted, meshes.experts if meshes is not None else None)
    else:
        checkpoint_blocks(model, args.ac)
        compile_blocks(model, args.compile, tensor_parallel=tp_mesh is not None)
        for layer in model.layers:
            placement_fn = expert_placement_fn(layer, args.impl, meshes) if meshes is not None else None
            lib.fully_shard(layer, mesh=dp_mesh, mp_policy=mp, shard_placement_fn=placement_fn)
        lib.fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    if args.meta_init:
        model.to_empty(device=device)
    init_weights(model, args.seed)

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    return Trainer(model, train_step, data_rank)


def apply_plan(model: Transformer, dp_mesh: Any, mp: Any, fitted: Any, expert_mesh: Any = None) -> None:
    """``--auto-plan``: ``fsdp2.plan``'s calls on ``model`` (the embeddings, each block, the
    final norm with the output, the root); rank 0 prints the plan. With ``fitted`` (made
    before the process group existed, without a mesh) its groups' settings and estimate."""
    import fsdp2

    plan = fsdp2.plan(model, mesh=dp_mesh, mp_policy=mp, expert_mesh=expert_mesh)
    if fitted is not None:
        plan.adopt(fitted)  # the fitted settings, onto the plan with the job's mesh
    plan.apply(model)
    if dist.get_rank() == 0:
        print(plan, flush=True)


def fit_plan(args: argparse.Namespace, margs: ModelArgs, mp: Any) -> Any:
    """``--memory-budget``: the plan of this model fitted to the budget, by dry runs on
    torch's fake process group at the job's size (``WORLD_SIZE``) and this rank's batch
    shape. It runs before ``init_process_group`` (the fake group cannot start beside a real
    one); every rank computes the same plan (its dry runs are deterministic), so nothing
    needs to be sent. No plan fits: rank 0 prints why, every rank exits with status 1.
    Without a budget: the planner's default plan and its estimate (one dry run)."""
    import fsdp2
    from fsdp2.planning import BudgetError

    if dist.is_initialized():
        raise SystemExit("--memory-budget fits the plan before the process group starts (torch's fake "
                         "process group), and this process already has one: run the example under torchrun")
    with torch.device("meta"):
        model = Transformer(margs)
    tokens = torch.empty(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
    targets = torch.empty(args.batch_size, args.seq_len, dtype=torch.long, device="meta")
    try:  # the planner's default optimizer is the example's: AdamW (its state is the same at any lr)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        shape = (args.hsdp, world // args.hsdp) if args.hsdp > 1 else world  # (replicate, shard) with --hsdp
        return fsdp2.plan(model, world_size=shape, mp_policy=mp, inputs=tokens,
                          loss_fn=lambda logits: loss_fn(logits, targets), memory_budget=args.memory_budget)
    except BudgetError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def build_pipeline(args: argparse.Namespace, margs: ModelArgs, lib: Any, mp: Any, device: torch.device) -> Trainer:
    """``--pp``: this rank's stages of the model, each sharded over the dp dimension."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if args.moe:
        meshes = moe_meshes(device.type, world, args.pp, 1, args.ep)
        dp_mesh, pp_mesh = meshes.dense, meshes.pp
    else:
        meshes = None
        mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
        dp_mesh, pp_mesh = mesh["dp"], mesh["pp"]
    PipelineStage = pipelining.PipelineStage
    if args.impl == "fsdp2":
        from fsdp2.pipelining import PipelineStage  # reduces once per step, keeps the split backward
    with torch.device("meta"):  # each rank materializes its own stages only
        model = Transformer(margs)
    if meshes is not None and meshes.ep is not None:
        parallelize_experts(model, meshes.ep)
    checkpoint_blocks(model, args.ac)
    compile_blocks(model, args.compile)
    if args.compile and args.pp_schedule in SPLIT_BACKWARD:
        # The split backward runs each compiled backward in two passes (retain_graph), so
        # it may not donate its buffers to itself (torch refuses otherwise, either library).
        torch._functorch.config.donated_buffer = False
    per_rank = 2 if args.pp_schedule in LOOPED else 1
    count, pp_rank = args.pp * per_rank, pp_mesh.get_local_rank()
    mine = [pp_rank, count - 1 - pp_rank] if args.pp_schedule in V_SHAPED else [pp_rank + k * args.pp for k in range(per_rank)]
    per_stage = args.layers // count
    modules, stages = [], []
    for index in mine:
        module = TransformerStage(model, index * per_stage, (index + 1) * per_stage)
        for layer in module.layers.values():
            placement_fn = expert_placement_fn(layer, args.impl, meshes) if meshes is not None else None
            lib.fully_shard(layer, mesh=dp_mesh, mp_policy=mp, shard_placement_fn=placement_fn)
        lib.fully_shard(module, mesh=dp_mesh, mp_policy=mp)
        module.to_empty(device=device)
        init_weights(module, args.seed)
        modules.append(module)
        # The stage's input and output shapes, given: no shape-inference messages between
        # stages at the first step (objects, which fsdp2.estimate's fake process group
        # cannot deliver).
        inputs, outputs = stage_shapes(args, index, count)
        grads = dict(output_grads=outputs if index < count - 1 else None, input_grads=inputs if index else None)
        stages.append(PipelineStage(module, index, count, device, input_args=inputs, output_args=outputs,
                                    group=pp_mesh.get_group(), **grads))
    schedule_cls = getattr(pipelining, f"Schedule{args.pp_schedule}")
    schedule = schedule_cls(stages if per_rank > 1 else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    first, last = 0 in mine, count - 1 in mine

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if last else {}
        schedule.step(*([inputs] if first else []), **kwargs)
        return torch.stack(losses).mean() if losses else None  # mean over micro-batches

    return Trainer(_local_model(modules), train_step, mesh_rank(dp_mesh), pp_mesh)


def stage_shapes(args: argparse.Namespace, index: int, count: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Meta examples of pipeline stage ``index``'s input and output, per micro-batch:
    token ids into the first stage, hidden states (compute dtype) between stages,
    logits out of the last."""
    micro = args.batch_size // args.microbatches
    dtype = torch.bfloat16 if args.bf16 else torch.float32

    def hidden(width: int) -> torch.Tensor:  # requires grad: gradients flow back through it
        return torch.empty(micro, args.seq_len, width, dtype=dtype, device="meta", requires_grad=True)

    first = torch.empty(micro, args.seq_len, dtype=torch.long, device="meta")
    return (first if index == 0 else hidden(args.dim),), hidden(args.vocab if index == count - 1 else args.dim)


def _local_model(stages: list[nn.Module]) -> nn.Module:
    """One module holding every parameter of this rank's stages under the full model's
    names, for the optimizer and checkpoints."""
    local = nn.Module()
    local.layers = nn.ModuleDict()
    for stage in stages:
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(stage, name) is not None:
                setattr(local, name, getattr(stage, name))
        local.layers.update(stage.layers)
    return local


def save_full_params(model: nn.Module, path: str, pp: int) -> None:
    """Rank 0 saves every parameter, unsharded, under the full model's names (with
    ``--pp``, each pipeline rank's stages gathered to rank 0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=pp == 1))
    if pp > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, {k: v.cpu() for k, v in full.items()})
        full = {k: part[k] for part in parts for k in sorted(part)}
    if dist.get_rank() == 0:
        torch.save(dict(sorted(full.items())) if pp > 1 else full, path)


def precision_policy(args: argparse.Namespace, lib: Any) -> Any:
    """``--bf16`` and ``--quantize-*`` as ``lib``'s MixedPrecisionPolicy; a clear exit where
    this fsdp2 has no quantized communication (the policy lacks those fields)."""
    kwargs: dict[str, Any] = {}
    if args.bf16:
        kwargs.update(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    names = ("quantize_gather", "quantize_reduce")
    quantize = {name: getattr(args, name) for name in names if getattr(args, name)}
    missing = sorted(set(quantize) - {f.name for f in dataclasses.fields(lib.MixedPrecisionPolicy)})
    if missing:
        raise SystemExit(f"--quantize-gather / --quantize-reduce: this fsdp2's MixedPrecisionPolicy has no "
                         f"{', '.join(missing)} field; they need a version with quantized communication")
    return lib.MixedPrecisionPolicy(**kwargs, **quantize)


def describe(args: argparse.Namespace, n_params: int, world: int, device: torch.device) -> str:
    """Rank 0's first line: the run's configuration."""
    return (f"{args.impl}: {n_params / 1e6:.2f}M parameters on rank 0, world size {world}, pp {args.pp}, "
            f"tp {args.tp}, hsdp {args.hsdp}, ac {'(the plan)' if args.auto_plan else args.ac}, "
            f"compile {args.compile or 'off'}, optim {args.optim}, "
            f"clip {args.clip}, device {device.type}"
            + (f", moe {args.experts} experts top-{args.top_k} ep {args.ep}" if args.moe else "")
            + f", data {args.data}, quantize gather {args.quantize_gather} reduce {args.quantize_reduce}"
            + (", auto-plan" if args.auto_plan else "")
            + (f" fitted to {_size(args.memory_budget)}" if args.memory_budget is not None else ""))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def report_heldout(args: argparse.Namespace, step: int, model: nn.Module, batches: Batches, data_rank: int,
                   device: torch.device) -> None:
    """``--eval-every N``: the held-out loss after every N-th step and after the last one."""
    if not args.eval_every or ((step + 1) % args.eval_every and step != args.steps - 1):
        return
    value = heldout_loss(args, model, batches, data_rank, device)  # every rank: it all-reduces
    if dist.get_rank() == 0:
        print(f"eval step {step} heldout_loss {value:.4f}", flush=True)


def model_args(args: argparse.Namespace) -> ModelArgs:
    return ModelArgs(
        vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
        hidden_dim=ffn_hidden_dim(args.dim), max_seq_len=args.seq_len,
        n_experts=args.experts if args.moe else 0, top_k=args.top_k,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    lib = importlib.import_module("fsdp2" if args.impl == "fsdp2" else "torch.distributed.fsdp")
    margs = model_args(args)
    mp = precision_policy(args, lib)
    fitted = fit_plan(args, margs, mp) if args.memory_budget is not None else None  # before setup()
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the world size {world}")
    build = build_pipeline if args.pp > 1 else functools.partial(build_plain, fitted=fitted)
    model, train_step, data_rank, pp_mesh = build(args, margs, lib, mp, device)
    optims = make_optimizers(args, model)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(describe(args, n_params, world, device), flush=True)
    # Tokens a step trains on, all data-parallel ranks together (a tp group shares its batch).
    step_tokens = args.batch_size * args.seq_len * world // (args.pp * args.tp)
    batches = make_batches(args, device)
    start_step = 0
    if args.ckpt_dir:
        if rank == 0:
            os.makedirs(args.ckpt_dir, exist_ok=True)
        dist.barrier()
        latest = latest_checkpoint(args.ckpt_dir)
        if latest is not None:
            start_step = load_checkpoint(latest, model, optims)
            if rank == 0:
                print(f"resumed from {latest} at step {start_step}", flush=True)
    for step in range(start_step, args.steps):
        maybe_fail(step, args.ckpt_dir)
        inputs, targets = batches.train(step, data_rank)
        start = time.perf_counter()
        loss = train_step(inputs, targets)
        scale_expert_grads(model, args.ep)
        clip_gradients(args, model, pp_mesh)
        set_lr(args, optims, step)
        for optim in optims:
            optim.step()
            optim.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        shown = f"{loss.item():.4f}" if loss is not None else "  -   "  # pipeline: the last stage has it
        print(
            f"rank {rank} data {data_rank} step {step:3d} loss {shown} step_time {elapsed * 1e3:7.1f} ms "
            f"tokens/s {step_tokens / elapsed:9.0f} peak_mem {peak_memory_mb(device):8.1f} MB",
            flush=True,
        )
        report_heldout(args, step, model, batches, data_rank, device)
        if args.save_every and (step + 1) % args.save_every == 0:
            save_checkpoint(args.ckpt_dir, model, optims, step)
    if args.final_params:
        save_full_params(model, args.final_params, args.pp)
    dist.barrier()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
    # torch 2.13's gloo worker threads can still hold async work objects when the
    # interpreter finalizes, which aborts the process ("terminate called without an
    # active exception") with torch's fully_shard as well as ours: leave before that.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
