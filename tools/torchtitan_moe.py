"""Run torchtitan 0.3.0's own MoE parallelize code with fsdp2 in place of torch's ``fully_shard``.

Builds torchtitan's qwen3 MoE or deepseek_v3 debug model, shrunk for CPU, through torchtitan's
own config builders; parallelizes it with the model's own ``parallelize_qwen3`` /
``parallelize_deepseekv3`` (expert parallel, activation checkpointing, then torchtitan's
``apply_fsdp_to_decoder``, which hands ``fully_shard`` a ``shard_placement_fn`` returning torch's
``ShardPlacementResult`` when ep > 1); trains a few steps with torchtitan's loss scaled by the
global token count and its ``clip_grad_norm_``; and does it once with torch's ``fully_shard`` and
once under ``fsdp2.patch.applied()`` (what ``python -m fsdp2.patch`` does: no other swap), from the
same weights and batches. Prints loss, grad norm and c10d collectives per step for both, and exits 1 when a
relative difference exceeds 1e-4, a parameter's mesh or placements differ, or fsdp2 issues more
collectives of some kind than torch. Collectives are those of ``tests/_comm.py`` (the
``ProcessGroup`` methods FSDP calls); expert parallel's functional all-to-alls are not counted.
For CPU: torchtitan's causal SDPA module (FlexAttention has no CPU backward), and SUM reductions
(``set_force_sum_reduction_for_comms``: torch's PREMUL_SUM is missing on gloo) in both runs.

    torchrun --standalone --nproc-per-node 4 tools/torchtitan_moe.py --model qwen3 --ep 2

torchtitan was installed with ``--no-deps``: its pure-Python imports ``tyro``, ``docstring-parser``,
``typeguard``, ``spmd_types==0.2.3`` must be importable (``pip install --no-deps --target DIR ...``
and ``PYTHONPATH=DIR``). Two modules only its other paths need are stubbed when they fail to import:
the triton kernels of the MinimalAsyncEP dispatcher (unused here) and ``torchtitan.trainer``
(``update_from_config`` imports it only for an ``isinstance`` check).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import spmd_types as spmd
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _comm import CommCounter

WORLD, VOCAB, SEQ, LOCAL_BATCH, DIM, TOL = 4, 256, 32, 2, 64, 1e-4


def _stub_module(name: str, **attrs: Any) -> None:
    """Put a stand-in for ``name`` in ``sys.modules`` if the real one fails to import."""
    try:
        __import__(name)
    except ImportError:
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


def _triton_kernel(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def kernel(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"torchtitan's MinimalAsyncEP kernel {name} needs triton")

    return kernel


_stub_module("torchtitan.distributed.minimal_async_ep.kernels", __getattr__=_triton_kernel)
_stub_module("torchtitan.trainer", Trainer=type("Trainer", (), {"Config": type("Config", (), {})}))

import torchtitan.distributed.fsdp as tt_fsdp
import torchtitan.distributed.parallel_dims as tt_parallel_dims
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import full_dtensor
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.spmd_types import annotate_input_spmd_types
from torchtitan.models import deepseek_v3, llama3, qwen3
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention

import fsdp2
import fsdp2.patch

tt_parallel_dims.device_type = "cpu"  # torchtitan falls back to "cuda" when no accelerator is found


class _GlooDist(types.ModuleType):
    """``torch.distributed`` as spmd_types' collectives see it (``spmd_types.set_dist``),
    with a list all-to-all of uneven pieces (expert parallel's token exchange under the
    spmd_types backend) run as one ``all_to_all_single`` with splits: gloo's list
    all-to-all takes equal sizes only. Both libraries' runs use it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_to_all(outputs: list, inputs: list, group: Any = None, async_op: bool = False) -> Any:
        if async_op:
            raise NotImplementedError("the tool's gloo all_to_all is synchronous")
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = flat_in.new_empty(sum(t.numel() for t in outputs))
        dist.all_to_all_single(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs],
                               group=group)  # fmt: skip
        for t, piece in zip(outputs, flat_out.split([t.numel() for t in outputs])):
            t.copy_(piece.view_as(t))
        return None


spmd.set_dist(_GlooDist("torch.distributed"))


def qwen3_config(experts: int, layers: int, attn: str) -> qwen3.Qwen3Model.Config:
    """``_debugmodel_moe`` at CPU size."""
    head_dim = 16
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=qwen3._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=head_dim,
            moe_hidden_dim=32, num_experts=experts, top_k=2, attn_backend=attn, moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
        ),
    )  # fmt: skip


def deepseek_v3_config(experts: int, layers: int, attn: str) -> deepseek_v3.DeepSeekV3Model.Config:
    """deepseek_v3's ``_debugmodel`` (MLA, one dense layer first, shared experts) at CPU size."""
    rope_dim = 8
    rope = ComplexRoPE.Config(
        dim=rope_dim, max_seq_len=SEQ, theta=10000.0, scaling="yarn", rope_factor=40.0,
        beta_fast=32.0, beta_slow=1.0, original_seq_len=SEQ // 2,
    )  # fmt: skip
    blocks = deepseek_v3._build_dsv3_layers(
        n_layers=layers, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=experts, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
        attn_backend=attn, moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope,
    )  # fmt: skip
    return deepseek_v3.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=deepseek_v3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=deepseek_v3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=deepseek_v3._output_linear_init(DIM)
        ),
        layers=blocks,
        mtp_layers=[],
    )


def llama3_config(experts: int, layers: int, attn: str) -> llama3.Llama3Model.Config:
    """llama3's ``_debugmodel`` (dense) at CPU size; ``experts`` is unused."""
    head_dim = 16
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=layers, dim=DIM, n_heads=4, hidden_dim=128, attn_backend=attn,
            rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=500000, scaling="llama"),
        ),
    )  # fmt: skip


MODELS = {
    "llama3": (llama3_config, llama3.parallelize_llama),
    "qwen3": (qwen3_config, qwen3.parallelize_qwen3),
    "deepseek_v3": (deepseek_v3_config, deepseek_v3.parallelize_deepseekv3),
}


def model_config(args: argparse.Namespace, parallelism: ParallelismConfig) -> Any:
    """The shrunk config, with the sharding plan ``update_from_config`` fills in."""
    config = MODELS[args.model][0](args.experts, args.layers, "flex")
    # FlexAttention has no backward on CPU and get_attention_config refuses "sdpa" for LMs:
    # torchtitan's own causal SDPA module, set directly.
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return config


def load_full(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Overwrite every (possibly sharded) parameter and buffer with its slice of ``full``."""
    states = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for name, tensor in states.items():
            source = full[name.replace("_checkpoint_wrapped_module.", "")]
            if isinstance(tensor, DTensor):
                shape, offset = compute_local_shape_and_global_offset(
                    source.shape, tensor.device_mesh, tensor.placements
                )
                source = source[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
                tensor = tensor.to_local()
            tensor.copy_(source)


def batch(step: int, dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's slice of step ``step``'s global batch: (inputs, labels);
    the tensor-parallel ranks of one data-parallel rank take the same slice."""
    replicas = WORLD // dims.tp
    tokens = torch.randint(
        VOCAB, (replicas * LOCAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step)
    )
    mine = tokens.chunk(replicas)[dist.get_rank() // dims.tp]  # torchtitan's mesh: tp innermost
    return mine[:, :-1], mine[:, 1:]


def prepare(dims: ParallelDims, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[Any, Any, dict]:
    """The trainer's ``post_dataloading_process`` for the SPMD backend: (inputs, labels, model kwargs)."""
    kwargs = {"positions": torch.arange(SEQ).expand(LOCAL_BATCH, SEQ)}
    if dims.spmd_backend == "full_dtensor":
        return full_dtensor.parallelize_inputs(dims, inputs, labels, kwargs)
    if dims.spmd_backend == "spmd_types":
        return annotate_input_spmd_types(dims, inputs, labels, kwargs)
    return inputs, labels, kwargs


def run(
    args: argparse.Namespace, lib: str, dims: ParallelDims, full: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Build, parallelize (torchtitan's function, ``lib``'s fully_shard) and train ``args.steps`` steps."""
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=dims.dp_replicate, data_parallel_shard_degree=dims.dp_shard,
        tensor_parallel_degree=dims.tp, expert_parallel_degree=dims.ep, spmd_backend=args.spmd_backend,
    )  # fmt: skip
    config = model_config(args, parallelism)
    with torch.device("meta"):
        model = config.build()
    training = TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ, mixed_precision_param=args.param_dtype)
    with fsdp2.patch.applied() if lib == "fsdp2" else contextlib.nullcontext():  # the launcher's rebinding
        model = MODELS[args.model][1](
            model, parallel_dims=dims, training=training, parallelism=parallelism,
            compile_config=CompileConfig(enable=False), ac_config=FullAC.Config() if args.ac else None,
            dump_folder="/tmp",
        )  # fmt: skip
    # torchtitan sets gradient_divide_factor 1.0; torch then reduce-scatters float32 with
    # PREMUL_SUM(1.0), which gloo lacks. Plain SUM (then * 1.0) is the same reduction: both libraries.
    for module in model.modules():
        if isinstance(module, (tt_fsdp.FSDPModule, fsdp2.FSDPModule)):
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # torchtitan's init, then the shared weights
    load_full(model, full)
    model.train()
    loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))  # spmd_types' loss-parallel CE
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=args.foreach)
    placements = {
        name: f"{p.device_mesh.mesh_dim_names} {p.placements}" if isinstance(p, DTensor) else "local"
        for name, p in model.named_parameters()
    }
    train_context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=args.typecheck)
    records: list[dict] = []
    for step in range(args.steps):
        inputs, labels = batch(step, dims)
        tokens = torch.tensor(labels.numel() * WORLD // dims.tp)  # the global count (equal batches)
        inputs, labels, kwargs = prepare(dims, inputs, labels)
        with CommCounter().active() as counter:
            with train_context():  # as torchtitan's forward_backward_step: the step outside it
                loss, _ = loss_fn(model(inputs, **kwargs), labels, tokens)
                with spmd.no_typecheck():
                    loss.backward()
            norm = dist_utils.clip_grad_norm_(
                list(model.parameters()), max_norm=1e9, foreach=args.foreach, ep_enabled=dims.ep_enabled
            )
            optimizer.step()
            optimizer.zero_grad()
        global_loss = (loss.to_local() if isinstance(loss, DTensor) else loss).detach().clone()
        # each data-parallel rank's loss is its token sum over the global count (the same
        # on the tensor-parallel ranks of one data-parallel rank)
        dist.all_reduce(global_loss)
        global_loss /= dims.tp
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        comm = dict(sorted(counter.calls.items()))
        records.append({"loss": global_loss.item(), "norm": norm.item(), "comm": comm})
    return {"placements": placements, "steps": records}


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def report(results: dict[str, Any]) -> bool:
    """Print the per-step table (or each run that failed); True when fsdp2 matches torch."""
    for lib, result in results.items():
        if isinstance(result, str):
            print(f"{lib} FAILED:\n{result}")
    torch_run, fsdp2_run = results.get("torch"), results.get("fsdp2")
    if not isinstance(torch_run, dict) or not isinstance(fsdp2_run, dict):
        for lib, result in results.items():
            for step, r in enumerate(result["steps"] if isinstance(result, dict) else []):
                print(f"{lib} step {step}: loss {r['loss']:.8f} norm {r['norm']:.8f} comm {r['comm']}")
        return not isinstance(fsdp2_run, str)
    differ = {n: (p, fsdp2_run["placements"].get(n)) for n, p in torch_run["placements"].items()}
    differ = {n: pair for n, pair in differ.items() if pair[0] != pair[1]}
    for name, (theirs, mine) in differ.items():
        print(f"placement differs: {name}: torch {theirs}, fsdp2 {mine}")
    ok = not differ and len(torch_run["placements"]) == len(fsdp2_run["placements"])
    print(f"{'step':>4} {'loss torch':>12} {'loss fsdp2':>12} {'rel':>8} {'norm torch':>12} {'norm fsdp2':>12} "
          f"{'rel':>8}  collectives torch | fsdp2")  # fmt: skip
    for step, (t, f) in enumerate(zip(torch_run["steps"], fsdp2_run["steps"])):
        dl, dn = rel(t["loss"], f["loss"]), rel(t["norm"], f["norm"])
        more = [k for k in f["comm"] if f["comm"][k] > t["comm"].get(k, 0)]
        ok &= dl <= TOL and dn <= TOL and not more
        print(f"{step:>4} {t['loss']:>12.8f} {f['loss']:>12.8f} {dl:>8.1e} {t['norm']:>12.8f} {f['norm']:>12.8f} "
              f"{dn:>8.1e}  {t['comm']} | {f['comm']}" + (f"  MORE {more}" if more else ""))  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree (llama3)")
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="torchtitan's mixed_precision_param (reduce stays float32)")
    parser.add_argument("--typecheck", action="store_true",
                        help="forward under spmd_types' type checking (spmd_types backend)")
    parser.add_argument("--ac", action="store_true", help="torchtitan's full activation checkpointing")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lib", choices=["fsdp2", "torch", "both"], default="both")
    parser.add_argument("--spmd-backend", choices=["partial_dtensor", "full_dtensor", "spmd_types"],
                        default="partial_dtensor")  # fmt: skip
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--foreach", action="store_true", help="foreach AdamW and clipping")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.autograd.set_multithreading_enabled(False)  # as torchtitan's init_distributed does
    dist_utils.set_spmd_backend(args.spmd_backend)
    assert dist.get_world_size() == WORLD, "launch with --nproc-per-node 4"
    dims = ParallelDims(
        dp_replicate=args.dp_replicate, dp_shard=-1, cp=1, tp=args.tp, pp=1, ep=args.ep,
        world_size=WORLD, spmd_backend=args.spmd_backend,
    )  # fmt: skip
    dims.build_mesh()
    torch.manual_seed(0)
    reference = model_config(args, ParallelismConfig()).build()
    reference.init_weights(buffer_device=None)
    full = {k: v.detach().clone() for k, v in [*reference.named_parameters(), *reference.named_buffers()]}

    results = run_libraries(run, args, dims, full)
    ok = True
    if dist.get_rank() == 0:
        print(f"== {args.model} ep={args.ep} tp={args.tp} dp_replicate={args.dp_replicate} ac={args.ac} "
              f"spmd_backend={args.spmd_backend} param_dtype={args.param_dtype} typecheck={args.typecheck} "
              f"experts={args.experts}")  # fmt: skip
        ok = report(results)
        if args.json:
            args.json.write_text(
                json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}, indent=1)
            )
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 0 if flag.item() else 1


def run_libraries(run: Any, args: Any, dims: Any, full: dict) -> dict[str, Any]:
    """``run(args, lib, dims, full)`` for torch's ``fully_shard`` then fsdp2 (or the one
    ``--lib`` names): each library's result, or the traceback of its failure."""
    results: dict[str, Any] = {}
    for lib in ["torch", "fsdp2"] if args.lib == "both" else [args.lib]:
        if dist.get_rank() == 0:
            print(f"-- {lib} run", file=sys.stderr, flush=True)  # tells which run a crash hit
        try:
            results[lib] = run(args, lib, dims, full)
        except Exception:  # noqa: BLE001 - reported, and the other library still runs
            results[lib] = traceback.format_exc()
            # now: a peer waiting on this rank's pipeline sends may hang before the report
            print(f"rank {dist.get_rank()} {lib} FAILED:\n{results[lib]}", file=sys.stderr, flush=True)
        dist.barrier()
    return results


if __name__ == "__main__":
    sys.exit(main())
