"""Run torchtitan 0.3.0's llama3 pipeline-parallel path with fsdp2 in place of torch's ``fully_shard``.

Builds torchtitan's llama3 debug model, shrunk for CPU; splits and parallelizes it with
torchtitan's own ``pipeline_llm`` (its stage split, ``PipelineStage`` per stage, then
``parallelize_llama`` with ``apply_fsdp_to_decoder`` on every stage, then its schedule builder)
for pp=2 x dp_shard=``WORLD/2``; trains a few steps with torchtitan's loss scaled by the global
token count and its ``clip_grad_norm_`` over the pp mesh; and does it once with torch's
``fully_shard`` and once under ``fsdp2.patch.applied()`` (what ``python -m fsdp2.patch`` does: the
rebinding turns torchtitan's ``fully_shard`` and ``PipelineStage`` into fsdp2's), from the same
weights and batches. Prints loss, grad norm and c10d collectives per step, summed over all
ranks, for both (the collectives of ``tests/_comm.py``: FSDP's all-gathers and reduces, plus
the clip's all-reduces; the pipeline's point-to-point sends are not counted), and exits 1 when
a relative difference exceeds 1e-4, a parameter's placements differ (rank 0's stages), or
fsdp2 issues more collectives of some kind.

    torchrun --standalone --nproc-per-node 4 tools/torchtitan_pp.py --schedule Interleaved1F1B

Shared with ``tools/torchtitan_moe.py`` (imported: its stubs, weight loading, report), and alike
for both libraries: torchtitan's causal SDPA module (FlexAttention has no CPU backward), SUM
reductions (``set_force_sum_reduction_for_comms``: PREMUL_SUM is missing on gloo), rope tables
of ``SEQ`` positions. One torch-version workaround: torchtitan 0.3.0's trainer calls
``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, which torch 2.13's schedules do not
take; this calls ``step(inputs, target=labels, losses=..., loss_kwargs=...)``, which splits the
local batch into the same micro-batches (``LOCAL_BATCH / microbatch size``). The SPMD backend is
``partial_dtensor`` (DTensors for the model-parallel axes only): under ``full_dtensor`` and
``spmd_types`` the trainer turns inputs into DTensors / typed tensors per micro-batch, which the
whole-batch ``step`` cannot do (both libraries fail alike: "Got a plain Tensor under the
full_dtensor mode").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# isort: split
import torchtitan_moe as shared  # the sibling tool, first: its stubs; load_full, report
from _comm import CommCounter  # tests/, on sys.path once torchtitan_moe is imported

# isort: split
import torchtitan.distributed.fsdp as tt_fsdp
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention

import fsdp2
import fsdp2.patch

VOCAB, SEQ, DIM, HEADS, LOCAL_BATCH = 256, 32, 64, 4, 4
SCHEDULES = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"]


def llama3_config(layers: int) -> llama3.Llama3Model.Config:
    """``debugmodel`` at CPU size: dim 64, 4 heads, vocab 256, rope for ``SEQ`` positions."""
    config = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=HEADS, hidden_dim=4 * DIM,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )  # fmt: skip
    for layer in config.layers:  # FlexAttention has no CPU backward: torchtitan's causal SDPA
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def batch(step: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's slice of step ``step``'s global batch: (inputs, labels)."""
    tokens = torch.randint(VOCAB, (dp * LOCAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    mine = tokens.chunk(dp)[dp_rank]
    return mine[:, :-1], mine[:, 1:]


def run(
    args: argparse.Namespace, lib: str, dims: ParallelDims, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """``_run`` for ``lib``; fsdp2's under the launcher's rebinding for the whole run, as
    ``python -m fsdp2.patch`` has it (torch 2.15's stage reads its ``FSDPModule`` at each
    step, not only when built)."""
    with fsdp2.patch.applied() if lib == "fsdp2" else contextlib.nullcontext():
        return _run(args, lib, dims, full)


def _run(
    args: argparse.Namespace, lib: str, dims: ParallelDims, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Split, parallelize (torchtitan's functions, ``lib``'s fully_shard and stage) and train."""
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=dims.dp_shard, pipeline_parallel_degree=dims.pp,
        pipeline_parallel_schedule=args.schedule, pipeline_parallel_microbatch_size=args.microbatch_size,
        spmd_backend=dims.spmd_backend,
    )  # fmt: skip
    config = llama3_config(args.layers)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    training = TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ, mixed_precision_param="float32")
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config())
    schedule, parts, has_first, has_last = pipeline_llm(
        model, parallel_dims=dims, training=training, parallelism=parallelism,
        compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="/tmp",
        device=torch.device("cpu"), model_config=config, parallelize_fn=llama3.parallelize_llama,
        loss_fn=loss_fn,
    )  # fmt: skip
    stages = schedule._stages if hasattr(schedule, "_stages") else [schedule._stage]
    stage_types = sorted({f"{type(s).__module__}.{type(s).__name__}" for s in stages})
    for part in parts:
        for module in part.modules():  # PREMUL_SUM(1.0) is missing on gloo: plain SUM, both libraries
            if isinstance(module, (tt_fsdp.FSDPModule, fsdp2.FSDPModule)):
                module.set_force_sum_reduction_for_comms(True)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
        shared.load_full(part, full)
        part.train()
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    placements = {
        f"stage{s.stage_index}.{name}": f"{p.device_mesh.mesh_dim_names} {p.placements}"
        if isinstance(p, DTensor) else "local"
        for s, part in zip(stages, parts) for name, p in part.named_parameters()
    }  # fmt: skip
    batch_mesh, pp_mesh = dims.get_optional_mesh("batch"), dims.get_mesh("pp")  # no batch mesh at dp 1
    dp_rank, dp = (batch_mesh.get_local_rank(), batch_mesh.size()) if batch_mesh is not None else (0, 1)
    records: list[dict] = []
    for step in range(args.steps):
        inputs, labels = batch(step, dp_rank, dp)
        tokens = torch.tensor(labels.numel() * dp)  # no padding: every rank's count is the same
        losses: list[torch.Tensor] = []
        with CommCounter().active() as counter:
            schedule.step(
                *([inputs] if has_first else []), target=labels if has_last else None,
                losses=losses if has_last else None, loss_kwargs={"global_valid_tokens": tokens},
                return_outputs=False,
            )  # fmt: skip
            norm = dist_utils.clip_grad_norm_(params, max_norm=1e9, foreach=False, pp_mesh=pp_mesh)
            optimizer.step()
            optimizer.zero_grad()
        loss = torch.stack(losses).sum().detach() if has_last else torch.zeros(())
        dist.all_reduce(loss)  # the last stage's token sums over the global count, summed over dp
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, counter.calls)  # each rank holds other stages: count all ranks
        comm = dict(sorted(sum(every, Counter()).items()))
        records.append({"loss": loss.item(), "norm": norm.item(), "comm": comm})
    return {"placements": placements, "stages": stage_types, "steps": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    parser.add_argument("--microbatch-size", type=int, default=1, help="of LOCAL_BATCH=4 samples")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lib", choices=["fsdp2", "torch", "both"], default="both")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed does
    world = dist.get_world_size()
    assert world in (2, 4), "launch with --nproc-per-node 4 (pp 2 x dp 2) or 2 (pp 2)"
    dist_utils.set_spmd_backend("partial_dtensor")  # see the module doc
    dims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=2, ep=1, world_size=world, spmd_backend="partial_dtensor"
    )
    dims.build_mesh()
    torch.manual_seed(0)
    reference = llama3_config(args.layers).build()
    reference.init_weights(buffer_device=None)
    full = {k: v.detach().clone() for k, v in [*reference.named_parameters(), *reference.named_buffers()]}

    results = shared.run_libraries(run, args, dims, full)
    ok = True
    if dist.get_rank() == 0:
        print(f"== llama3 {args.schedule} pp=2 dp_shard={world // 2} layers={args.layers} "
              f"microbatches={LOCAL_BATCH // args.microbatch_size}")  # fmt: skip
        for lib, result in results.items():
            if isinstance(result, dict):
                print(f"{lib} stages: {', '.join(result['stages'])}")
        ok = shared.report(results)
        if args.json:
            saved = {"args": {k: str(v) for k, v in vars(args).items()}, **results}
            args.json.write_text(json.dumps(saved, indent=1))
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


if __name__ == "__main__":
    sys.exit(main())
