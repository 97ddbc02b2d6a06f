"""Names, keys, placements and classes are as promised after fully_shard."""

from __future__ import annotations

import inspect
import pickle

import torch
import torch.nn as nn
from _dist import run_ranks
from _models import ToyModel, batch, loss_fn
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp2


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
    # torch's own policy objects (a script or library that builds them from
    # torch.distributed.fsdp, e.g. accelerate) are taken over as fsdp2's.
    import torch.distributed.fsdp as theirs

    lin, plain = nn.Linear(4, 4), nn.Linear(4, 4)
    fsdp2.fully_shard(
        lin,
        mp_policy=theirs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        offload_policy=theirs.CPUOffloadPolicy(pin_memory=False),
    )
    fsdp2.fully_shard(plain, mp_policy=theirs.MixedPrecisionPolicy(), offload_policy=theirs.OffloadPolicy())
    policy = lin._fsdp2_state.group.mp_policy
    return {
        "torch_policy_taken": policy == fsdp2.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        and type(policy) is fsdp2.MixedPrecisionPolicy,
        "torch_policy_used": lin(torch.randn(2, 4)).dtype == torch.bfloat16,
        "torch_default_policies_taken": type(plain._fsdp2_state.group.mp_policy) is fsdp2.MixedPrecisionPolicy
        and plain(torch.randn(2, 4)).dtype == torch.float32,
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

    # ours only: a bad load_state_dict's error, clipping across meshes, per-parameter meshes
    # without a private import, quantized collectives' settings, weights out and memory back
    extras = {"StateDictError", "clip_grad_norm_", "ShardPlacementResult", "BlockQuantization"}
    extras |= {"full_weights", "held_bytes", "release_memory", "gathered", "register_gathered_method"}
    extras |= {n for n in TORCH_215_NAMES if not hasattr(torch_fsdp, n)}  # torch 2.15's, on every torch
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


# torch 2.15's public names fsdp2 has on every torch.
TORCH_215_NAMES = ("GradientReductionHandle",)
# torch 2.13's public FSDP2 names (``torch.distributed.fsdp``'s fully_shard API; the
# FSDP1 names that module also exports are not part of the drop-in promise).
FSDP2_NAMES = (
    "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
    "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx", *TORCH_215_NAMES,
)


def _public_methods(cls: type) -> dict[str, object]:
    import inspect

    base = set(dir(nn.Module))
    return {n: m for n, m in inspect.getmembers(cls) if not n.startswith("_") and n not in base and callable(m)}


def _parameters(fn: object) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter, the default as its repr (ours and torch's
    policy classes differ but print alike); types and annotations may differ."""
    import inspect

    return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def test_public_api_matches_the_installed_torch() -> None:
    """Every public name and FSDPModule method of the installed torch's fully_shard API
    exists in fsdp2 with the same parameters (names, kinds, defaults): a torch release
    that adds or changes one fails here rather than in a user's script."""
    import torch.distributed.fsdp as theirs

    missing = [n for n in FSDP2_NAMES if hasattr(theirs, n) and not hasattr(fsdp2, n)]
    assert not missing, missing
    for name in ("fully_shard", "register_fsdp_forward_method", "share_comm_ctx"):
        assert _parameters(getattr(fsdp2, name)) == _parameters(getattr(theirs, name)), name
    ours, torchs = _public_methods(fsdp2.FSDPModule), _public_methods(theirs.FSDPModule)
    assert not sorted(set(torchs) - set(ours)), sorted(set(torchs) - set(ours))
    for name, method in torchs.items():
        assert _parameters(ours[name]) == _parameters(method), name
    for cls in ("MixedPrecisionPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"):
        ours_params = _parameters(getattr(fsdp2, cls))
        if cls == "MixedPrecisionPolicy":  # torch's fields first, as torch has them; then fsdp2's keyword-only ones
            names = ["quantize_gather", "quantize_reduce"]
            if "param_dtype_override_fn" not in inspect.signature(theirs.MixedPrecisionPolicy).parameters:
                names.append("param_dtype_override_fn")  # torch 2.15's, on every torch
            extra = [p for p in ours_params if p[0] in names]
            assert [(p[1], p[2]) for p in extra] == [(inspect.Parameter.KEYWORD_ONLY, "None")] * len(names), extra
            ours_params = [p for p in ours_params if p not in extra]
        assert ours_params == _parameters(getattr(theirs, cls)), cls
    # New torch names: any public name of torch's _fully_shard package fsdp2 lacks.
    from torch.distributed.fsdp import _fully_shard

    new = [n for n in getattr(_fully_shard, "__all__", []) if not hasattr(fsdp2, n)]
    assert not new, f"torch's fully_shard API has names fsdp2 lacks: {new}"
