"""``fsdp2.plan`` with no budget makes the choice people write by hand.

On Hugging Face ``LlamaForCausalLM``, ``GPT2LMHeadModel`` (tied embeddings) and
``Qwen3MoeForCausalLM`` built from tiny configs, on torchtitan's llama3 debug model and on
the example's ``Transformer`` (all float32, on the meta device):

* the plan's groups are torchtitan's ``apply_fsdp``: the embeddings, each block resharded
  after forward, ``[norm, lm_head]`` kept gathered (``[embeddings, norm, lm_head]`` kept
  gathered when tied), then the root. Compared on the sharded models: for every
  ``fully_shard`` group, its modules, the parameters it manages and its
  ``reshard_after_forward``, for ``plan.apply`` and for the hand-written calls, and both
  against ``plan.groups``. torchtitan's model is sharded by torchtitan's own
  ``apply_fsdp_to_decoder`` (with fsdp2's ``fully_shard`` in place of torch's); the others
  by the same sequence written out here;
* on the Hugging Face models, the plan's blocks are the modules accelerate's
  transformer-based policy (``fsdp2_prepare_auto_wrap_policy``) wraps;
* one training step (forward, loss, backward, AdamW step) of each sharding at 4 ranks on
  torch's fake process group (``DryRun.measure``, as ``fsdp2.plan(inputs=...)`` runs it)
  issues the same collectives, in the same order with the same bytes, and the tracked
  peaks are within 2% (they come out equal).

A hand-written choice with one block left to the root is told apart (groups,
collectives), once, so the comparison can fail.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _comm import CommCounter
from torch import nn

import fsdp2
from fsdp2.planning import Plan
from fsdp2.planning.dryrun import DryRun, meta_copy

WORLD = 4
PEAK_TOLERANCE = 0.02
BATCH, SEQ, VOCAB = 2, 16, 128

Shard = Callable[[nn.Module, Any], None]  # the hand-written calls: (model, mesh)


@dataclass
class Case:
    model: nn.Module  # on the meta device
    inputs: Any  # one local batch (meta)
    hand: Shard
    mp_policy: Any
    hf: bool = False


# ----------------------------------------------------------------- the hand-written calls
def titan_style(model: nn.Module, mesh: Any, mp_policy: Any, *, embeddings: list[nn.Module],
                blocks: nn.Module, norm: nn.Module, head: nn.Module) -> None:
    """torchtitan's ``apply_fsdp`` (``experiments/transformers_modeling_backend``) at its
    default policy, written out: the embeddings (with the norm and the head when the head's
    weight is the embedding's, kept gathered), each block, ``[norm, head]`` kept gathered,
    the root."""
    fully_shard = fsdp2.fully_shard
    kwargs = {"mesh": mesh, "mp_policy": mp_policy}
    tied = any(head.weight is e.weight for e in embeddings)
    if tied:
        fully_shard([*embeddings, norm, head], **kwargs, reshard_after_forward=False)
    else:
        first = embeddings[0] if len(embeddings) == 1 else embeddings
        fully_shard(first, **kwargs, reshard_after_forward=True)
    for block in blocks:
        fully_shard(block, **kwargs, reshard_after_forward=True)
    if not tied:
        fully_shard([norm, head], **kwargs, reshard_after_forward=False)
    fully_shard(model, **kwargs)


def _tokens() -> torch.Tensor:
    return torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")


# ---------------------------------------------------------------------------- the models
def hf_llama(monkeypatch: pytest.MonkeyPatch) -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")
    return _hf_decoder(LlamaForCausalLM, config)


def hf_gpt2(monkeypatch: pytest.MonkeyPatch) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # GPT-2 ties them
    mp = fsdp2.MixedPrecisionPolicy()

    def hand(m: nn.Module, mesh: Any) -> None:
        t = m.transformer
        titan_style(m, mesh, mp, embeddings=[t.wte, t.wpe], blocks=t.h, norm=t.ln_f, head=m.lm_head)

    ids = _tokens()
    return Case(model, {"input_ids": ids, "labels": ids}, hand, mp, hf=True)


def hf_qwen3_moe(monkeypatch: pytest.MonkeyPatch) -> Case:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # experts_implementation: the default, "grouped_mm", does not run on the meta device in
    # float32 (torch's meta kernel of _grouped_mm asks for bfloat16); "eager" needs
    # nonzero(), which has no meta kernel. "batched_mm" runs.
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            attn_implementation="sdpa", experts_implementation="batched_mm")
    return _hf_decoder(Qwen3MoeForCausalLM, config)


def _hf_decoder(model_class: Any, config: Any) -> Case:
    """A Hugging Face decoder (``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``lm_head``) on meta, with torchtitan's calls written out for it."""
    with torch.device("meta"):
        model = model_class(config)
    mp = fsdp2.MixedPrecisionPolicy()

    def hand(m: nn.Module, mesh: Any) -> None:
        titan_style(m, mesh, mp, embeddings=[m.model.embed_tokens], blocks=m.model.layers, norm=m.model.norm,
                    head=m.lm_head)

    ids = _tokens()
    return Case(model, {"input_ids": ids, "labels": ids}, hand, mp, hf=True)


def torchtitan_llama3_debug(monkeypatch: pytest.MonkeyPatch) -> Case:
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (not among the test extras)")
    if importlib.util.find_spec("triton") is None:
        # torchtitan.models.common imports its expert-parallel token dispatch, whose kernels
        # import triton at module level; a dense llama3 never calls them.
        stub = types.ModuleType("torchtitan.distributed.minimal_async_ep")
        for name in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config",
                     "MinimalAsyncEPDispatchMetadata"):
            setattr(stub, name, None)
        monkeypatch.setitem(sys.modules, stub.__name__, stub)
    try:
        import torchtitan.distributed.fsdp as titan_fsdp
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.llama3 import model_registry
    except ModuleNotFoundError as e:  # torchtitan installed without its dependencies
        pytest.skip(f"torchtitan's llama3 does not import here: {e}")

    spec = model_registry("debugmodel")
    # The debug model's flex attention runs compiled (inductor, minutes on CPU); torchtitan's
    # SDPA inner attention has no parameters either, so the groups are the same.
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = spec.model.build()
    # torchtitan's own apply_fsdp_to_decoder, with fsdp2's classes in place of torch's.
    for name in ("fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "FSDPModule"):
        monkeypatch.setattr(titan_fsdp, name, getattr(fsdp2, name))

    def hand(m: nn.Module, mesh: Any) -> None:
        titan_fsdp.apply_fsdp_to_decoder(m, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                                         pp_enabled=False)

    # the policy apply_fsdp_to_decoder builds, given to the plan too
    mp = fsdp2.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    return Case(model, (_tokens(),), hand, mp)


def example_transformer(monkeypatch: pytest.MonkeyPatch) -> Case:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    from model import ModelArgs, Transformer

    with torch.device("meta"):
        model = Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                      max_seq_len=64))
    mp = fsdp2.MixedPrecisionPolicy()

    def hand(m: nn.Module, mesh: Any) -> None:
        titan_style(m, mesh, mp, embeddings=[m.tok_embeddings], blocks=m.layers, norm=m.norm, head=m.output)

    return Case(model, (_tokens(),), hand, mp)


CASES = {f.__name__: f
         for f in (hf_llama, hf_gpt2, hf_qwen3_moe, torchtitan_llama3_debug, example_transformer)}


# ------------------------------------------------------------------------------ helpers
Units = dict[frozenset[str], tuple[frozenset[str], Any]]


def units(model: nn.Module) -> Units:
    """Every ``fully_shard`` group of a sharded model: its modules' fqns -> (the fqns of the
    parameters it manages, its ``reshard_after_forward`` argument)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), n)
    groups: dict[int, tuple[Any, list[str]]] = {}
    for n, m in model.named_modules():
        state = m.__dict__.get("_fsdp2_state")
        if state is not None:
            assert isinstance(m, fsdp2.FSDPModule), n
            groups.setdefault(id(state.group), (state.group, []))[1].append(n)
    out: Units = {}
    for group, modules in groups.values():
        fqns = frozenset(names[id(fp.sharded)] for fp in group.params)
        out[frozenset(modules)] = (fqns, group.settings.reshard_after_forward)
    return out


def planned_units(plan: Plan) -> Units:
    return {frozenset(g.modules): (frozenset(g.fqns), g.reshard_after_forward) for g in plan.groups}


class HandWritten(Plan):
    """The hand-written calls as something ``DryRun.measure`` applies as it applies a plan
    (``measure`` copies it, sets the dry run's mesh and calls ``apply``): the same tracked
    step around other calls."""

    def __init__(self, shard: Shard) -> None:  # measure reads no other field of a Plan
        self.shard = shard
        self.mesh = None
        self.groups = []  # settings() of a hand-written sharding: none the planner chose

    def apply(self, model: nn.Module, fully_shard: Any = None) -> nn.Module:
        self.shard(model, self.mesh)
        return model


@contextlib.contextmanager
def fake_world() -> Iterator[Any]:
    """Torch's fake process group at the job's size and a meta mesh over it, as the dry run
    makes them (outside any dry run: one process group at a time)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("meta", (WORLD,))
    finally:
        dist.destroy_process_group()


def shard_both(plan: Plan, hand: Shard, template: nn.Module) -> tuple[Units, Units]:
    """The groups of ``plan.apply`` and of the hand-written calls, each on a meta copy of
    ``template`` over a meta mesh of the job's size."""
    with fake_world() as mesh:
        twin = copy.copy(plan)
        twin.mesh = mesh
        by_plan = twin.apply(meta_copy(template))
        by_hand = meta_copy(template)
        hand(by_hand, mesh)
        return units(by_plan), units(by_hand)


def step(run: DryRun, plan: Plan) -> tuple[Any, CommCounter]:
    """One tracked training step of ``plan`` and the collectives it issued."""
    counter = CommCounter()
    with counter.active():
        estimate = run.measure(plan)
    return estimate, counter


def accelerate_blocks(model: nn.Module) -> list[str]:
    """The modules accelerate's FSDP2 transformer-based auto wrap policy wraps."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = types.SimpleNamespace(auto_wrap_policy=transformer_auto_wrap_policy,
                                   transformer_cls_names_to_wrap=None, min_num_params=0)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return [n for n, m in model.named_modules() if n and policy(m)]


# -------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_plan_is_the_hand_written_choice(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name](monkeypatch)
    plan = fsdp2.plan(case.model, world_size=WORLD, mp_policy=case.mp_policy, inputs=case.inputs)
    assert plan.estimate is not None
    kinds = [g.kind for g in plan.groups]
    blocks = [g.modules[0] for g in plan.groups if g.kind == "block"]
    assert kinds[-1] == "root" and len(blocks) >= 2, plan
    if case.hf:
        assert blocks == accelerate_blocks(case.model), plan

    got, want = shard_both(plan, case.hand, case.model)
    with DryRun(case.model, (WORLD,), None, case.inputs, None, None) as run:
        hand_estimate, hand_comm = step(run, HandWritten(case.hand))
        plan_estimate, plan_comm = step(run, plan)

    # 1. The groups: plan.apply's equal the hand-written calls' and what plan.groups says.
    assert got == want, f"{plan}\nplan.apply: {got}\nhand-written: {want}"
    assert got == planned_units(plan), plan
    managed = [f for fqns, _ in got.values() for f in fqns]
    assert sorted(managed) == sorted(n for n, _ in case.model.named_parameters())  # each once

    # 2. The same collectives, in the same order with the same bytes; the same peak.
    assert plan_comm.calls["all_gather"] > 0 and plan_comm.calls["reduce"] > 0
    assert plan_comm.log == hand_comm.log, (plan_comm.calls, hand_comm.calls)
    assert abs(plan_estimate.peak - hand_estimate.peak) <= PEAK_TOLERANCE * hand_estimate.peak, (
        plan_estimate.peak, hand_estimate.peak)
    # The estimate fsdp2.plan attached is this same step's.
    assert plan.estimate.peak == plan_estimate.peak


def test_a_different_hand_written_choice_is_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: the last block left to the root's call (which keeps it
    gathered from forward to backward) is another group layout and one all-gather fewer."""
    case = example_transformer(monkeypatch)
    plan = fsdp2.plan(case.model, world_size=WORLD, mp_policy=case.mp_policy)

    def merged(m: nn.Module, mesh: Any) -> None:
        mp = case.mp_policy
        fsdp2.fully_shard(m.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        for block in list(m.layers)[:-1]:
            fsdp2.fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fsdp2.fully_shard([m.norm, m.output], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        fsdp2.fully_shard(m, mesh=mesh, mp_policy=mp)

    got, other = shard_both(plan, merged, case.model)
    with DryRun(case.model, (WORLD,), None, case.inputs, None, None) as run:
        _, merged_comm = step(run, HandWritten(merged))
        _, plan_comm = step(run, plan)
    assert got != other
    assert frozenset({"layers.1"}) in got and frozenset({"layers.1"}) not in other
    assert plan_comm.log != merged_comm.log
    assert merged_comm.calls["all_gather"] == plan_comm.calls["all_gather"] - 1, (
        plan_comm.calls, merged_comm.calls)
