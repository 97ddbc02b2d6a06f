"""Mixture-of-Experts with per-parameter meshes, as torchtitan shards it: each block's
routed experts over the expert-data-parallel mesh (``ShardPlacementResult``), the rest
over the data-parallel mesh, at 4 ranks with expert parallel 1, 2 and 4, HSDP x EP,
``Shard(1)`` and uneven experts (CPU offload: ``tests/test_cpu_offload.py`` runs ``ep2``
and ``ep2_raf2`` offloaded). float64 parity against one local replica fed the global
batch (losses scaled by the global batch and FSDP's division off, as torchtitan trains),
every step's collectives no more than torch's ``fully_shard`` issues, the same
placements; every configuration torch supports also runs with torch's ``fully_shard``.
"""

from __future__ import annotations

import functools
import os
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _comm import CommCounter
from _dist import cached_outcome, run_ranks
from _models import batch, full_params, impl, loss_fn
from _models import worst as _worst
from _moe_model import MoEModel, expert_params, parallelize_experts
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

WORLD = 4
STEPS = 2
VOCAB = 13
TOL = 1e-10

# name -> settings: ep (expert parallel), replicate (HSDP replicas), experts (count),
# api ("torch": torch's ShardPlacementResult and FSDPMeshInfo, as torchtitan builds them;
# "fsdp2": fsdp2.ShardPlacementResult(placement, mesh)), and what else runs with it.
CONFIGS: dict[str, dict[str, Any]] = {
    "ep1_shard1": dict(ep=1, experts=2, hidden=8),  # 4 ranks > 2 experts: Shard(1), one mesh
    "ep1_shard1_uneven": dict(ep=1, experts=2, torch=False),  # hidden 6 over 4 ranks: torch refuses
    "ep2": dict(ep=2),
    "ep2_fsdp2_api": dict(ep=2, api="fsdp2", torch=False),
    "ep4": dict(ep=4),
    "ep2_shard1": dict(ep=2, experts=2),  # efsdp 2 x ep 2 > 2 experts: Shard(1)
    "ep2_uneven": dict(ep=2, experts=6, torch_note="3 local experts over 2 ranks"),
    "hsdp_ep2": dict(ep=2, replicate=2),
    "ep2_ac": dict(ep=2, ac=True),
    "ep2_raf2": dict(ep=2, raf=2),  # dense: keep 2 of 4 ranks' rows; experts (efsdp 2): free all
    "ep2_raf_false": dict(ep=2, raf=False),
    "ep2_unshard": dict(ep=2, unshard=True),
    "ep2_clip": dict(ep=2, clip=0.05),
    # torch's fully_shard hands fsdp2.optim.Muon DTensors it does not manage: torch's
    # Muon path orthogonalizes through DTensor ops and lands ~5e-3 from the local model.
    "ep2_muon": dict(ep=2, muon=True, torch_tol=1e-2),
    "ep2_accumulate": dict(ep=2, micro=2),
}


def _meshes(ep: int, replicate: int, world: int = WORLD) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dense dp mesh, expert-data-parallel mesh, ep mesh) as torchtitan's ParallelDims
    lays them out: dp_shard = efsdp x ep."""
    efsdp = world // replicate // ep
    root = init_device_mesh("cpu", (replicate, efsdp, ep), mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    root["efsdp", "ep"]._flatten("fsdp")
    if replicate > 1:
        return root["dp_replicate", "fsdp"], root["dp_replicate", "efsdp"], root["ep"]
    return root["fsdp"], root["efsdp"], root["ep"]


def _placement_fn(cfg: dict[str, Any], block: torch.nn.Module, dense: DeviceMesh, edp: DeviceMesh) -> Any:
    """torchtitan's ``apply_fsdp_to_decoder`` choice for one MoE block."""
    experts = expert_params(block)
    n_experts = cfg.get("experts", 4)
    ep = cfg["ep"]
    span = (edp.size(edp.ndim - 1) * ep) if ep > 1 else dense.size(dense.ndim - 1)
    placement = Shard(1) if span > n_experts else Shard(0)
    if ep == 1:
        return (lambda p: placement if p in experts else None) if placement == Shard(1) else None
    if cfg.get("api") == "fsdp2":
        import fsdp2

        return lambda p: fsdp2.ShardPlacementResult(placement, edp) if p in experts else None
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    edp_info, dp_info = _get_mesh_info(edp), _get_mesh_info(dense)
    return lambda p: ShardPlacementResult(placement, edp_info) if p in experts else ShardPlacementResult(Shard(0), dp_info)


def build(
    cfg: dict[str, Any], lib: Any, seed: int = 0, divide: bool = False, world: int = WORLD
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the local replica, the sharded model) for ``cfg``."""
    torch.manual_seed(seed)
    sizes = dict(n_experts=cfg.get("experts", 4), hidden=cfg.get("hidden", 6))
    ref = MoEModel(**sizes).double()
    model = MoEModel(**sizes).double()
    model.load_state_dict(ref.state_dict())
    dense, edp, ep_mesh = _meshes(cfg["ep"], cfg.get("replicate", 1), world)
    if cfg["ep"] > 1:
        parallelize_experts(model, ep_mesh)
    kwargs: dict[str, Any] = dict(mesh=dense, reshard_after_forward=cfg.get("raf", True))
    if cfg.get("bf16"):
        kwargs["mp_policy"] = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        fn = _placement_fn(cfg, block, dense, edp)
        if cfg.get("ac"):  # torchtitan's recipe: the wrapper is what fully_shard gets
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            block = model.blocks[i] = checkpoint_wrapper(block)
            ref.blocks[i] = checkpoint_wrapper(ref.blocks[i])  # the same parameter names
        lib.fully_shard(block, shard_placement_fn=fn, **kwargs)
    lib.fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    for m in model.modules():  # torchtitan scales the loss by the global batch instead
        if isinstance(m, lib.FSDPModule) and not divide:
            m.set_gradient_divide_factor(1.0)
    return ref, model


def _optimizers(cfg: dict[str, Any], model: torch.nn.Module, ref: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(sharded, local) optimizer pairs: AdamW, or Muon for the matrices (the experts'
    2-D biases on the expert mesh among them) and AdamW for the rest."""
    import fsdp2

    if not cfg.get("muon"):
        return [(torch.optim.AdamW(model.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05))]
    pairs = []
    for matrices in (True, False):
        mine = [p for p in model.parameters() if (p.dim() == 2) == matrices]
        theirs = [p for p in ref.parameters() if (p.dim() == 2) == matrices]
        if matrices:
            pairs.append((fsdp2.optim.Muon(mine, lr=0.02), torch.optim.Muon(theirs, lr=0.02)))
        else:
            pairs.append((torch.optim.AdamW(mine, lr=0.05), torch.optim.AdamW(theirs, lr=0.05)))
    return pairs


def _run(cfg: dict[str, Any], lib: Any, rank: int) -> dict[str, Any]:
    import fsdp2

    ref, model = build(cfg, lib, divide=cfg.get("divide", False))
    scale = 1 if cfg.get("divide") else WORLD
    placements = {
        n: (p.device_mesh.mesh_dim_names, tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)
    }
    optims = _optimizers(cfg, model, ref)
    micro = cfg.get("micro", 1)
    losses, counts = [], []
    for step in range(STEPS):
        ids, targets = batch(step, 2 * WORLD * micro, vocab=VOCAB)
        with CommCounter().active() as counter:
            for ids_mb, tg_mb in zip(ids.chunk(micro), targets.chunk(micro)):
                (loss_fn(ref(ids_mb), tg_mb) / micro).backward()
                if cfg.get("unshard"):
                    for block in model.blocks:
                        block.unshard()
                loss = loss_fn(model(ids_mb.chunk(WORLD)[rank]), tg_mb.chunk(WORLD)[rank])
                (loss / scale / micro).backward()
                losses.append(loss.item())
            if cfg.get("clip"):
                norm = fsdp2.clip_grad_norm_(list(model.parameters()), cfg["clip"])
                want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), cfg["clip"])
                losses.append(abs(norm.item() - want.item()))
        counts.append(dict(counter.calls))
        for mine, theirs in optims:
            for o in (mine, theirs):
                o.step()
                o.zero_grad()
    got, want = full_params(model), full_params(ref)
    worst = _worst([(got[n] - want[n]).abs().max().item() for n in want])
    return {"worst": worst, "counts": counts, "placements": placements, "losses": losses}


def _default_division(lib: Any, rank: int) -> float:
    """Without ``set_gradient_divide_factor`` each mesh's gradients are divided by its own
    ranks, as torch's are: the dense ones by 4 (their mean over the batch), the experts'
    (summed over ep 2 x efsdp 2 ranks' tokens) by efsdp's 2, so ep times the mean."""
    ref, model = build(CONFIGS["ep2"], lib, divide=True)
    ids, targets = batch(0, 2 * WORLD, vocab=VOCAB)
    loss_fn(ref(ids), targets).backward()
    loss_fn(model(ids.chunk(WORLD)[rank]), targets.chunk(WORLD)[rank]).backward()
    experts = {n for n, p in model.named_parameters() if ".experts." in n}
    mine = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return _worst([(mine[n] - q.grad * (2 if n in experts else 1)).abs().max().item() for n, q in ref.named_parameters()])


def _bf16(lib: Any, rank: int) -> dict[str, Any]:
    """bf16 compute, float32 reduce: the losses, to compare the two libraries (each mesh's
    default division: torch's divide factor takes gloo's unsupported PREMUL_SUM in bf16)."""
    return _run(dict(ep=2, bf16=True, divide=True), lib, rank)


def _checkpoint(lib: Any, rank: int, path: str) -> dict[str, float]:
    """DCP saved with ep 2 loads with ep 1 (experts on the dense mesh); the full state
    dict holds the whole values. Rank 0 keeps the saved values for the 2-rank load."""
    _, model = build(CONFIGS["ep2"], lib)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.25)
    saved = full_params(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(saved, os.path.join(path, "full.pt"))
    return {"full": _worst([(full[n] - saved[n]).abs().max().item() for n in saved]), "ep1": _load(lib, path, saved)}


def _load(lib: Any, path: str, saved: dict[str, torch.Tensor], world: int = WORLD) -> float:
    _, model = build(dict(ep=1), lib, seed=1, world=world)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    loaded = full_params(model)
    return _worst([(loaded[n] - saved[n]).abs().max().item() for n in saved])


def _load_at_two(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each library's checkpoint (under ``root``) loaded at 2 ranks, in one world."""
    out: dict[str, Any] = {}
    for lib_name in ("fsdp2", "torch"):
        path = os.path.join(root, lib_name)
        try:
            out[lib_name] = _load(impl(lib_name), path, torch.load(os.path.join(path, "full.pt")), world)
        except Exception as e:  # noqa: BLE001 - reported per library
            out[lib_name] = f"{type(e).__name__}: {e}"
    return out


def _misuse() -> dict[str, str]:
    """Each misuse raises before anything changed: the module is not an FSDPModule and
    holds the very parameters it had."""
    import fsdp2

    dense, edp, ep_mesh = _meshes(2, 1)
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    odd_info = SimpleNamespace(mesh=cube["b", "c"], shard_mesh_dim=0, replicate_mesh_dim=None)
    out: dict[str, str] = {}

    def attempt(name: str, place: Any, ep: bool = False, **kwargs: Any) -> None:
        torch.manual_seed(0)
        model = MoEModel()
        if ep:
            parallelize_experts(model, ep_mesh)
        experts, before = expert_params(model), list(model.blocks[0].parameters())
        try:
            fsdp2.fully_shard(model.blocks[0], mesh=dense, shard_placement_fn=lambda p: place if p in experts else None, **kwargs)
            out[name] = "accepted"
        except (TypeError, ValueError) as e:
            unchanged = not isinstance(model.blocks[0], fsdp2.FSDPModule) and all(
                p is q for p, q in zip(model.blocks[0].parameters(), before)
            )
            out[name] = f"{type(e).__name__}: {e}" + ("" if unchanged else " [STATE CHANGED]")

    attempt("span", fsdp2.ShardPlacementResult(Shard(0), edp))  # experts not split over ep
    attempt("replicate", fsdp2.ShardPlacementResult(Replicate(), edp), ep=True)
    attempt("mesh_3d", fsdp2.ShardPlacementResult(Shard(0), cube), ep=True)
    attempt("not_a_mesh", fsdp2.ShardPlacementResult(Shard(0), "efsdp"), ep=True)
    attempt("mesh_info_dims", SimpleNamespace(placement=Shard(0), mesh_info=odd_info), ep=True)
    attempt("raf_not_dividing", fsdp2.ShardPlacementResult(Shard(0), edp), ep=True, reshard_after_forward=4)
    _, model = build(CONFIGS["ep2"], fsdp2)
    try:
        model.blocks[0].set_reshard_after_forward(4)
        out["set_raf"] = "accepted"
    except ValueError as e:
        out["set_raf"] = f"{e}" + ("" if model.blocks[0]._fsdp2_state.group.reshard_after_forward is True else " [STATE CHANGED]")
    return out


def _knobs(lib: Any) -> dict[str, str]:
    """The knobs torch refuses on a module with several meshes, and accepts on one."""
    _, model = build(CONFIGS["ep2"], lib)
    block = model.blocks[0]

    class Comm:
        def allocate(self, *args: Any, **kwargs: Any) -> None: ...
        def __call__(self, *args: Any, **kwargs: Any) -> None: ...

    out = {}
    for name, call in {
        "all_reduce_hook": lambda: block.set_all_reduce_hook(lambda t: None),
        "custom_all_gather": lambda: block.set_custom_all_gather(Comm()),
        "custom_reduce_scatter": lambda: block.set_custom_reduce_scatter(Comm()),
    }.items():
        try:
            call()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    model.set_all_reduce_hook(lambda t: None)  # the root has one mesh
    return out


IN_PLACE_NAMES = ["ep2", "hsdp_ep2", "ep2_raf2", "ep2_accumulate"]
# Two worlds of 4 ranks (one took ~60 s alone), each running every library on its share
# of the configurations, fsdp2 first: torch's runs then reuse the DTensor sharding
# caches fsdp2's warmed in the same ranks (a new mesh or placement costs a process up to
# ~1 s). "layouts": the meshes and placements; "options": ep 2 with each option.
PARTS: dict[str, list[str]] = {
    "layouts": [
        "ep1_shard1", "ep1_shard1_uneven", "ep2", "ep2_fsdp2_api", "ep4", "ep2_shard1", "ep2_uneven", "hsdp_ep2",
    ],
    "options": ["ep2_ac", "ep2_raf2", "ep2_raf_false", "ep2_unshard", "ep2_clip", "ep2_muon", "ep2_accumulate"],
}
EXTRAS = {"layouts": ["knobs", "checkpoint"], "options": ["default_division", "bf16"]}
assert sorted(n for names in PARTS.values() for n in names) == sorted(CONFIGS)


def _part(name: str) -> str:
    return next(part for part, names in PARTS.items() if name in names)


def _worker(rank: int, world: int, lib_name: str, part: str, path: str) -> dict[str, Any]:
    lib = impl(lib_name)
    if lib_name == "fsdp2-in-place":
        names = [n for n in PARTS[part] if n in IN_PLACE_NAMES]
    else:
        names = [n for n in PARTS[part] if lib_name == "fsdp2" or CONFIGS[n].get("torch", True)]
    extras = {
        "default_division": functools.partial(_default_division, lib, rank),
        "bf16": functools.partial(_bf16, lib, rank),
        "knobs": functools.partial(_knobs, lib),
        "checkpoint": functools.partial(_checkpoint, lib, rank, os.path.join(path, lib_name)),
    }
    out: dict[str, Any] = {}
    for name, fn in [(n, functools.partial(_run, CONFIGS[n], lib, rank)) for n in names] + [
        (e, extras[e]) for e in EXTRAS[part] if lib_name != "fsdp2-in-place"
    ]:
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported per configuration
            out[name] = f"{type(e).__name__}: {e}"
    if lib_name == "fsdp2" and part == "layouts":
        out["misuse"] = _misuse()
    return out


def _all_libs(rank: int, world: int, part: str, path: str) -> dict[str, dict[str, Any]]:
    # fsdp2-in-place last: it stays on in the process.
    libs = ("fsdp2", "torch", "fsdp2-in-place")
    return {lib_name: _worker(rank, world, lib_name, part, path) for lib_name in libs}


@functools.cache
def _checkpoint_dir() -> str:
    return tempfile.mkdtemp(prefix="fsdp2-moe-")


@cached_outcome
def _spawned(part: str) -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_all_libs, WORLD, part, _checkpoint_dir())


def _results(lib_name: str, part: str) -> list[dict[str, Any]]:
    return [out[lib_name] for out in _spawned(part)]


@pytest.mark.parametrize(
    "lib_name,name", [("fsdp2", n) for n in CONFIGS] + [("fsdp2-in-place", n) for n in IN_PLACE_NAMES]
)
def test_parity_with_local_training(lib_name: str, name: str) -> None:
    for out in _results(lib_name, _part(name)):
        assert isinstance(out[name], dict), out[name]
        assert out[name]["worst"] <= TOL, out[name]["worst"]
        if CONFIGS[name].get("clip"):
            assert max(out[name]["losses"][1::2]) <= TOL  # the norm equals the local model's


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.get("torch", True)])
def test_torch_runs_the_same_script_with_the_same_placements_and_no_fewer_collectives(name: str) -> None:
    for mine, theirs in zip(_results("fsdp2", _part(name)), _results("torch", _part(name))):
        assert isinstance(theirs[name], dict), theirs[name]  # the script itself is right
        assert theirs[name]["worst"] <= CONFIGS[name].get("torch_tol", TOL), theirs[name]["worst"]
        assert mine[name]["placements"] == theirs[name]["placements"]
        for a, b in zip(mine[name]["counts"], theirs[name]["counts"]):
            for kind in set(a) | set(b):
                assert a.get(kind, 0) <= b.get(kind, 0), (kind, mine[name]["counts"], theirs[name]["counts"])


def test_experts_live_on_the_expert_mesh() -> None:
    out = _results("fsdp2", "layouts")[0]
    assert out["ep2"]["placements"]["blocks.0.moe.experts.w1"][0] == ("efsdp", "ep")
    assert out["ep2"]["placements"]["blocks.0.mix.weight"][0] == ("fsdp",)
    assert out["ep2_shard1"]["placements"]["blocks.0.moe.experts.w1"][1][0].dim == 1
    assert out["hsdp_ep2"]["placements"]["blocks.0.moe.experts.w1"][0] == ("dp_replicate", "efsdp", "ep")
    assert out["ep2_fsdp2_api"]["placements"] == out["ep2"]["placements"]


def test_default_division_is_per_mesh_as_torch() -> None:
    for lib_name in ("fsdp2", "torch"):
        for out in _results(lib_name, "options"):
            assert out["default_division"] <= TOL, (lib_name, out["default_division"])


def test_bf16_trains_as_torch() -> None:
    for mine, theirs in zip(_results("fsdp2", "options"), _results("torch", "options")):
        assert isinstance(mine["bf16"], dict) and isinstance(theirs["bf16"], dict), (mine["bf16"], theirs["bf16"])
        for a, b in zip(mine["bf16"]["losses"], theirs["bf16"]["losses"]):
            assert abs(a - b) <= 1e-2 * abs(b), (mine["bf16"]["losses"], theirs["bf16"]["losses"])


def test_knobs_torch_refuses_with_several_meshes() -> None:
    for lib_name in ("fsdp2", "torch"):
        out = _results(lib_name, "layouts")[0]["knobs"]
        assert isinstance(out, dict), out
        for name, message in out.items():
            assert "not supported" in message, (lib_name, name, message)


@pytest.mark.parametrize("lib_name", ["fsdp2", "torch"])
def test_checkpoint_from_ep2_loads_at_ep1_and_at_two_ranks(lib_name: str) -> None:
    for out in _results(lib_name, "layouts"):
        assert isinstance(out["checkpoint"], dict), out["checkpoint"]
        assert out["checkpoint"] == {"full": 0.0, "ep1": 0.0}
    assert [out[lib_name] for out in _loaded_at_two()] == [0.0, 0.0]


@cached_outcome
def _loaded_at_two() -> list[dict[str, Any]]:
    _results("fsdp2", "layouts")  # the checkpoints, both libraries'
    return run_ranks(_load_at_two, 2, _checkpoint_dir())


MISUSE = {
    "span": "not a multiple of the 4 data-parallel ranks",
    "replicate": "Shard(dim)",
    "mesh_3d": "cannot take",
    "not_a_mesh": "not a DeviceMesh",
    "mesh_info_dims": "shard_mesh_dim=0",
    "raf_not_dividing": "every shard size",
    "set_raf": "every shard size",
}


@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_is_refused_before_anything_changes(name: str) -> None:
    message = _results("fsdp2", "layouts")[0]["misuse"][name]
    assert MISUSE[name] in message and "[STATE CHANGED]" not in message, message
