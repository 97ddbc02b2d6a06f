"""Sharded models that generate: a tiny ``LlamaForCausalLM`` (no download) at 2 ranks,
in float64, with fsdp2 and with torch's ``fully_shard`` in the same ranks.

* The marks other code reads (``_is_fsdp_managed_module``, ``_fsdp_use_orig_params``)
  are on every module ``fully_shard`` manages, so transformers' ``generate`` runs the
  ranks in lockstep (``synced_gpus``): ranks whose sequences end at different steps give
  each its unsharded model's tokens.
* No-grad forwards follow the resharding choice (a group with
  ``reshard_after_forward=False``, the root by default, stays gathered across the
  tokens): all-gathers per generation and per training step no more than torch's, for
  the wrappings HF users write (plain, accelerate's kept tail group, ``generate``
  registered as a forward method), a reference model, LoRA-style frozen bases and bf16.
* ``fsdp2.gathered``: one all-gather per group per generation, the same tokens, what
  ``held_bytes`` sees, a byte budget, an exception and a backward inside the block, and
  training after it, exact.
* TRL's GRPO step as TRL runs it (``test_trl_grpo_...``): completions of different
  lengths per rank, policy and reference log-probabilities, the loss, a step; equal to
  torch's bit for bit, and with ``register_gathered_method`` (the one line) too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _comm import CommCounter
from _dist import cached_outcome, run_scenarios
from _models import full_params, impl, tiny_llama_config

LIBS = ("fsdp2", "torch")
VOCAB, TOKENS = 64, 6
WRAPS = ("plain", "accelerate", "registered", "reference", "lora", "bf16")


def _build(seed: int = 0) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB)).double()


class _Lora(nn.Module):
    """A frozen linear plus a trainable low-rank update (what PEFT's LoRA layer computes)."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def _with_lora(model: Any) -> Any:
    model.requires_grad_(False)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _Lora(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _Lora(layer.self_attn.v_proj)
    return model


def _shard(lib: Any, model: Any, wrap: str) -> Any:
    mp = (
        lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if wrap == "bf16" else lib.MixedPrecisionPolicy()
    )
    for layer in model.model.layers:
        lib.fully_shard(layer, mp_policy=mp)
    if wrap == "accelerate":  # accelerate keeps the final norm + head gathered
        lib.fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False, mp_policy=mp)
    lib.fully_shard(model, mp_policy=mp)
    if wrap == "registered":
        lib.register_fsdp_forward_method(model, "generate")
    return model


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(10 + rank))


def _generate(model: Any, prompt: torch.Tensor, **kw: Any) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0, **kw)


def _counted(fn: Any) -> tuple[int, Any]:
    counter = CommCounter()
    with counter.active():
        out = fn()
    return counter.calls["all_gather"], out


def _train_step(model: Any, opt: torch.optim.Optimizer, seqs: torch.Tensor) -> float:
    loss = model(input_ids=seqs, labels=seqs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ------------------------------------------------------------------- scenarios
def _marks(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    from transformers.distributed.fsdp import is_fsdp_managed_module

    lib = impl(lib_name)
    model = _shard(lib, _build(), "plain")
    modules = list(model.modules())
    return {
        "managed": all(getattr(m, "_is_fsdp_managed_module", False) for m in modules),
        "orig_params": all(getattr(m, "_fsdp_use_orig_params", False) for m in modules),
        "transformers_sees": is_fsdp_managed_module(model),
    }


def _lockstep(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    """Rank 0 stops after its first token (every token id ends it), rank 1 runs all of
    them: without ``synced_gpus`` rank 1's next forwards would wait for a rank that left."""
    lib = impl(lib_name)
    ref, model = _build(), _shard(lib, _build(), "plain")
    ends = list(range(VOCAB)) if rank == 0 else [VOCAB + 1]
    got = _generate(model, _prompt(rank), eos_token_id=ends)
    want = _generate(ref, _prompt(rank), eos_token_id=ends)
    return {"equal": torch.equal(got, want), "new_tokens": got.shape[1] - 4}


def _counts(rank: int, world: int, lib_name: str, wrap: str) -> dict[str, Any]:
    """All-gathers of two generations, a training step and a generation after it."""
    lib = impl(lib_name)
    model = _build()
    if wrap == "lora":
        model = _with_lora(model)
    model = _shard(lib, model, wrap)
    ref_model = _shard(lib, _build(seed=1).requires_grad_(False), "plain") if wrap == "reference" else None
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out: dict[str, Any] = {}
    for phase in ("gen0", "gen1", "train", "gen2"):
        if phase == "train":
            seqs = torch.cat([out["tokens"]] * 2)  # the first generation's
            out[phase], loss = _counted(lambda: _train_step(model, opt, seqs))
            out["loss"] = loss
            continue
        out[phase], tokens = _counted(lambda: _generate(model, _prompt(rank)))
        out.setdefault("tokens", tokens)  # before the step (bf16 gradients differ by torch release)
        if ref_model is not None:  # GRPO's reference log-probabilities, without grad
            with torch.no_grad():
                out[phase + "_ref"], _ = _counted(lambda: ref_model(input_ids=tokens).logits)
    out["tokens"] = out["tokens"].tolist()
    return out


def _gathered(rank: int, world: int) -> dict[str, Any]:
    import fsdp2

    ref, model = _build(), _shard(fsdp2, _build(), "plain")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    prompt = _prompt(rank)
    out: dict[str, Any] = {"groups": 3}
    out["per_forward"], per_forward = _counted(lambda: _generate(model, prompt))
    seen: dict[str, Any] = {}

    def inside() -> torch.Tensor:
        with fsdp2.gathered(model):
            tokens = _generate(model, prompt)
            seen["held"] = fsdp2.held_bytes(model).get("unsharded parameters", 0)
            seen["gathered"] = sum(g.gathered_bytes() for g in _groups(model))
            return tokens

    model.reshard()  # the root, kept gathered by its own setting: the block gathers it too
    out["in_block"], tokens = _counted(inside)
    out["same_tokens"] = torch.equal(tokens, per_forward)
    out.update(seen)
    out["held_after"] = fsdp2.held_bytes(model).get("unsharded parameters", 0)
    # A budget of one block's parameters keeps the first group whose forward ends (a
    # layer); the other layer gathers per token, the root by its own setting once.
    layer = _groups(model)[0].gathered_bytes()
    out["budget"], _ = _counted(lambda: _gathered_generate(fsdp2, model, prompt, layer))
    # The one line a trainer that calls generate needs.
    fsdp2.register_gathered_method(model, "generate")
    model.reshard()
    out["registered"], tokens = _counted(lambda: _generate(model, prompt))
    out["registered_same"] = torch.equal(tokens, per_forward)
    out["raised_resharded"] = _raise_inside(fsdp2, model, prompt)
    out["both_registrations"] = _both_registrations(fsdp2, prompt)
    # A backward and a step inside the block, then training after it: exact.
    # The global batch (every rank the same), each rank its rows of it.
    seqs = torch.randint(0, VOCAB, (2 * world, 8), generator=torch.Generator().manual_seed(3))
    mine = seqs.chunk(world)[rank]
    with fsdp2.gathered(model):
        _generate(model, prompt)
        for _ in range(2):  # the second forward after a step: the kept groups gathered afresh
            _train_step(ref, opts[0], seqs), _train_step(model, opts[1], mine)
    _train_step(ref, opts[0], seqs), _train_step(model, opts[1], mine)
    got, want = full_params(model), full_params(ref)
    out["worst"] = max((got[n] - want[n]).abs().max().item() for n in want)
    # A block inside another leaves the groups to the outer one (``generate`` registered
    # and called inside the user's own block): still one gather per group.
    model.reshard()
    out["nested"], _ = _counted(lambda: _nested(fsdp2, model, prompt))
    return out


def _groups(model: nn.Module) -> list[Any]:
    from fsdp2._module import groups_under

    return groups_under(model)[::-1]  # layers first, as their forwards end first


def _nested(fsdp2: Any, model: Any, prompt: torch.Tensor) -> None:
    with fsdp2.gathered(model):
        with fsdp2.gathered(model.model.layers[0], max_bytes=0):
            _generate(model, prompt)  # registered: a third block inside
        _generate(model, prompt)


def _gathered_generate(fsdp2: Any, model: Any, prompt: torch.Tensor, max_bytes: int) -> torch.Tensor:
    with fsdp2.gathered(model, max_bytes=max_bytes):
        return _generate(model, prompt)


def _both_registrations(fsdp2: Any, prompt: torch.Tensor) -> dict[str, Any]:
    """``register_gathered_method`` first, then ``register_fsdp_forward_method`` around
    it: the block ends inside the outer forward hooks, and still reshards the blocks (the
    root stays gathered by its own setting, as without a block)."""
    from torch.distributed.tensor import DTensor

    model = _shard(fsdp2, _build(), "plain")
    fsdp2.register_gathered_method(model, "generate")
    fsdp2.register_fsdp_forward_method(model, "generate")
    gathers, tokens = _counted(lambda: _generate(model, prompt))
    blocks = all(isinstance(p, DTensor) for p in model.model.layers.parameters())
    return {"gathers": gathers, "blocks_sharded": blocks, "tokens": tokens.tolist()}


def _raise_inside(fsdp2: Any, model: Any, prompt: torch.Tensor) -> bool:
    """A forward raises in the middle of a block's generation (every rank alike): the
    block's groups are resharded when it ends."""
    from torch.distributed.tensor import DTensor

    calls = [0]

    def hook(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("stop")

    handle = model.model.layers[1].register_forward_pre_hook(hook)
    try:
        with fsdp2.gathered(model):
            _generate(model, prompt)
    except ValueError:
        pass
    finally:
        handle.remove()
    return all(isinstance(p, DTensor) for p in model.parameters()) and not fsdp2.held_bytes(model).get(
        "unsharded parameters", 0
    )


def _grpo(rank: int, world: int, variant: str) -> dict[str, Any]:
    """TRL's GRPO step, as ``GRPOTrainer`` with ``use_vllm=False`` runs it: the policy
    generates (``unwrap_model_for_generation`` is the model itself under FSDP2) under
    ``no_grad``; per-token log-probabilities of the policy and of a frozen reference
    model (``_get_per_token_logps``: ``logits_to_keep``, temperature, a selective log
    softmax); group-normalized rewards; the clipped-ratio loss with the KL term, masked
    after each completion's first end token; a step. Ranks get different prompts and
    their completions end at different steps."""
    lib = impl("fsdp2" if variant == "fsdp2-gathered" else variant)
    policy = _build()
    if variant == "fsdp2-gathered":  # the one line, as after GRPOTrainer(...): before accelerate shards
        lib.register_gathered_method(policy, "generate")
    policy, reference = _shard(lib, policy, "plain"), _shard(lib, _build().requires_grad_(False), "plain")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    generations, temperature, beta = 2, 0.9, 0.04
    ends = list(range(1, VOCAB, 4))  # end-of-sequence ids (Llama 3 has three): completions end early
    out: dict[str, Any] = {"lengths": [], "losses": [], "gathers": []}
    for step in range(2):
        prompts = torch.randint(6, VOCAB, (1, 4), generator=torch.Generator().manual_seed(100 * step + rank))
        prompts = prompts.repeat_interleave(generations, 0)
        torch.manual_seed(1000 * step + rank)
        with torch.no_grad():
            gathers, seqs = _counted(
                lambda: policy.generate(
                    prompts,
                    attention_mask=torch.ones_like(prompts),
                    do_sample=True,
                    temperature=temperature,
                    max_new_tokens=TOKENS,
                    eos_token_id=ends,
                    pad_token_id=0,
                )
            )
        out["gathers"].append(gathers)
        completions = seqs[:, prompts.shape[1] :]
        out["lengths"].append(completions.shape[1])
        is_end = torch.isin(completions, torch.tensor(ends))
        first_end = torch.where(is_end.any(1), is_end.int().argmax(1), completions.shape[1])
        mask = (torch.arange(completions.shape[1]).expand_as(completions) <= first_end[:, None]).double()
        keep = completions.shape[1]

        def logps(model: Any) -> torch.Tensor:
            logits = model(
                input_ids=seqs, attention_mask=torch.ones_like(seqs), logits_to_keep=keep + 1
            ).logits
            logits = logits[:, :-1][:, -keep:] / temperature
            return torch.gather(logits.log_softmax(-1), 2, completions[..., None]).squeeze(-1)

        with torch.no_grad():
            ref_logps = logps(reference)
        rewards = (completions == 7).double().sum(1)  # a reward function
        grouped = rewards.view(-1, generations)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(
            -1
        )
        mine = logps(policy)
        ratio = torch.exp(mine - mine.detach())
        kl = torch.exp(ref_logps - mine) - (ref_logps - mine) - 1
        per_token = -(ratio * advantages[:, None]) + beta * kl
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = full_params(policy)
    return out


@cached_outcome
def _world() -> dict[str, list[Any]]:
    scenarios: dict[str, Any] = {"gathered": (_gathered, ())}
    for variant in ("fsdp2", "torch", "fsdp2-gathered"):
        scenarios[f"grpo-{variant}"] = (_grpo, (variant,))
    for lib_name in LIBS:
        scenarios[f"marks-{lib_name}"] = (_marks, (lib_name,))
        scenarios[f"lockstep-{lib_name}"] = (_lockstep, (lib_name,))
        for wrap in WRAPS:
            scenarios[f"counts-{wrap}-{lib_name}"] = (_counts, (lib_name, wrap))
    return run_scenarios(2, scenarios, timeout=300)


@pytest.mark.parametrize("lib_name", LIBS)
def test_every_managed_module_carries_the_marks_transformers_and_dynamo_read(lib_name: str) -> None:
    for res in _world()[f"marks-{lib_name}"]:
        assert res == {"managed": True, "orig_params": True, "transformers_sees": True}


@pytest.mark.parametrize("lib_name", LIBS)
def test_generate_whose_ranks_stop_at_different_steps_runs_in_lockstep(lib_name: str) -> None:
    ranks = _world()[f"lockstep-{lib_name}"]
    assert [r["new_tokens"] for r in ranks] == [1, TOKENS], ranks
    assert all(r["equal"] for r in ranks), ranks


@pytest.mark.parametrize("wrap", WRAPS)
def test_no_more_all_gathers_than_torch_per_generation_and_training_step(wrap: str) -> None:
    world = _world()
    ours, theirs = world[f"counts-{wrap}-fsdp2"], world[f"counts-{wrap}-torch"]
    for mine, torch_s in zip(ours, theirs):
        assert mine["tokens"] == torch_s["tokens"]
        assert mine["loss"] == torch_s["loss"]
        for phase in ("gen0", "gen1", "train", "gen2", "gen0_ref", "gen1_ref", "gen2_ref"):
            assert mine.get(phase, 0) <= torch_s.get(phase, 0), (phase, mine, torch_s)
    # A group kept gathered stays so across the tokens: after the first generation only
    # the blocks gather, one each per token (torch's count, with fsdp2 as with torch).
    if wrap in ("plain", "accelerate", "registered", "lora", "bf16"):
        assert ours[0]["gen1"] == 2 * TOKENS, ours[0]


def test_gathered_generates_at_one_all_gather_per_group() -> None:
    for res in _world()["gathered"]:
        assert res["per_forward"] == 2 * TOKENS + 1, res  # the root stays gathered by its setting
        assert res["in_block"] == res["groups"] and res["same_tokens"], res
        assert res["registered"] == res["groups"] and res["registered_same"], res
        assert res["held"] == res["gathered"] > 0, res
        assert res["held_after"] == 0, res


def test_gathered_within_a_budget_keeps_what_fits() -> None:
    for res in _world()["gathered"]:
        assert res["budget"] == 1 + TOKENS + 1, res


def test_gathered_inside_the_forward_hooks_of_a_registered_generate() -> None:
    for res in _world()["gathered"]:
        both = res["both_registrations"]
        assert both == {**both, "gathers": res["groups"], "blocks_sharded": True}, both


def test_gathered_reshards_when_a_forward_raises_inside_it() -> None:
    assert all(res["raised_resharded"] for res in _world()["gathered"])


def test_backward_inside_gathered_and_training_after_it_are_exact() -> None:
    for res in _world()["gathered"]:
        assert res["worst"] <= 1e-12, res  # NaN fails the comparison


def test_a_gathered_block_inside_another_leaves_the_groups_to_the_outer_one() -> None:
    for res in _world()["gathered"]:
        assert res["nested"] == res["groups"], res


def test_gathered_refuses_a_bad_budget_before_anything_changes() -> None:
    import fsdp2

    for bad in (-1, 1.5, True, "1GiB"):
        with (
            pytest.raises(ValueError, match="number of bytes >= 0"),
            fsdp2.gathered(nn.Linear(2, 2), max_bytes=bad),
        ):
            pass
        with pytest.raises(ValueError, match="number of bytes >= 0"):
            fsdp2.register_gathered_method(nn.Linear(2, 2), "forward", max_bytes=bad)
    with pytest.raises(TypeError, match="nn.Module"), fsdp2.gathered("model"):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="no method 'generate'"):
        fsdp2.register_gathered_method(nn.Linear(2, 2), "generate")


def test_trl_grpo_with_completions_of_different_lengths_equals_torchs_bit_for_bit() -> None:
    world = _world()
    assert world["grpo-torch"][0]["lengths"] != world["grpo-torch"][1]["lengths"], world["grpo-torch"]
    for variant in ("fsdp2", "fsdp2-gathered"):  # gathered: register_gathered_method(model, "generate")
        for mine, theirs in zip(world[f"grpo-{variant}"], world["grpo-torch"]):
            assert mine["lengths"] == theirs["lengths"] and mine["losses"] == theirs["losses"], (
                variant,
                mine,
                theirs,
            )
            assert all(torch.equal(mine["params"][n], theirs["params"][n]) for n in theirs["params"]), variant
    for mine, theirs in zip(world["grpo-fsdp2-gathered"], world["grpo-torch"]):
        assert mine["gathers"] == [3, 3], mine["gathers"]  # 2 blocks + the root, once per generation
        assert all(t >= 2 * n for t, n in zip(theirs["gathers"], theirs["lengths"])), theirs
