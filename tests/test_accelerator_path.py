"""The collectives GPUs take, on every CI run: with gloo's own strategies switched off in
the ranks (no all-to-all reduce, no in-place gather or reduce: what ``MeshInfo.on_gloo``
picks on gloo), the main themes train at float64 parity with one local replica fed the
global batch, at 4 ranks: 1-D (resharding, an integer reshard, unused and frozen
parameters, accumulation), HSDP (and uneven ``Shard(1)``), FSDP over TP and replicas-only
``dp_mesh_dims``, activation checkpointing, pipeline schedules, bf16 mixed precision, and
a DCP round trip. The scenarios are the themes' own test functions, run here through the
reduce-scatter / all-gather path (the NCCL-shaped one)."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from typing import Any

import pytest
import torch
from _dist import run_scenarios
from _models import worst as _worst

WORLD = 4


def accelerator_path() -> None:
    """In this rank, every mesh fully_shard describes from now on takes the accelerator's
    path (a test concern: users have no knob for it), and an all-to-all would fail."""
    import dataclasses

    import torch.distributed as dist

    import fsdp2.comm.mesh as mesh_module

    if getattr(mesh_module.MeshInfo.from_mesh, "accelerator_path", False):
        return
    original = mesh_module.MeshInfo.from_mesh.__func__

    def from_mesh(cls: Any, mesh: Any, spmd: Any = None) -> Any:
        return dataclasses.replace(original(cls, mesh, spmd), on_gloo=False)

    from_mesh.accelerator_path = True  # type: ignore[attr-defined]
    mesh_module.MeshInfo.from_mesh = classmethod(from_mesh)

    import fsdp2

    original_all_to_all = dist.ProcessGroup.all_to_all_single
    package = os.path.join(os.path.dirname(fsdp2.__file__), "")

    def no_all_to_all(pg: Any, *args: Any, **kwargs: Any) -> Any:
        """fsdp2 issues no all-to-all there except a quantized reduce's (``all_to_all_rows``,
        on every backend); a model may (Mixture-of-Experts dispatch)."""
        caller = sys._getframe(1).f_code
        if caller.co_filename.startswith(package) and caller.co_name != "all_to_all_rows":
            raise AssertionError("an all-to-all on the accelerator path (gloo's reduce strategy leaked)")
        return original_all_to_all(pg, *args, **kwargs)

    dist.ProcessGroup.all_to_all_single = no_all_to_all  # type: ignore[method-assign]


def _one_d(rank: int, world: int) -> dict[str, Any]:
    import test_training_parity as t

    import fsdp2

    accelerator_path()
    names = ("reshard_true", "reshard_int", "unused_params", "frozen", "grad_accum", "meta_init")
    return {n: t._run_config(t.CONFIGS[n], fsdp2, True, rank, world) for n in names}


def _hsdp_and_tp(rank: int, world: int) -> dict[str, Any]:
    import test_nd_meshes as nd
    import test_tensor_parallel as tp

    import fsdp2

    accelerator_path()
    out = {n: nd._run(nd.CONFIGS[n], fsdp2, rank, True)["worst"] for n in ("hsdp", "hsdp_no_sync", "shard_1_uneven")}
    out["dp_tp"] = tp._run(tp.CONFIGS["dp_tp"], fsdp2)["worst"]
    out["spmd_ddp_tp"] = tp._run_spmd(tp.SPMD_CONFIGS["spmd_ddp_tp"], fsdp2)["worst"]
    return out


def _ac_pipeline_mp(rank: int, world: int) -> dict[str, Any]:
    import test_activation_checkpointing as ac
    import test_mixed_precision as mp
    import test_pipeline as pp

    import fsdp2

    accelerator_path()
    out: dict[str, Any] = {f"ac_{form}": ac._parity(form, fsdp2, rank, world) for form in ("wrapper", "selective")}
    out.update({f"pp_{s}": pp._run("fsdp2", s, None, rank)["worst"] for s in ("1F1B", "ZBVZeroBubble")})
    out["bf16"] = _worst(list(mp._worker(rank, world, "fsdp2", 1)["errors"].values()))
    return out


def _checkpoint(rank: int, world: int, path: str) -> bool:
    import test_state_dict as sd

    accelerator_path()
    saved = sd._dcp_worker(rank, world, path, "save")
    loaded = sd._dcp_worker(rank, world, path, "load")
    return all(torch.equal(loaded["params"][n], v) for n, v in saved["params"].items())


@functools.cache
def _spawned() -> dict[str, list[Any]]:
    path = os.path.join(tempfile.mkdtemp(prefix="fsdp2-accel-"), "ckpt")
    return run_scenarios(WORLD, {
        "1d": (_one_d, ()),
        "hsdp_tp": (_hsdp_and_tp, ()),
        "ac_pp_mp": (_ac_pipeline_mp, ()),
        "checkpoint": (_checkpoint, (path,)),
    })


@pytest.mark.parametrize("theme", ["1d", "hsdp_tp", "ac_pp_mp", "checkpoint"])
def test_accelerator_path_trains_at_parity(theme: str) -> None:
    for out in _spawned()[theme]:
        if theme == "1d":
            for name, res in out.items():
                assert res["loss"] <= 1e-10 and res["param"] <= 1e-10, (name, res)
        elif theme == "checkpoint":
            assert out is True
        else:
            for name, worst in out.items():
                # pipeline and checkpointing report errors relative to their tolerance (<= 1)
                tol = 1e-6 if name == "bf16" else 1.0 if name.startswith(("pp_", "ac_")) else 1e-10
                assert worst <= tol, (name, worst)
