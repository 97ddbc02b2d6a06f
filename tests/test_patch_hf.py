"""Real clients through ``fsdp2.patch``, unchanged: accelerate's ``Accelerator`` with its
FSDP2 plugin (``prepare``, ``backward``, ``clip_grad_norm_``, ``get_state_dict``,
``save_model``) and Hugging Face's ``Trainer`` with ``fsdp_config={"version": 2}``, on a
tiny Llama (from a ``LlamaConfig``, no download) in float64, 2 ranks. Each runs once on
torch's ``fully_shard`` and once under ``fsdp2.patch.apply()`` in the same ranks: the
per-step losses agree within 1e-5 relative, the saved weights within 1e-9, and every
module accelerate sharded is torch's in the first run and fsdp2's in the second.

accelerate 1.15 turns FSDP on only for accelerator devices: on CPU it keeps
``DistributedType.MULTI_CPU`` and silently wraps the model in DDP instead, with either
library. ``_fsdp_on_cpu`` does for CPU what accelerate's ``AcceleratorState.__init__``
does for accelerator devices when given an FSDP plugin (``distributed_type = FSDP``, the
plugin kept, ``PartialState``'s type updated); both libraries run with it."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
from typing import Any

import pytest
import torch
from _comm import CommCounter
from _dist import run_ranks

import fsdp2
import fsdp2.patch

LIBS = ("torch", "fsdp2")
STEPS = 3


def _fsdp_on_cpu() -> None:
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def _sharded_by(model: torch.nn.Module) -> list[str]:
    """Which library sharded each sharded module: ``fsdp2`` (our state marker), ``torch``."""
    import torch.distributed.fsdp._fully_shard._fully_shard as torch_impl  # torch's class, never rebound

    out = []
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule) and "_fsdp2_state" in m.__dict__:
            out.append("fsdp2")
        elif isinstance(m, torch_impl.FSDPModule):
            out.append("torch")
    return out


def _saved(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def _accelerate(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="FULL_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    losses, gathers = [], []
    for step in range(STEPS):
        ids = torch.randint(0, 64, (2 * world, 12), generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
        with CommCounter().active() as counter:  # accelerate's grouping of a tied model
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
        gathers.append(counter.calls["all_gather"])
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = accelerator.get_state_dict(model)
    accelerator.save_model(model, out_dir)
    accelerator.wait_for_everyone()
    return {
        "losses": losses, "sharded_by": _sharded_by(model), "fsdp2": accelerator.is_fsdp2, "keys": sorted(state),
        "gathers": gathers,
    }


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _trainer(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, report_to=[],
        save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=_model(), args=args, train_dataset=_Tokens())
    trainer.train()
    trainer.save_model()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "sharded_by": _sharded_by(trainer.model_wrapped), "fsdp2": trainer.accelerator.is_fsdp2}


def _worker(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    from accelerate.state import AcceleratorState

    _fsdp_on_cpu()
    out: dict[str, dict[str, Any]] = {}
    for client, run in (("accelerate", _accelerate), ("trainer", _trainer)):
        for lib in LIBS:
            directory = os.path.join(root, f"{client}-{lib}")
            with fsdp2.patch.applied() if lib == "fsdp2" else contextlib.nullcontext():
                out[f"{client}-{lib}"] = run(rank, world, directory)
            AcceleratorState._reset_state(reset_partial_state=True)
        torch.distributed.barrier()
        if rank == 0:
            mine, theirs = _saved(os.path.join(root, f"{client}-fsdp2")), _saved(os.path.join(root, f"{client}-torch"))
            errors = [((mine[k] - theirs[k]).abs() / (1e-12 + 1e-9 * theirs[k].abs())).max().item() for k in theirs]
            initial = _model().state_dict()
            out[client + "-saved"] = {
                "same_keys": sorted(mine) == sorted(theirs),
                "trained": any(not torch.equal(mine[k], initial[k]) for k in mine),
                "worst": max(math.inf if math.isnan(e) else e for e in errors),  # NaN is a mismatch
            }
    return out


@functools.cache
def _spawned() -> list[dict[str, dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_worker, 2, root, timeout=400)


@pytest.mark.parametrize("client", ["accelerate", "trainer"])
def test_client_at_parity_with_torch_and_sharded_by_fsdp2(client: str) -> None:
    results = _spawned()
    for rank, out in enumerate(results):
        theirs, mine = out[f"{client}-torch"], out[f"{client}-fsdp2"]
        assert theirs["fsdp2"] and mine["fsdp2"], (rank, out)  # accelerate took its FSDP2 path both times
        assert theirs["sharded_by"] and set(theirs["sharded_by"]) == {"torch"}, (rank, theirs)
        assert len(mine["sharded_by"]) == len(theirs["sharded_by"]) and set(mine["sharded_by"]) == {"fsdp2"}, (rank, mine)
        assert len(mine["losses"]) == len(theirs["losses"]) == STEPS, (rank, out)
        for a, b in zip(mine["losses"], theirs["losses"]):
            assert not math.isnan(a) and abs(a - b) <= 1e-5 * abs(b), (rank, mine["losses"], theirs["losses"])
        if client == "accelerate":
            assert mine["keys"] == theirs["keys"], (rank, mine["keys"], theirs["keys"])
            # Each decoder layer, [final norm, embed_tokens, lm_head] kept gathered, the root.
            assert all(0 < m <= t for m, t in zip(mine["gathers"], theirs["gathers"])), (rank, mine["gathers"], theirs["gathers"])
    saved = results[0][client + "-saved"]
    assert saved["same_keys"] and saved["trained"] and saved["worst"] <= 1.0, saved
