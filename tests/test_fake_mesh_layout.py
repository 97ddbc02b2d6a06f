"""At scale without hardware: one rank of a 512-rank job on the fake process group, the
model on the meta device. Every parameter's placements, local shape and stride equal
those torch's ``fully_shard`` gives on the same model: FSDP x TP (dp 64 x tp 8), HSDP x
TP (8 x 8 x 8), 1D with Shard(1), and the same models on a full SPMD mesh
(``dp_mesh_dims``, the TP dim before or after the data-parallel ones, several shard dims
flattened, with and without replicas); the first rank and the last (whose shards are
partly or wholly padding)."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch
from _tp_model import TPModel, parallelize

WORLD = 512
CASES = {
    "dp_tp": ((64, 8), ("dp", "tp")),
    "hsdp_tp": ((8, 8, 8), ("replicate", "shard", "tp")),
    "dp_shard_1": ((WORLD,), ("dp",)),
    # fully_shard(mesh=full mesh, dp_mesh_dims=DataParallelMeshDims(shard, replicate))
    "spmd_dp_tp": ((64, 8), ("sdp", "stp"), "sdp", None),
    "spmd_tp_dp": ((8, 64), ("ttp", "tdp"), "tdp", None),
    "spmd_hsdp_tp": ((8, 8, 8), ("hrep", "hshard", "htp"), "hshard", "hrep"),
    "spmd_flat_hsdp_tp": ((2, 4, 8, 8), ("frep", "fa", "fb", "ftp"), ("fa", "fb"), "frep"),
}
_MESHES: dict[str, Any] = {}


def _lift(model: torch.nn.Module, mesh: Any, tp: int) -> None:
    """Each parameter as a DTensor on the full mesh: its TP placements on dim ``tp``,
    Replicate() on the others (as ``distribute_module`` over the whole mesh would)."""
    from torch.distributed.tensor import DTensor, Replicate

    for fqn, p in list(model.named_parameters()):
        placements = [Replicate()] * mesh.ndim
        local = p
        if isinstance(p, DTensor):
            placements[tp] = p.placements[0]
            local = p.to_local()
        lifted = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
        owner, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(owner), name, torch.nn.Parameter(lifted))


def _layouts(case: str, lib_name: str) -> dict[str, Any]:
    import importlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    lib = importlib.import_module("fsdp2" if lib_name == "fsdp2" else "torch.distributed.fsdp")
    shape, names = CASES[case][:2]
    # One mesh per case for both libraries: torch's fully_shard wants the parameters' mesh
    # to be the very object it gets, and DTensor may hand back an equal one made earlier.
    mesh = _MESHES.get(case) or _MESHES.setdefault(case, init_device_mesh("cpu", shape, mesh_dim_names=names))
    with torch.device("meta"):
        model = TPModel(vocab=1000, dim=64, heads=8, hidden=168, n_blocks=2)
    kwargs: dict[str, Any] = {}
    if case.startswith("spmd"):
        tp = next(i for i, n in enumerate(names) if n.endswith("tp"))
        parallelize(model, mesh[names[tp]])
        _lift(model, mesh, tp)
        kwargs = dict(mesh=mesh, dp_mesh_dims=lib.DataParallelMeshDims(shard=CASES[case][2], replicate=CASES[case][3]))
    elif "tp" in names:
        parallelize(model, mesh["tp"])
        kwargs["mesh"] = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
    else:
        kwargs["mesh"] = mesh
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 and p.shape[1] % WORLD == 0 else None
    for block in model.blocks:
        lib.fully_shard(block, **kwargs)
    lib.fully_shard(model, **kwargs)
    return {
        n: (str(tuple(p.placements)), tuple(p.shape), tuple(p.to_local().shape), p.to_local().stride())
        for n, p in model.named_parameters()
    }


def _rank_main(rank: int, out: Any) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    try:
        out.put({(c, lib): _layouts(c, lib) for c in CASES for lib in ("fsdp2", "torch")})
    except BaseException as e:  # noqa: BLE001
        out.put(repr(e))
    finally:
        dist.destroy_process_group()


def _run(rank: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_rank_main, args=(rank, out))
    proc.start()
    result = out.get(timeout=240)
    proc.join(timeout=30)
    assert isinstance(result, dict), result
    return result


@pytest.mark.parametrize("rank", [0, WORLD - 1])
def test_placements_shapes_strides_as_torch(rank: int) -> None:
    result = _run(rank)
    for case in CASES:
        mine, theirs = result[(case, "fsdp2")], result[(case, "torch")]
        assert list(mine) == list(theirs)
        for name in theirs:
            assert mine[name] == theirs[name], (case, name, mine[name], theirs[name])
