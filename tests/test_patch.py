"""``fsdp2.patch``: code written for torch's ``fully_shard`` runs on fsdp2, unchanged.

In this process: importing fsdp2 changes nothing in torch; ``apply()`` rebinds torch's
names in torch's namespaces and in every module that bound them (torch's implementation
modules keep the names their code reads), is idempotent, says so once on rank 0, and
``undo()`` restores every binding. In 2 ranks: a module torch's ``fully_shard`` sharded
before ``apply`` still trains; torch's ``fully_shard`` name then shards with fsdp2 and
trains like the local model, through DCP's ``get/set_model_state_dict`` and
``clip_grad_norm_``. In 4 ranks: test_pipeline's torch-only run (torch's ``PipelineStage``
and ``fully_shard`` names) trains like local training under the patch, also on the
zero-bubble schedule torch's own ``fully_shard`` trains wrongly. The launcher itself:
``torchrun -m fsdp2.patch script`` and ``python -m fsdp2.patch -m module``, in subprocesses
(the same script without the launcher, the control, in this process).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import pathlib
import runpy
import subprocess
import sys
import types
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _models import ToyModel, batch, full_params, loss_fn
from torch import nn

import fsdp2
import fsdp2.patch
from fsdp2._compat import stage_drives_fsdp_publicly

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
TORCH_NAMESPACES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp", "torch.distributed.pipelining")
# Private torch modules keep torch's objects (dynamo's guards read them by this path).
TORCH_PRIVATE = ("torch.distributed.fsdp._fully_shard",)


def _torch_objects() -> dict[str, Any]:
    """torch's own objects, read when this module is imported (unpatched: see the first test)."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.pipelining as torch_pp

    objects = {n: getattr(torch_fsdp, n) for n in fsdp2.patch.FSDP_NAMES if hasattr(torch_fsdp, n)}
    return objects | {"PipelineStage": torch_pp.PipelineStage}


TORCH_OBJECTS = _torch_objects()
PUBLIC_STAGE = stage_drives_fsdp_publicly()


def _bindings() -> dict[tuple[str, str], Any]:
    """Every module attribute that is one of torch's or fsdp2's objects, by (module, name)."""
    import fsdp2.pipelining

    objects = [*TORCH_OBJECTS.values(), *(getattr(fsdp2, n) for n in fsdp2.patch.FSDP_NAMES)]
    watched = {id(o): o for o in [*objects, fsdp2.pipelining.PipelineStage]}
    out = {}
    for name, module in list(sys.modules.items()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in watched and watched[id(value)] is value:
                out[(name, attr)] = value
    return out


def test_importing_fsdp2_leaves_torch_alone() -> None:
    import importlib

    for name in ("fsdp2.pipelining", "fsdp2.estimate", "fsdp2.optim", "fsdp2.patch"):
        importlib.import_module(name)
    assert not fsdp2.patch.is_applied()
    for (module, attr), value in _bindings().items():
        assert module.startswith("fsdp2") or value.__module__.startswith("torch"), (module, attr)
    for namespace in TORCH_NAMESPACES:
        module = importlib.import_module(namespace)
        for attr, theirs in TORCH_OBJECTS.items():
            assert getattr(module, attr, theirs) is theirs, (namespace, attr)


def test_apply_rebinds_everywhere_and_undo_restores(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp._fully_shard._fully_shard as impl
    import torch.distributed.pipelining as torch_pp

    import fsdp2.pipelining

    monkeypatch.delenv("RANK", raising=False)
    client = types.ModuleType("a_client_library")  # ``from torch.distributed.fsdp import fully_shard``
    client.fully_shard, client.Policy = torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy
    monkeypatch.setitem(sys.modules, "a_client_library", client)
    importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_api")
    before = _bindings()
    for name in [n for n in sys.modules if n.startswith("torch.distributed._composable.fsdp")]:
        monkeypatch.delitem(sys.modules, name)  # imported again below, while applied
    torch_fully_shard, torch_module_cls = torch_fsdp.fully_shard, torch_fsdp.FSDPModule
    patch = fsdp2.patch.apply()
    try:
        for namespace in TORCH_NAMESPACES:
            module = importlib.import_module(namespace)
            for attr in fsdp2.patch.FSDP_NAMES:
                if hasattr(module, attr):
                    assert getattr(module, attr) is getattr(fsdp2, attr), (namespace, attr)
        # Before torch 2.15 torch's stage name becomes fsdp2's; from 2.15 torch's own stage
        # and schedules are given fsdp2's FSDPModule (they drive it through public methods).
        stage_module = sys.modules["torch.distributed.pipelining.stage"]
        want_stage = TORCH_OBJECTS["PipelineStage"] if PUBLIC_STAGE else fsdp2.pipelining.PipelineStage
        assert torch_pp.PipelineStage is want_stage and stage_module.PipelineStage is want_stage
        assert client.fully_shard is fsdp2.fully_shard and client.Policy is fsdp2.MixedPrecisionPolicy
        # torch's implementation keeps what its own code reads, and its private modules all.
        assert impl.FSDPModule is torch_module_cls and impl.fully_shard is torch_fully_shard
        for namespace in TORCH_PRIVATE:
            assert importlib.import_module(namespace).FSDPModule is torch_module_cls, namespace
        assert stage_module.FSDPModule is (fsdp2.FSDPModule if PUBLIC_STAGE else torch_module_cls)
        late = types.ModuleType("imported_after_apply")
        late.FSDPModule = torch_module_cls
        monkeypatch.setitem(sys.modules, "imported_after_apply", late)
        assert fsdp2.patch.apply() is patch  # idempotent, and it picks up the late binding
        assert late.FSDPModule is fsdp2.FSDPModule
        with fsdp2.patch.applied():  # already applied: leaves it applied on exit
            pass
        assert fsdp2.patch.is_applied()
    finally:
        fsdp2.patch.undo()
    err = capsys.readouterr().err
    assert err.count("fsdp2.patch:") == 1 and "fully_shard" in err, err
    assert not fsdp2.patch.is_applied()
    assert client.fully_shard is torch_fully_shard and late.FSDPModule is torch_module_cls
    after = {k: v for k, v in _bindings().items() if k[0] != "imported_after_apply"}
    assert after == before, sorted(set(after.items()) ^ set(before.items()), key=str)
    fsdp2.patch.undo()  # a no-op when not applied


def test_applied_context_and_quiet_ranks(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.fsdp as torch_fsdp

    monkeypatch.setenv("RANK", "1")
    original = torch_fsdp.fully_shard
    with fsdp2.patch.applied() as patch:
        assert torch_fsdp.fully_shard is fsdp2.fully_shard and patch.is_active
    assert torch_fsdp.fully_shard is original and not patch.is_active
    assert "fsdp2.patch" not in capsys.readouterr().err  # only rank 0 speaks


_FAKE_TORCH_MODULE = """
import functools
import importlib
import importlib.util
from torch.distributed.fsdp import FSDPModule, fully_shard, MixedPrecisionPolicy, OffloadPolicy

def by_string():
    return globals()["fully_shard"]

@functools.lru_cache
def cached():
    return isinstance(None, FSDPModule)

def _policy(x):
    return MixedPrecisionPolicy

partial = functools.partial(_policy, 1)
"""


def test_torch_code_reading_names_indirectly_keeps_them(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch module whose code reads the names by string, through ``lru_cache`` or a
    ``functools.partial`` keeps torch's objects; what no code of it reads is rebound."""
    path = tmp_path / "zz_fake.py"
    path.write_text(_FAKE_TORCH_MODULE)
    spec = importlib.util.spec_from_file_location("torch.zz_fake", path)
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    monkeypatch.setitem(sys.modules, "torch.zz_fake", fake)
    with fsdp2.patch.applied():
        assert fake.fully_shard is not fsdp2.fully_shard  # read through globals()["fully_shard"]
        assert fake.FSDPModule is not fsdp2.FSDPModule  # read inside an lru_cache function
        assert fake.MixedPrecisionPolicy is not fsdp2.MixedPrecisionPolicy  # inside a partial's function
        assert fake.OffloadPolicy is fsdp2.OffloadPolicy  # read by no code of the module


def test_a_failing_apply_leaves_torch_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _bindings()

    class Refuses(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            raise RuntimeError("read-only module")

    refuses = Refuses("zz_refuses")
    object.__setattr__(refuses, "fully_shard", TORCH_OBJECTS["fully_shard"])
    monkeypatch.setitem(sys.modules, "zz_refuses", refuses)
    with pytest.raises(RuntimeError, match="read-only module"):
        fsdp2.patch.apply()
    assert not fsdp2.patch.is_applied()
    monkeypatch.delitem(sys.modules, "zz_refuses")
    assert _bindings() == before


def test_applied_blocks_nest_across_threads() -> None:
    import threading

    import torch.distributed.fsdp as torch_fsdp

    original = torch_fsdp.fully_shard
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with fsdp2.patch.applied():
            inside.set()
            leave.wait(10)

    with fsdp2.patch.applied():
        thread = threading.Thread(target=other)
        thread.start()
        inside.wait(10)
    assert torch_fsdp.fully_shard is fsdp2.fully_shard  # the other thread's block is still open
    leave.set()
    thread.join()
    assert torch_fsdp.fully_shard is original


# ----------------------------------------------------------------- 2 ranks


def _train(model: nn.Module, rank: int, world: int, steps: int = 2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        ids, targets = batch(rank + 10 * step, 4)
        loss = loss_fn(model(ids), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(world: int, steps: int = 2) -> dict[str, torch.Tensor]:
    """The local model fed every rank's batch, with the same clipping."""
    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=False).double()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(steps):
        for rank in range(world):
            ids, targets = batch(rank + 10 * step, 4)
            (loss_fn(ref(ids), targets) / world).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return full_params(ref)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    errors = [((got[n] - want[n]).abs() / (1e-12 + 1e-10 * want[n].abs())).max().item() for n in want]
    return max(math.inf if math.isnan(e) else e for e in errors)  # NaN is a mismatch


def _sharded(shard: Any) -> nn.Module:
    torch.manual_seed(0)
    model = ToyModel(scalar_gate=False).double()
    for block in model.blocks:
        shard(block)
    shard(model)
    return model


def _two_rank_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    earlier = _sharded(torch_fsdp.fully_shard)  # torch's, before apply
    with fsdp2.patch.applied():
        model = _sharded(torch_fsdp.fully_shard)  # the name torch code calls
        out = {
            "is_torch_fsdp_module": isinstance(model, torch_fsdp.FSDPModule) and isinstance(model.blocks[0], torch_fsdp.FSDPModule),
            "is_fsdp2": isinstance(model, fsdp2.FSDPModule) and "_fsdp2_state" in model.__dict__,
            "earlier_not_rebound_class": not isinstance(earlier, torch_fsdp.FSDPModule),
        }
        _train(earlier, rank, world)
        _train(model, rank, world)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        want = _reference(world)
        out["earlier_worst"] = _worst(full_params(earlier), want)
        out["worst"] = _worst(full_params(model), want)
        out["full_dict_worst"] = _worst({k: v for k, v in full.items() if k in want}, want)
        fresh = _sharded(torch_fsdp.fully_shard)
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
        out["loaded_worst"] = _worst(full_params(fresh), want)
    return out


@functools.cache
def _two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_rank_worker, 2)


def test_torch_names_shard_with_fsdp2_and_train_like_local() -> None:
    for out in _two_ranks():
        assert out["is_torch_fsdp_module"] and out["is_fsdp2"] and out["earlier_not_rebound_class"], out
        for key in ("worst", "full_dict_worst", "loaded_worst"):
            assert out[key] <= 1.0, (key, out)


def test_torch_modules_sharded_before_apply_still_train() -> None:
    for out in _two_ranks():
        assert out["earlier_worst"] <= 1.0, out


# ----------------------------------------------------------------- pipelines, 4 ranks
PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


def _pipeline_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed.pipelining as pp
    from test_pipeline import _run

    import fsdp2.pipelining

    out: dict[str, Any] = {"torch_unpatched_ZBV": _run("torch", "ZBVZeroBubble", None, rank)["worst"]}
    with fsdp2.patch.applied():
        out["stage_is_fsdp2"] = pp.PipelineStage is fsdp2.pipelining.PipelineStage
        out["stage_drives_fsdp2"] = pp.stage.FSDPModule is fsdp2.FSDPModule
        for schedule in PIPELINE_SCHEDULES:
            out[schedule] = _run("torch", schedule, None, rank)  # torch's names only
    return out


def test_torch_pipeline_code_trains_like_local_under_the_patch() -> None:
    for out in run_ranks(_pipeline_worker, 4, timeout=300):
        # torch 2.15: torch's own stage, driving fsdp2's modules; before: fsdp2's stage.
        assert (out["stage_is_fsdp2"], out["stage_drives_fsdp2"]) == (not PUBLIC_STAGE, PUBLIC_STAGE), out
        assert out["torch_unpatched_ZBV"] > 1.0, out  # the same code on torch's fully_shard: wrong
        for schedule in PIPELINE_SCHEDULES:
            run = out[schedule]
            assert run["worst"] <= 1.0, (schedule, run)
            assert all(step.get("reduce", 0) == run["groups"] for step in run["counts"]), (schedule, run)


# ----------------------------------------------------------------- the launcher


def _launch(args: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, *args]
    return subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def _reports(proc: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("PATCH_SCRIPT ")]


def test_launcher_torchrun_script() -> None:
    script = str(TESTS / "_patch_script.py")
    proc = _launch(
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "fsdp2.patch", script,
         "--steps", "2"],
        ROOT,
    )
    reports = _reports(proc)
    assert len(reports) == 2, proc.stdout
    for out in reports:
        assert out["fully_shard"] == "fsdp2.fully_shard" and out["FSDPModule"] == "fsdp2._module", out
        assert out["PipelineStage"] == ("torch.distributed.pipelining.stage" if PUBLIC_STAGE else "fsdp2.pipelining"), out
        assert out["argv"] == [script, "--steps", "2"] and out["name"] == "__main__", out
        assert out["worst"] <= 1.0, out
        assert out["gathered_gathers"] == 3, out  # the 3 blocks (the root owns none), once for 5 forwards
    assert proc.stderr.count("fsdp2.patch:") == 1, proc.stderr  # rank 0 only


def test_launcher_module_and_without_it(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    patched = _reports(_launch(["-m", "fsdp2.patch", "-m", "_patch_script", "--flag", "x"], TESTS))
    # Without the launcher: the script as ``__main__`` in this process, where nothing
    # applied the patch (no interpreter of its own: importing torch again proves nothing
    # more; test_importing_fsdp2_leaves_torch_alone checks what importing fsdp2 does).
    script = str(TESTS / "_patch_script.py")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: the names only, no training
    monkeypatch.setattr(sys, "argv", [script])
    assert not fsdp2.patch.is_applied()
    capfd.readouterr()
    runpy.run_path(script, run_name="__main__")
    out = capfd.readouterr().out
    plain = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("PATCH_SCRIPT ")]
    assert len(plain) == 1, out
    stage = "torch.distributed.pipelining.stage" if PUBLIC_STAGE else "fsdp2.pipelining"
    assert patched[0]["fully_shard"] == "fsdp2.fully_shard" and patched[0]["PipelineStage"] == stage
    assert patched[0]["argv"] == [str(TESTS / "_patch_script.py"), "--flag", "x"] and patched[0]["name"] == "__main__"
    assert plain[0]["fully_shard"].startswith("torch.") and plain[0]["PipelineStage"].startswith("torch.")


@pytest.mark.parametrize(
    "args,fragment",
    [([], "usage"), (["-m"], "-m expects a module name"), (["--nope"], "unknown option"), (["missing.py"], "no script")],
)
def test_launcher_bad_arguments(args: list[str], fragment: str) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp2.patch.main(args)
    assert info.value.code != 0
    assert not fsdp2.patch.is_applied()
    if isinstance(info.value.code, str):
        assert fragment in info.value.code
