"""Hugging Face transformers: a tiny ``LlamaForCausalLM`` (from a ``LlamaConfig``, no
download) with ``fully_shard`` on each decoder layer and the root, at 2 ranks in float64,
with fsdp2 and with torch's ``fully_shard`` in the same ranks: trains at parity with the
unsharded model on the global batch, also with HF's own ``gradient_checkpointing_enable()``;
the tied embedding stays tied; ``generate()`` after training (through
``register_fsdp_forward_method``) gives the unsharded model's tokens; a full state dict
written with ``save_pretrained`` loads back with ``from_pretrained`` into an unsharded
model with the same parameters."""

from __future__ import annotations

import functools
import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _models import full_params, impl

LIBS = ("fsdp2", "torch")
CASES = {"plain": False, "hf_gradient_checkpointing": True}


def _config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
    )


def _build() -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).double()


def _run(lib: Any, rank: int, world: int, checkpointing: bool, save_dir: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM

    ref, model = _build(), _build()
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HF's deprecation notice for the old name
            for m in (ref, model):
                m.gradient_checkpointing_enable()
                m.train()
    for layer in model.model.layers:
        lib.fully_shard(layer)
    lib.fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for step in range(3):
        ids = torch.randint(0, 64, (2 * world, 12), generator=torch.Generator().manual_seed(step))
        ref(input_ids=ids, labels=ids).loss.backward()
        mine = ids.chunk(world)[rank]
        model(input_ids=mine, labels=mine).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    out: dict[str, Any] = {
        "worst": max((got[n] - want[n]).abs().max().item() for n in want),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }
    lib.register_fsdp_forward_method(model, "generate")
    model.eval()
    ref.eval()
    prompt = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(9))
    out["generate_same"] = torch.equal(
        model.generate(prompt, max_new_tokens=5, do_sample=False), ref.generate(prompt, max_new_tokens=5, do_sample=False)
    )
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(save_dir, state_dict=full)
    torch.distributed.barrier()
    loaded = LlamaForCausalLM.from_pretrained(save_dir, torch_dtype=torch.float64)
    back = full_params(loaded)
    out["round_trip"] = list(back) == list(got) and all(torch.equal(back[n], got[n]) for n in got)
    torch.distributed.barrier()
    return out


def _worker(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    return {
        lib_name: {
            name: _run(impl(lib_name), rank, world, checkpointing, os.path.join(root, f"{lib_name}-{name}"))
            for name, checkpointing in CASES.items()
        }
        for lib_name in LIBS
    }


@functools.cache
def _spawned() -> list[dict[str, dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_worker, 2, root, timeout=400)


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("case", list(CASES))
def test_llama_trains_generates_and_round_trips(lib_name: str, case: str) -> None:
    for out in _spawned():
        res = out[lib_name][case]
        assert res["worst"] <= 1e-12, res
        assert res == {"worst": res["worst"], "tied": True, "generate_same": True, "round_trip": True}, res
