"""Every rank a thread of one process (torch's threaded process group, which PyTorch's
own distributed tests and single-process simulators use), 4 ranks: integer
``reshard_after_forward`` (a process group derived per rank), HSDP and the all-gather
extension train at float64 parity with one local replica fed the global batch, with
fsdp2 and with torch's ``fully_shard`` alike. Groups, buffer pools and gather queues are
each rank's own: a process-wide cache made one thread create a group the others never
joined (a hang), and a shared buffer pool could hand one buffer to two ranks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import test_extension
import torch
from _models import ToyModel, batch, full_params, impl, loss_fn
from _models import worst as _worst
from _threads import run_threads
from torch.distributed.device_mesh import init_device_mesh

WORLD = 4
LIBS = ("fsdp2", "torch")
CONFIGS: dict[str, dict[str, Any]] = {
    "reshard_int": dict(mesh=(WORLD,), raf=2),
    "hsdp": dict(mesh=(2, WORLD // 2)),
    "hsdp_reshard_int": dict(mesh=(1, WORLD), raf=2),
}
EXTENSION = ("two_inner_tensors_hsdp", "thread_local_hsdp", "uneven")


def _parity(lib: Any, rank: int, world: int, cfg: dict[str, Any]) -> float:
    with test_extension.INIT_LOCK:  # the threads share the random generator
        torch.manual_seed(0)
        ref = ToyModel(scalar_gate=lib.__name__ == "fsdp2").double()  # torch refuses 0-dim
    model = copy.deepcopy(ref)
    shape = cfg["mesh"]
    names = ("replicate", "shard") if len(shape) == 2 else ("dp",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for block in model.blocks:
        lib.fully_shard(block, mesh=mesh, reshard_after_forward=cfg.get("raf", True))
    lib.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(3):
        ids, targets = batch(step, 2 * world)
        loss_fn(ref(ids), targets).backward()
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    return _worst([(got[n] - want[n]).abs().max().item() for n in want])


def _all(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    out: dict[str, Any] = {name: _parity(lib, rank, world, cfg) for name, cfg in CONFIGS.items()}
    for name in EXTENSION:
        out[name] = test_extension._run(lib, rank, world, test_extension.CASES[name])
    return out


@pytest.mark.parametrize("lib_name", LIBS)
def test_threaded_process_group(lib_name: str) -> None:
    for rank, out in enumerate(run_threads(_all, WORLD, lib_name, timeout=120)):
        for name in CONFIGS:
            assert out[name] <= 1e-10, (rank, name, out[name])
        for name in EXTENSION:
            res = out[name]
            assert res["worst"] <= 1e-12 and res["kept_class"] and res["pair_gap"] == 0, (rank, name, res)
            seen, shard_meshes = res["thread_meshes"]
            if test_extension.CASES[name]["cls"] == "ThreadLocal":
                assert seen > 0 and seen == shard_meshes, (rank, name, res)
