"""At scale without hardware: one rank of a 512-rank job on the fake process group, the
model on the meta device. Every parameter's placements, local shape and stride equal
those torch's ``fully_shard`` gives on the same model: FSDP x TP (dp 64 x tp 8), HSDP x
TP (8 x 8 x 8), and 1D with Shard(1); the first rank and the last (whose shards are
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
}


def _layouts(case: str, lib_name: str) -> dict[str, Any]:
    import importlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    lib = importlib.import_module("fsdp2" if lib_name == "fsdp2" else "torch.distributed.fsdp")
    shape, names = CASES[case]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with torch.device("meta"):
        model = TPModel(vocab=1000, dim=64, heads=8, hidden=168, n_blocks=2)
    kwargs: dict[str, Any] = {}
    if "tp" in names:
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
