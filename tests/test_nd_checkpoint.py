"""Checkpoints of N-D sharded models, float64: torch.distributed.checkpoint saved from
FSDP over tensor parallel (dp 2 x tp 2) loads at dp 4, at HSDP (2 x 2) and at dp 1 x tp 2
(a world-2 run reading the same directory), the optimizer state with it; one saved at HSDP
loads at dp 4; the full/rank-0 options of the state_dict helpers on the 2-D model. Every
loaded full parameter must equal the saved one exactly, and the loaded model's loss on a
fixed batch must match an unsharded model holding the saved values. Each script also runs
with torch's ``fully_shard`` swapped in (to keep the script honest)."""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from _dist import run_ranks
from _models import full_params, impl
from _tp_model import TPModel, parallelize
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

VOCAB = 16
RTOL, ATOL = 1e-10, 1e-12
LIBS = ["fsdp2", "torch"]

# layout -> (mesh shape, mesh dim names); the dims other than "tp" are FSDP's.
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "dp_tp": ((2, 2), ("dp", "tp")),
    "dp1_tp2": ((1, 2), ("dp", "tp")),
    "dp4": ((4,), ("dp",)),
    "hsdp": ((2, 2), ("replicate", "shard")),
}
_MESHES: dict[str, DeviceMesh] = {}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randint(0, VOCAB, (rows, 6), generator=g), torch.randint(0, VOCAB, (rows, 6), generator=g)


EVAL_BATCH = 99  # the same 2 rows on every rank, for the loaded models' loss


def _mesh(layout: str) -> DeviceMesh:
    if layout not in _MESHES:
        shape, names = LAYOUTS[layout]
        _MESHES[layout] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[layout]


def _build(layout: str, lib: Any, seed: int) -> tuple[nn.Module, DeviceMesh]:
    """A TPModel (float64, initialised from ``seed``) laid out as ``layout``: tensor parallel
    over "tp" where there is one, then ``fully_shard`` on each block and the root over the
    other dims."""
    torch.manual_seed(seed)
    model = TPModel().double()
    mesh = _mesh(layout)
    names = LAYOUTS[layout][1]
    if "tp" in names:
        parallelize(model, mesh["tp"])
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = mesh
    for block in model.blocks:
        lib.fully_shard(block, mesh=dp_mesh)
    lib.fully_shard(model, mesh=dp_mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return model, dp_mesh


def _optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, dp_mesh: DeviceMesh, step: int = 0) -> None:
    """One step on this rank's data-parallel rows of a batch of 2 rows per dp rank."""
    coord = dp_mesh.get_coordinate()
    dp_rank = coord[0] if len(coord) == 1 else coord[0] * dp_mesh.size(1) + coord[1]
    dp_size = dp_mesh.size()
    ids, targets = _batch(step, 2 * dp_size)
    _loss(model(ids.chunk(dp_size)[dp_rank]), targets.chunk(dp_size)[dp_rank]).backward()
    opt.step()
    opt.zero_grad()


def _eval_loss(model: nn.Module) -> float:
    ids, targets = _batch(EVAL_BATCH, 2)
    with torch.no_grad():
        return _loss(model(ids), targets).item()


def _full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    sd = get_optimizer_state_dict(model, opt)
    return {
        fqn: {
            k: (v.full_tensor() if isinstance(v, DTensor) else torch.as_tensor(v)).detach().clone()
            for k, v in st.items()
        }
        for fqn, st in sd["state"].items()
    }


def _save(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> dict[str, Any]:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    return {"params": full_params(model), "optim": _full_optim(model, opt), "loss": _eval_loss(model)}


def _load(layout: str, lib: Any, path: str, seed: int) -> dict[str, Any]:
    """A fresh model at ``layout`` (initialised from another seed), its fresh optimizer's
    state created by the state_dict helper, both loaded from the checkpoint at ``path``."""
    model, _ = _build(layout, lib, seed)
    opt = _optim(model)
    before = full_params(model)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    out = {
        "before": before,
        "params": full_params(model),
        "optim": _full_optim(model, opt),
        "placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
    }
    # Last: torch's root stays unsharded after a forward with no backward.
    return {**out, "loss": _eval_loss(model)}


def _section(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Each check on its own: a failure is kept (as its traceback) and the next runs."""
    try:
        out[name] = fn()
    except Exception:  # noqa: BLE001 - reported by the test that reads it
        out[name] = "".join(traceback.format_exc())


def _save_2d(lib: Any, path: str) -> dict[str, Any]:
    """dp 2 x tp 2, one AdamW step, then saved; the full (rank-0, CPU) state dict of the
    fresh and of the trained model, next to an unsharded replica trained the same way."""
    torch.manual_seed(0)
    ref = TPModel().double()
    model, dp_mesh = _build("dp_tp", lib, seed=0)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    fresh_full = get_model_state_dict(model, options=opts)
    ref_init = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    init = full_params(model)
    opt, ref_opt = _optim(model), _optim(ref)
    _train_step(model, opt, dp_mesh)
    ids, targets = _batch(0, 2 * dp_mesh.size())
    _loss(ref(ids), targets).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    trained_full = get_model_state_dict(model, options=opts)
    saved = _save(model, opt, path)
    return {
        **saved,
        "init": init,
        "fresh_full": fresh_full,
        "ref_init": ref_init,
        "trained_full": trained_full,
        "ref_trained": full_params(ref),
    }


def _broadcast_2d(lib: Any, rank: int) -> dict[str, Any]:
    """A full state dict that only rank 0 holds, broadcast into a dp 2 x tp 2 model."""
    torch.manual_seed(5)
    source = TPModel().double()
    # Change every value from its init (LayerNorms start at ones and zeros).
    with torch.no_grad():
        for i, p in enumerate(source.parameters()):
            p.add_(0.01 * (i + 1))
    source_sd = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model, _ = _build("dp_tp", lib, seed=6)
    before = full_params(model)
    full = source.state_dict() if rank == 0 else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=opts)
    return {"source": source_sd, "before": before, "params": full_params(model), "loss": _eval_loss(model)}


def _save_hsdp(lib: Any, path: str) -> dict[str, Any]:
    model, dp_mesh = _build("hsdp", lib, seed=7)
    init = full_params(model)
    opt = _optim(model)
    _train_step(model, opt, dp_mesh, step=1)
    return {**_save(model, opt, path), "init": init}


def _worker4(rank: int, world: int, lib_name: str, path_2d: str, path_hsdp: str) -> dict[str, Any]:
    lib = impl(lib_name)
    out: dict[str, Any] = {}
    _section(out, "save_2d", lambda: _save_2d(lib, path_2d))
    _section(out, "2d_to_dp4", lambda: _load("dp4", lib, path_2d, seed=1))
    _section(out, "2d_to_hsdp", lambda: _load("hsdp", lib, path_2d, seed=2))
    _section(out, "broadcast_2d", lambda: _broadcast_2d(lib, rank))
    _section(out, "save_hsdp", lambda: _save_hsdp(lib, path_hsdp))
    _section(out, "hsdp_to_dp4", lambda: _load("dp4", lib, path_hsdp, seed=8))
    uneven = os.path.join(os.path.dirname(path_2d), "uneven")
    _section(out, "uneven", lambda: _uneven_fsdp_over_tp(rank, world, lib_name, uneven))
    return out


def _worker2(rank: int, world: int, lib_name: str, path_2d: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _section(out, "2d_to_dp1_tp2", lambda: _load("dp1_tp2", impl(lib_name), path_2d, seed=3))
    return out


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("nd_checkpoint"))


def _paths(root: str, lib_name: str) -> tuple[str, str]:
    return os.path.join(root, lib_name, "dp_tp"), os.path.join(root, lib_name, "hsdp")


def _both4(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """Both libraries in one set of ranks (spawning them costs more than the runs)."""
    return {lib_name: _worker4(rank, world, lib_name, *_paths(root, lib_name)) for lib_name in LIBS}


def _both2(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    return {lib_name: _worker2(rank, world, lib_name, _paths(root, lib_name)[0]) for lib_name in LIBS}


@functools.cache
def _spawned(root: str) -> tuple[list[dict], list[dict]]:
    w4 = run_ranks(_both4, 4, root)
    return w4, run_ranks(_both2, 2, root)  # the same checkpoints, at world 2


def _results(lib_name: str, root: str) -> dict[str, list[dict[str, Any]]]:
    w4, w2 = _spawned(root)
    return {"w4": [out[lib_name] for out in w4], "w2": [out[lib_name] for out in w2]}


def _get(outs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, out in enumerate(outs):
        assert isinstance(out[name], dict), f"rank {rank}, {name}:\n{out[name]}"
    return [out[name] for out in outs]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), what
    for n, w in want.items():
        g = got[n]
        assert not isinstance(g, DTensor) and g.dtype == w.dtype == torch.float64, (what, n, type(g), g.dtype)
        assert torch.equal(g, w), f"{what}: {n}: max |diff| {(g - w).abs().max().item()}\n{g}\n{w}"


def _assert_differs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Every parameter differs (so that loading it is seen)."""
    same = [n for n in want if torch.equal(got[n], want[n])]
    assert not same, f"{what}: equal before loading: {same}"


def _reference_loss(params: dict[str, torch.Tensor]) -> float:
    """The loss on the eval batch of an unsharded model holding ``params``."""
    model = TPModel().double()
    model.load_state_dict(params)
    return _eval_loss(model)


def _check_load(saved: dict[str, Any], loaded: list[dict[str, Any]], what: str) -> None:
    want_loss = _reference_loss(saved["params"])
    for rank, got in enumerate(loaded):
        _assert_differs(got["before"], saved["params"], f"{what} rank {rank}")
        _assert_equal(got["params"], saved["params"], f"{what} rank {rank}")
        torch.testing.assert_close(got["loss"], want_loss, rtol=RTOL, atol=ATOL)
        assert list(got["optim"]) == list(saved["optim"]), what
        for fqn, st in saved["optim"].items():
            assert sorted(got["optim"][fqn]) == sorted(st) == ["exp_avg", "exp_avg_sq", "step"], fqn
            for key, value in st.items():
                g = got["optim"][fqn][key]
                assert torch.equal(g, value), f"{what} rank {rank}: optim {fqn}.{key}\n{g}\n{value}"


@pytest.mark.parametrize("lib_name", LIBS)
def test_2d_save_trained_state(lib_name: str, ckpt_root: str) -> None:
    """The saved dp x tp model trained away from its init, as the unsharded replica did."""
    for rank, saved in enumerate(_get(_results(lib_name, ckpt_root)["w4"], "save_2d")):
        _assert_differs(saved["init"], saved["params"], f"training rank {rank}")
        for n, v in saved["ref_trained"].items():
            torch.testing.assert_close(saved["params"][n], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")
        assert saved["optim"]["blocks.0.ffn.w1.weight"]["exp_avg"].abs().sum() > 0


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("target", ["dp4", "hsdp", "dp1_tp2"])
def test_2d_checkpoint_loads_at_other_layouts(lib_name: str, target: str, ckpt_root: str) -> None:
    """Saved at dp 2 x tp 2; loaded at 1-D dp 4, at HSDP 2 x 2, and at dp 1 x tp 2 (world
    2): every full parameter and every optimizer state tensor equal to the saved ones."""
    res = _results(lib_name, ckpt_root)
    saved = _get(res["w4"], "save_2d")[0]
    loaded = _get(res["w2"], "2d_to_dp1_tp2") if target == "dp1_tp2" else _get(res["w4"], f"2d_to_{target}")
    _check_load(saved, loaded, f"dp_tp -> {target}")


@pytest.mark.parametrize("lib_name", LIBS)
def test_2d_loads_keep_their_own_layouts(lib_name: str, ckpt_root: str) -> None:
    """The loaded models are laid out as built (HSDP: replicated over "replicate")."""
    res = _results(lib_name, ckpt_root)
    for out in _get(res["w4"], "2d_to_dp4"):
        assert all(v == (Shard(0),) for v in out["placements"].values()), out["placements"]
    for out in _get(res["w4"], "2d_to_hsdp"):
        assert all(v == (Replicate(), Shard(0)) for v in out["placements"].values()), out["placements"]


@pytest.mark.parametrize("lib_name", LIBS)
def test_2d_full_state_dict_on_rank0_equals_local_replica(lib_name: str, ckpt_root: str) -> None:
    """``full_state_dict=True, cpu_offload=True`` on the dp x tp model: plain CPU tensors on
    rank 0 only, equal to an unsharded replica built from the same seed (exactly, fresh)
    and to the sharded model's own full parameters (exactly, after a step)."""
    outs = _get(_results(lib_name, ckpt_root)["w4"], "save_2d")
    for rank, saved in enumerate(outs):
        if rank != 0:
            assert saved["fresh_full"] == {} and saved["trained_full"] == {}, rank
            continue
        for got in (saved["fresh_full"], saved["trained_full"]):
            assert all(v.device.type == "cpu" for v in got.values())
        _assert_equal(saved["fresh_full"], saved["ref_init"], "fresh full state dict vs replica")
        _assert_equal(saved["trained_full"], saved["params"], "trained full state dict vs full_tensor()")
        for n, v in saved["ref_trained"].items():
            got = saved["trained_full"][n]
            torch.testing.assert_close(got, v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("lib_name", LIBS)
def test_2d_broadcast_from_rank0_load(lib_name: str, ckpt_root: str) -> None:
    """``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` with only
    rank 0 holding the dict: every rank's dp x tp model then holds the source values."""
    outs = _get(_results(lib_name, ckpt_root)["w4"], "broadcast_2d")
    want_loss = _reference_loss(outs[0]["source"])
    for rank, got in enumerate(outs):
        _assert_equal(got["source"], outs[0]["source"], f"source rank {rank}")
        _assert_differs(got["before"], got["source"], f"broadcast rank {rank}")
        _assert_equal(got["params"], got["source"], f"broadcast rank {rank}")
        torch.testing.assert_close(got["loss"], want_loss, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("lib_name", LIBS)
def test_hsdp_checkpoint_loads_at_dp4(lib_name: str, ckpt_root: str) -> None:
    """Saved at HSDP 2 x 2 after a step, loaded at 1-D dp 4, optimizer state too."""
    res = _results(lib_name, ckpt_root)
    saved = _get(res["w4"], "save_hsdp")
    for rank, s in enumerate(saved):
        _assert_differs(s["init"], s["params"], f"training rank {rank}")
        _assert_equal(s["params"], saved[0]["params"], f"saved rank {rank}")
    _check_load(saved[0], _get(res["w4"], "hsdp_to_dp4"), "hsdp -> dp4")


def _uneven_linears(rows: int, zero: bool) -> nn.Module:
    """Two linears whose sharded dims TP and FSDP split unevenly (``rows`` = 7 on 2 x 2:
    TP gives 4 and 3 rows, FSDP then 2 + 2 and 2 + 1); values that show any misplaced row."""
    model = nn.Sequential(nn.Linear(4, rows, bias=False), nn.Linear(rows, 4, bias=False))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.zeros_like(p) if zero else torch.arange(p.numel(), dtype=p.dtype).view(p.shape) + 1000 * i)
    return model


def _uneven_fsdp_over_tp(rank: int, world: int, lib_name: str, path: str) -> dict[str, bool]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    lib = impl(lib_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    full = {n: p.detach().clone() for n, p in _uneven_linears(7, zero=False).named_parameters()}

    def sharded(zero: bool, two_d: bool) -> nn.Module:
        model = _uneven_linears(7, zero)
        if two_d:
            parallelize_module(model, mesh["tp"], plan)
        lib.fully_shard(model, mesh=mesh["dp"] if two_d else init_device_mesh("cpu", (world,)))
        return model

    out: dict[str, bool] = {}
    model = sharded(zero=False, two_d=True)
    out.update({f"full_tensor {n}": torch.equal(p.full_tensor(), full[n]) for n, p in model.named_parameters()})
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    for two_d in (True, False):
        target = sharded(zero=True, two_d=two_d)
        state = get_model_state_dict(target)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(target, state)
        out.update({f"loaded {'2d' if two_d else '1d'} {n}": torch.equal(p.full_tensor(), full[n])
                    for n, p in target.named_parameters()})
    return out


@pytest.mark.parametrize("lib_name", LIBS)
def test_uneven_fsdp_over_tp_full_tensor_and_checkpoint(lib_name: str, ckpt_root: str) -> None:
    """FSDP over TP where both split a dim unevenly: ``full_tensor`` gives the original
    weights, and a DCP checkpoint of them loads into the same 2-D layout and into 1-D FSDP
    over all ranks unchanged. (Run in the 4-rank world of the tests above: a world of its
    own per library cost a spawn and a warm-up for well under a second of work.)"""
    for rank, out in enumerate(_get(_results(lib_name, ckpt_root)["w4"], "uneven")):
        assert out and all(out.values()), (rank, out)
