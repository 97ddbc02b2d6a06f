"""Names, keys, placements and classes are as promised after fully_shard."""

from __future__ import annotations

import pickle

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2
from _dist import run_ranks
from _models import ToyModel, batch, loss_fn


def _names_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyModel(hidden=5)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    shapes = {n: p.shape for n, p in model.named_parameters()}
    ret = [fsdp2.fully_shard(b) for b in model.blocks]
    root = fsdp2.fully_shard(model)
    out: dict = {
        "returns_same_object": root is model and all(r is b for r, b in zip(ret, model.blocks)),
        "names_equal": [n for n, _ in model.named_parameters()] == names,
        "keys_equal": list(model.state_dict()) == keys,
        "all_dtensor_params": all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in model.parameters()),
        "global_shapes_equal": all(p.shape == shapes[n] for n, p in model.named_parameters()),
        "tied_kept": model.head.weight is model.emb.weight,
        "isinstance_original": isinstance(model, ToyModel) and isinstance(model, fsdp2.FSDPModule),
        "block_isinstance": all(isinstance(b, fsdp2.FSDPModule) for b in model.blocks),
        "plain_submodule_untouched": type(model.blocks[0].fc1) is nn.Linear,
        "class_name": type(model).__name__,
        "repr_head": repr(model).splitlines()[0],
        "class_pickles": pickle.loads(pickle.dumps(type(model))) is type(model),
    }
    placements = {}
    for n, p in model.named_parameters():
        placements[n] = (p.placements, tuple(p.to_local().shape))
    out["placements"] = placements
    # Every rank's local rows follow torch.chunk: rows ceil(5/W) each, trailing ranks short.
    out["fc1_rows"] = model.blocks[0].fc1.weight.to_local().shape[0]
    return out


def test_names_keys_placements_classes() -> None:
    results = run_ranks(_names_worker, 4)
    for rank, out in enumerate(results):
        for key in (
            "returns_same_object", "names_equal", "keys_equal", "all_dtensor_params", "global_shapes_equal",
            "tied_kept", "isinstance_original", "block_isinstance", "plain_submodule_untouched", "class_pickles",
        ):
            assert out[key] is True, (rank, key)
        assert out["class_name"] == "FSDPToyModel"
        assert out["repr_head"] == "FSDPToyModel("
        for name, (placements, _) in out["placements"].items():
            expected = (Replicate(),) if name.endswith("gate") else (Shard(0),)
            assert placements == expected, name
    # hidden=5 over 4 ranks: torch.chunk gives 2, 2, 1 and an empty chunk.
    assert [out["fc1_rows"] for out in results] == [2, 2, 1, 0]


def _list_and_ignored_worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyModel(tie=False)
    ignored = {model.extra.weight}
    out = fsdp2.fully_shard([model.blocks[0], model.blocks[1]])
    fsdp2.fully_shard(model, ignored_params=ignored)
    ids, targets = batch(rank, 2)  # different data per rank
    loss_fn(model(ids), targets).backward()
    grad = model.extra.weight.grad
    gathered = [torch.empty_like(grad) for _ in range(world)]
    torch.distributed.all_gather(gathered, grad)
    return {
        "list_returned": isinstance(out, list) and out[0] is model.blocks[0],
        "shared_group": model.blocks[0]._fsdp2_state.group is model.blocks[1]._fsdp2_state.group,
        "ignored_plain": type(model.extra.weight) is nn.Parameter and not isinstance(model.extra.weight, DTensor),
        "ignored_not_synced": not torch.equal(gathered[0], gathered[1]),
        "others_sharded": isinstance(model.extra.bias, DTensor),
    }


def test_list_groups_and_ignored_params() -> None:
    for out in run_ranks(_list_and_ignored_worker, 2):
        assert all(out.values()), out


def test_public_surface_matches_torch() -> None:
    import torch.distributed.fsdp as torch_fsdp

    extras = {"StateDictError"}  # ours only: the error a bad load_state_dict raises
    for name in set(fsdp2.__all__) - extras:
        assert hasattr(torch_fsdp, name), name
    for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
                 "UnshardHandle", "register_fsdp_forward_method"):
        assert name in fsdp2.__all__, name
    torch_methods = {m for m in dir(torch_fsdp.FSDPModule) if m.startswith(("set_", "un", "re")) and not m.startswith("_")}
    ours = {m for m in dir(fsdp2.FSDPModule) if not m.startswith("_")}
    core = {
        "unshard", "reshard", "reset_iter_state", "set_is_last_backward", "set_requires_gradient_sync",
        "set_reshard_after_forward", "set_reshard_after_backward", "set_modules_to_forward_prefetch",
        "set_modules_to_backward_prefetch", "set_gradient_divide_factor", "set_reduce_scatter_divide_factor",
    }
    assert core <= ours
    assert core <= torch_methods
    assert fsdp2.MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, True) == fsdp2.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert fsdp2.CPUOffloadPolicy().pin_memory is True
