"""Argument values torch's ``fully_shard`` and ``FSDPModule`` methods accept, which fsdp2
accepts with the same meaning: each case runs with fsdp2 and with torch's ``fully_shard``
in the same 2 gloo ranks (a step of a two-block model in float64, a second step after
the value is set) and gives the same gradients. Values torch accepts only to fail
later, or to mean something nobody would write (``offload_policy=object()``,
``set_requires_gradient_sync(None)``, a set of modules whose order differs between
ranks), keep fsdp2's clear errors (``test_refused_values_still_get_clear_errors``)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from _dist import cached_outcome, run_scenarios
from _models import full_params, impl, tiny_llama_config
from torch.distributed.tensor import Shard

LIBS = ("fsdp2", "torch")


class _Block(nn.Linear):
    def doubled(self, x: torch.Tensor) -> torch.Tensor:  # a method besides forward
        return self.forward(x) * 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(4, 4), _Block(4, 4)).double()


class _SubShard(Shard):
    """A user's subclass of ``Shard`` (torch checks placements with ``isinstance``)."""


def _subshard(p: nn.Parameter) -> Shard:
    return _SubShard(0)


def _kwargs(lib: Any, case: str, m: nn.Sequential) -> tuple[dict, dict]:
    """(kwargs of the blocks' calls, kwargs of the root's)."""
    if case == "offload_policy_none":
        return {"offload_policy": None}, {"offload_policy": None}
    if case == "ignored_params_dict_keys":
        return {}, {"ignored_params": {m[1].bias: 1}.keys()}
    if case == "shard_placement_subclass":
        return {"shard_placement_fn": _subshard}, {}
    if case == "policy_subclass_of_torchs":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        class Policy(MixedPrecisionPolicy):
            pass

        return {"mp_policy": Policy(reduce_dtype=torch.float64)}, {}
    return {}, {}


def _after(lib: Any, case: str, m: Any) -> None:
    """A setter called between the first and the second step."""
    if case == "bool_setters_0_1_numpy":
        m.set_requires_gradient_sync(np.False_)  # this step accumulates; _grads_after syncs with 1
        m.set_reshard_after_backward(1)
        m[0].set_unshard_in_backward(np.True_)
        m.set_requires_all_reduce(1)
        m.set_is_last_backward(1)
        m.unshard(async_op=0)
        m.reshard()
    elif case == "divide_factor_numpy_tensor_none":
        m[0].set_gradient_divide_factor(np.float64(4.0))
        m[0].set_gradient_divide_factor(None)  # back to the mesh size
        m[1].set_gradient_divide_factor(torch.tensor(4.0))
    elif case == "none_resets":
        m.set_post_optim_event(None)
        m[0].set_all_reduce_hook(_double)
        m[0].set_all_reduce_hook(None)  # removed: the gradients are as without a hook
    elif case == "symm_mem_lower_case":
        m.set_symm_mem_for_comm("nccl")
    elif case == "prefetch_module_list_and_tuple":
        m[0].set_modules_to_forward_prefetch(nn.ModuleList([m[1]]))
        m[1].set_modules_to_backward_prefetch((m[0],))
        lib.share_comm_ctx((m[0], m[1]))
        lib.share_comm_ctx({m[0], m[1]})
    elif case == "set_is_last_backward_on_a_child":
        m[1].set_is_last_backward(True)
    elif case == "forward_method_set_on_the_instance":
        m[1].doubled = functools.partial(_Block.doubled, m[1])
        lib.register_fsdp_forward_method(m[1], "doubled")


def _double(t: torch.Tensor) -> None:
    t.mul_(2)


CASES = (
    "offload_policy_none",
    "ignored_params_dict_keys",
    "shard_placement_subclass",
    "policy_subclass_of_torchs",
    "bool_setters_0_1_numpy",
    "divide_factor_numpy_tensor_none",
    "none_resets",
    "symm_mem_lower_case",
    "prefetch_module_list_and_tuple",
    "set_is_last_backward_on_a_child",
    "forward_method_set_on_the_instance",
)


def _run(rank: int, world: int, lib_name: str, case: str) -> list[Any]:
    from torch.distributed.tensor import DTensor

    lib = impl(lib_name)
    m = _model()
    child, root = _kwargs(lib, case, m)
    for block in m:
        lib.fully_shard(block, **child)
    lib.fully_shard(m, **root)
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    grads = []
    for step in range(2):
        if step == 1:
            _after(lib, case, m)
        out = m[1].doubled(m[0](x)) if case == "forward_method_set_on_the_instance" and step else m(x)
        out.square().sum().backward()
        if step == 1 and case == "bool_setters_0_1_numpy":  # the accumulated step, then a synced one
            m.set_requires_gradient_sync(1)
            m(x).square().sum().backward()
        grads.append(
            [
                (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                for p in m.parameters()
            ]
        )
        m.zero_grad()
    return grads


def _verl(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    """verl's FSDP2 engine, as its ``fsdp_utils`` drives ``fully_shard``: ``apply_fsdp2``
    wraps each class named in ``_no_split_modules`` (and an untied embedding) with
    ``fsdp_kwargs`` holding ``offload_policy=None`` when offload is off, then the root,
    of a model built whole on rank 0 and on the meta device elsewhere;
    ``fsdp2_load_full_state_dict`` moves rank 0's and materializes the others'
    (``to_empty``), loads rank 0's full state dict by broadcast and broadcasts the
    buffers (rank 0's, the rotary tables: not in the state dict); then a log-prob forward
    under ``no_grad`` and a PPO-style update over two micro-batches, clipped by
    ``clip_grad_norm_``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import LlamaForCausalLM

    lib = impl(lib_name)
    config = tiny_llama_config()
    torch.manual_seed(0)
    if rank == 0:  # verl's init context: the real model on rank 0's CPU, empty weights elsewhere
        model = LlamaForCausalLM(config).double()
        full = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(config).double()
        full = {}
    fsdp_kwargs = {
        "mesh": None,
        "mp_policy": lib.MixedPrecisionPolicy(),
        "offload_policy": None,
        "reshard_after_forward": True,
    }
    wrap = set(model._no_split_modules)
    modules = [
        m
        for m in model.modules()
        if type(m).__name__ in wrap or (isinstance(m, nn.Embedding) and not config.tie_word_embeddings)
    ]
    for m in modules:
        lib.fully_shard(m, **fsdp_kwargs)
    lib.fully_shard(model, **fsdp_kwargs)
    if rank == 0:
        model.to("cpu")
    else:
        model.to_empty(device="cpu")
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for buf in model.buffers():
        dist.broadcast(buf, src=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        old = model(input_ids=ids).logits.log_softmax(-1)
    losses = []
    for micro in ids.chunk(2):
        logp = model(input_ids=micro).logits.log_softmax(-1)
        ratio = torch.exp(logp - old[: len(micro)].detach())
        loss = -(ratio.clamp(0.8, 1.2) * logp).mean() / 2
        loss.backward()
        losses.append(loss.item())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return {
        "losses": losses,
        "norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
        "params": full_params(model),
    }


@cached_outcome
def _world() -> dict[str, list[Any]]:
    scenarios = {f"{case}-{lib}": (_run, (lib, case)) for case in CASES for lib in LIBS}
    scenarios.update({f"verl-{lib}": (_verl, (lib,)) for lib in LIBS})
    return run_scenarios(2, scenarios)


@pytest.mark.parametrize("case", CASES)
def test_value_torch_accepts_is_accepted_with_the_same_meaning(case: str) -> None:
    world = _world()
    for ours, theirs in zip(world[f"{case}-fsdp2"], world[f"{case}-torch"]):
        for got, want in zip(ours, theirs):
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (case, g, w)  # NaN fails


def test_mesh_dims_take_a_list_of_names_as_torchs() -> None:
    import fsdp2

    assert fsdp2.DataParallelMeshDims(shard=["dp"], replicate=["r1", "r2"]) == fsdp2.DataParallelMeshDims(
        shard=("dp",), replicate=("r1", "r2")
    )


def test_refused_values_still_get_clear_errors() -> None:
    import fsdp2
    from fsdp2._validate import validate_ignored, validate_modules, validate_policies

    m = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="offload_policy expects an OffloadPolicy"):
        validate_policies(fsdp2.MixedPrecisionPolicy(), object(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a set of modules, whose order differs"):
        validate_modules({m[0]})
    with pytest.raises(TypeError, match="ignored_params expects a set of parameters"):
        validate_ignored(m[0].weight)
    from fsdp2._validate import check_bool

    for bad in (None, "no", 2, 0.5):
        with pytest.raises(TypeError, match="expects a bool"):
            check_bool("set_requires_gradient_sync", bad)
    assert check_bool("x", np.False_) is False and check_bool("x", 1) is True


def test_verl_fsdp2_engine_with_offload_policy_none_equals_torchs_bit_for_bit() -> None:
    world = _world()
    for ours, theirs in zip(world["verl-fsdp2"], world["verl-torch"]):
        assert ours["losses"] == theirs["losses"] and ours["norm"] == theirs["norm"], (ours, theirs)
        assert all(torch.equal(ours["params"][n], theirs["params"][n]) for n in theirs["params"])
