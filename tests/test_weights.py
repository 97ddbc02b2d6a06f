"""Weights out, memory back (reinforcement-learning loops): ``fsdp2.full_weights`` equal,
bit for bit, to the per-parameter loop's ``p.full_tensor().to(dtype)`` on 1-D, uneven
and dim-1 shards, HSDP, dp x tp and expert meshes, with quantized gathers configured and
with modules left unsharded, in one all-gather per bucket (plus one per model-parallel
mesh dim) and at most two groups gathered at once; ``held_bytes`` / ``release_memory``
and a ``model.cpu()`` / ``model.to()`` round trip with the optimizer state moved by
hand, training on exactly as without (fsdp2 and torch's ``fully_shard`` alike)."""

from __future__ import annotations

import weakref
from typing import Any
from unittest import mock

import pytest
import torch
from _comm import CommCounter
from _dist import cached_outcome, run_scenarios
from _models import ToyModel, batch, full_params, impl, loss_fn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2


def _reference(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The per-parameter loop RL trainers write: one ``full_tensor()`` per entry."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.to(dtype) if dtype is not None and full.is_floating_point() else full
    return out


def _export(model: torch.nn.Module, **kwargs: Any) -> tuple[list[tuple[str, torch.Tensor]], int, int]:
    """(what ``full_weights`` yields, its all-gathers, the most gathers alive at a yield)."""
    from fsdp2.weights import export

    alive: list[weakref.ref] = []
    original = export.start_group

    def tracked(*args: Any) -> Any:
        out = original(*args)
        alive.append(weakref.ref(out))
        return out

    most = 0
    got = []
    with CommCounter().active() as counter, mock.patch.object(export, "start_group", tracked):
        for name, value in fsdp2.full_weights(model, **kwargs):
            most = max(most, sum(r() is not None for r in alive))
            got.append((name, value))
    return got, counter.calls["all_gather"], most


def _compare(model: torch.nn.Module, dtype: torch.dtype | None, **kwargs: Any) -> dict[str, Any]:
    want = _reference(model, dtype)
    got, gathers, most = _export(model, dtype=dtype, **kwargs)
    names = [n for n, _ in got]
    bad = [n for n, v in got if not (v.dtype == want[n].dtype and v.shape == want[n].shape and torch.equal(v, want[n]))]
    firsts: dict[int, str] = {}  # the state dict's names, a tied tensor under its first
    for name, t in model.state_dict(keep_vars=True).items():
        firsts.setdefault(id(t), name)
    return {"names": sorted(names) == sorted(firsts.values()) and len(names) == len(set(names)), "bad": bad,
            "gathers": gathers, "most_alive": most, "count": len(got)}


def _toy(rank: int, world: int, mesh: Any = None, **shard_kwargs: Any) -> torch.nn.Module:
    """ToyModel in float64 (uneven 7-row weights, a 0-dim gate, tied head), its blocks
    and root sharded, after one training step (the values are no longer the init's)."""
    torch.manual_seed(0)
    model = ToyModel().double()
    placement = shard_kwargs.pop("dim1", None)
    for i, block in enumerate(model.blocks):
        fn = (lambda p: Shard(1) if p.dim() == 2 else None) if placement and i == 1 else None
        fsdp2.fully_shard(block, mesh=mesh, shard_placement_fn=fn, **shard_kwargs)
    fsdp2.fully_shard(model, mesh=mesh, **shard_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ids, targets = batch(0, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()
    return model


def _peak(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """The most bytes of tensors ``full_weights`` made alive at once (each yielded tensor
    dropped by the caller), and the bound: two groups' gathers at full size, the next
    group's cast shard and the largest parameter twice (a dim-1 shard's blocks are made
    contiguous before they are copied out)."""
    from fsdp2._module import groups_under
    from fsdp2.memory.tracker import MemoryTracker

    tracker = MemoryTracker(lambda: "export", lambda: "")
    groups = groups_under(model)
    with tracker:  # what exists already: counted before
        for t in [b.sharded_flat for g in groups for b in g.buckets] + [p.to_local() for p in model.parameters()]:
            torch.ops.aten.alias(t)
        tracker.reset_peak()
    base = tracker.now
    with tracker:
        for _, value in fsdp2.full_weights(model, dtype=dtype):
            del value
    size = dtype.itemsize
    gathered = [sum(b.comm.shard_size * b.shard_numel * size for b in g.buckets) for g in groups]
    shards = [sum(b.shard_numel * size for b in g.buckets) for g in groups]
    pairs = [gathered[i] + gathered[i + 1] + shards[i + 1] for i in range(len(groups) - 1)] or gathered
    largest = max(p.numel() * size for p in model.parameters())
    return {"peak": tracker.peak - base, "bound": max(pairs) + 2 * largest}


def _peak_while_the_backend_holds(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """``_peak`` with a communication backend that keeps every collective's tensors until
    the export ends (gloo's worker thread drops a finished one a moment after ``wait()``,
    under load later): the export frees them itself, the peak does not depend on it."""
    from fsdp2.weights import gather

    held = []
    original = gather.all_gather_flat

    def holding(shard: torch.Tensor, output: torch.Tensor, *args: Any) -> Any:
        held.append((shard, output))
        return original(shard, output, *args)

    with mock.patch.object(gather, "all_gather_flat", holding):
        out = _peak(model, dtype)
    out["held"] = len(held)
    return out


def _one_d(rank: int, world: int) -> dict[str, Any]:
    model = _toy(rank, world, dim1=True)
    out = {"f64": _compare(model, None), "bf16": _compare(model, torch.bfloat16)}
    out["memory"] = _peak(model, torch.bfloat16)
    out["memory_backend_holds"] = _peak_while_the_backend_holds(model, torch.bfloat16)
    got, gathers, _ = _export(model, dtype=torch.bfloat16, rank0_only=True)
    out["rank0_only"] = {"count": len(got), "gathers": gathers}
    model(batch(1, 2 * world)[0].chunk(world)[rank])  # the root stays unsharded after its forward
    out["unsharded"] = _compare(model, torch.float32)
    model.blocks[0].unshard()  # explicitly unsharded too
    out["unsharded_explicit"] = _compare(model, torch.bfloat16)
    model.blocks[0].reshard()
    for bad in (torch.int64, "bf16"):
        try:
            fsdp2.full_weights(model, dtype=bad)
            out[f"bad {bad}"] = "accepted"
        except TypeError as e:
            out[f"bad {bad}"] = str(e)
    return out


def _wrapped(rank: int, world: int) -> dict[str, Any]:
    """Blocks inside activation checkpoint wrappers (torchtitan's order): the state dict's
    names, without the wrappers' prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = ToyModel().double()
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
        fsdp2.fully_shard(model.blocks[i])
    fsdp2.fully_shard(model)
    out = _compare(model, torch.bfloat16)
    out["prefix_free"] = not any("_checkpoint_wrapped_module" in n for n, _ in fsdp2.full_weights(model))
    return out


def _integer(rank: int, world: int) -> dict[str, Any]:
    """An integer parameter (its own bucket) goes out as it is, not cast."""
    torch.manual_seed(0)
    model = ToyModel(scalar_gate=False)
    model.blocks[0].counts = torch.nn.Parameter(torch.arange(7) * 1_000_003 + 16_777_217, requires_grad=False)
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    return {"bf16": _compare(model, torch.bfloat16)}


def _two_dim_tp(rank: int, world: int) -> dict[str, Any]:
    """Parameters on a 2-D model-parallel mesh, sharded by both dims (the same tensor
    dim twice, and two dims), with uneven pieces, under a data-parallel mesh of one."""
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "a", "b"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7, bias=False), torch.nn.Linear(7, 9, bias=False)).double()
    for layer, placements in zip(model, ([Shard(0), Shard(0)], [Shard(0), Shard(1)])):
        full = layer.weight.detach()
        layer.weight = torch.nn.Parameter(distribute_tensor(full, mesh["a", "b"], placements))
    fsdp2.fully_shard(model, mesh=mesh["dp"])
    return {"bf16": _compare(model, torch.bfloat16), "f64": _compare(model, None)}


def _offloaded(rank: int, world: int) -> dict[str, Any]:
    """``CPUOffloadPolicy`` as on an accelerator (host shards, gathers on the "device":
    tests/test_cpu_offload.py's stand-in, with its accelerator path; last in its ranks)."""
    from test_cpu_offload import force_offload

    force_offload()
    model = _toy(rank, world, offload_policy=fsdp2.CPUOffloadPolicy(pin_memory=False))
    offloaded = all(b.offload is not None for g in [model.blocks[0]._get_fsdp_state().group] for b in g.buckets)
    return {"bf16": _compare(model, torch.bfloat16), "offloaded": offloaded}


def _quantized(rank: int, world: int) -> dict[str, Any]:
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, quantize_gather="int8")
    torch.manual_seed(0)
    model = ToyModel().float()
    for block in model.blocks:
        fsdp2.fully_shard(block, mp_policy=policy)
    fsdp2.fully_shard(model, mp_policy=policy)
    return {"bf16": _compare(model, torch.bfloat16), "f32": _compare(model, None)}


def _hsdp(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return {"bf16": _compare(_toy(rank, world, mesh=mesh), torch.bfloat16)}


def _dp_tp(rank: int, world: int) -> dict[str, Any]:
    from _tp_model import TPModel, parallelize

    torch.manual_seed(0)
    model = TPModel(vocab=16, n_blocks=2).double()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"])
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh["dp"])
    fsdp2.fully_shard(model, mesh=mesh["dp"])
    return {"bf16": _compare(model, torch.bfloat16), "f64": _compare(model, None)}


def _experts(rank: int, world: int) -> dict[str, Any]:
    from test_moe import build

    _, model = build({"ep": 2}, fsdp2, world=world)
    return {"bf16": _compare(model, torch.bfloat16)}


def _launcher(rank: int, world: int) -> dict[str, Any]:
    """Code written against torch's names, under ``python -m fsdp2.patch``'s rebinding."""
    import fsdp2.patch

    with fsdp2.patch.applied():
        import torch.distributed.fsdp as torch_fsdp

        torch.manual_seed(0)
        model = ToyModel().double()
        for block in model.blocks:
            torch_fsdp.fully_shard(block)
        torch_fsdp.fully_shard(model)
        return {"bf16": _compare(model, torch.bfloat16), "fsdp2s": isinstance(model, fsdp2.FSDPModule)}


@cached_outcome
def _at(world: int) -> dict[str, list]:
    scenarios: dict[str, tuple] = {"one_d": (_one_d, ()), "quantized": (_quantized, ()), "integer": (_integer, ()),
                                   "wrapped": (_wrapped, ())}
    if world == 4:
        scenarios.update(hsdp=(_hsdp, ()), dp_tp=(_dp_tp, ()), experts=(_experts, ()), two_dim_tp=(_two_dim_tp, ()))
    else:
        scenarios.update(moves=(_moves, ("fsdp2",)), moves_torch=(_moves, ("torch",)), release=(_release, ()),
                         launcher=(_launcher, ()), offloaded=(_offloaded, ()))  # offloaded last: it patches
    return run_scenarios(world, scenarios)


def _ok(result: dict[str, Any], gathers: int | None = None) -> None:
    assert result["names"] and not result["bad"], result
    assert result["most_alive"] <= 2, result  # the current group and the prefetched one
    if gathers is not None:
        assert result["gathers"] == gathers, result


# ToyModel: 3 blocks + the root, one bucket each.
@pytest.mark.parametrize("world", [2, 4])
def test_full_weights_equal_the_per_parameter_loop_in_one_gather_per_group(world: int) -> None:
    for rank, out in enumerate(_at(world)["one_d"]):
        for case in ("f64", "bf16", "unsharded", "unsharded_explicit"):
            _ok(out[case], gathers=4)
        assert out["rank0_only"]["gathers"] == 4, out
        assert out["rank0_only"]["count"] == (out["f64"]["count"] if rank == 0 else 0), out
        assert "floating-point torch.dtype" in out["bad torch.int64"] and "'bf16'" in out["bad bf16"], out
        assert 0 < out["memory"]["peak"] <= out["memory"]["bound"], out["memory"]
        held = out["memory_backend_holds"]
        assert held["held"] == 4 and 0 < held["peak"] <= held["bound"], held


@pytest.mark.parametrize("world", [2, 4])
def test_full_weights_name_tensors_as_the_state_dict_does(world: int) -> None:
    for out in _at(world)["wrapped"]:
        assert out["prefix_free"], out
        _ok(out, gathers=4)


@pytest.mark.parametrize("world", [2, 4])
def test_full_weights_leave_integer_parameters_as_they_are(world: int) -> None:
    for out in _at(world)["integer"]:
        _ok(out["bf16"], gathers=5)  # one more bucket: the integer parameter's


@pytest.mark.parametrize("world", [2, 4])
def test_full_weights_are_not_quantized(world: int) -> None:
    for out in _at(world)["quantized"]:
        _ok(out["bf16"], gathers=4)
        _ok(out["f32"], gathers=4)


@pytest.mark.parametrize("case", ["hsdp", "dp_tp", "experts", "two_dim_tp"])
def test_full_weights_on_hsdp_tensor_parallel_and_expert_meshes(case: str) -> None:
    # dp x tp: each of the 3 groups gathers once over dp and once over tp; experts: 2 blocks
    # of a dense and an expert bucket, plus the root, then one gather over ep per block;
    # a 2-D model-parallel mesh under a dp mesh of one: one gather per mesh dim.
    gathers = {"hsdp": 4, "dp_tp": 6, "experts": 7, "two_dim_tp": 2}[case]
    for out in _at(4)[case]:
        for result in out.values():
            _ok(result, gathers=gathers)


def test_full_weights_with_cpu_offload() -> None:
    for out in _at(2)["offloaded"]:
        assert out["offloaded"], out
        _ok(out["bf16"], gathers=4)


def test_full_weights_under_the_launcher_for_code_written_against_torchs_names() -> None:
    for out in _at(2)["launcher"]:
        assert out["fsdp2s"], out
        _ok(out["bf16"], gathers=4)


# ------------------------------------------------------------------ memory back
def _step(model: torch.nn.Module, opt: Any, step: int, rank: int, world: int) -> None:
    ids, targets = batch(step, 2 * world)
    loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    opt.step()
    opt.zero_grad()


def _move_optimizer_state(opt: torch.optim.Optimizer, device: Any) -> None:
    """What verl's offload helpers do with the optimizer state (also to a dtype)."""
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor):
                    opt.state[p][key] = value.to(device, non_blocking=True)


def _moves(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    """Two twins, one moved off and back (``model.cpu()``, ``model.to(device)``, the
    optimizer state by hand) between steps, the other not: the same parameters after."""
    lib = impl(lib_name)
    runs = []
    for move in (False, True):
        torch.manual_seed(0)
        model = ToyModel(scalar_gate=False)
        for block in model.blocks:
            lib.fully_shard(block)
        lib.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(4):
            _step(model, opt, step, rank, world)
            if move:
                model.cpu()
                _move_optimizer_state(opt, "cpu")
                model.to("cpu")
                _move_optimizer_state(opt, "cpu")
                # new storage on the way out and back, exactly (float32 -> float64 -> float32)
                model.double()
                _move_optimizer_state(opt, torch.float64)
                model.float()
                _move_optimizer_state(opt, torch.float32)
        runs.append(full_params(model))
    same = all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    return {"same": same}


def _buckets(model: torch.nn.Module) -> list[Any]:
    from fsdp2._module import groups_under

    return [b for g in groups_under(model) for b in g.buckets]


def _release(rank: int, world: int) -> dict[str, Any]:
    runs, out = [], {}
    for release in (False, True):
        torch.manual_seed(0)
        model = ToyModel().double()
        for block in model.blocks:
            fsdp2.fully_shard(block, reshard_after_forward=False)
        fsdp2.fully_shard(model)
        model.set_keep_unsharded_storage(release)  # release_memory frees even kept storage
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(3):
            _step(model, opt, step, rank, world)
            if release:
                model(batch(9, 2 * world)[0].chunk(world)[rank])  # a forward leaves the groups gathered
                out.setdefault("before", fsdp2.held_bytes(model, "cpu"))
                fsdp2.release_memory(model)
                out.setdefault("after", fsdp2.held_bytes(model))
                out["flat_bytes"] = sum(b.sharded_flat.untyped_storage().nbytes() for b in _buckets(model))
        if release:  # gradients waiting for a reduce: refused, nothing changed
            model.set_requires_gradient_sync(False)
            ids, targets = batch(7, 2 * world)
            loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
            held = fsdp2.held_bytes(model)
            try:
                fsdp2.release_memory(model)
                out["refused"] = "released"
            except RuntimeError as e:
                out["refused"] = str(e)
            out["unchanged"] = fsdp2.held_bytes(model) == held
            model.set_requires_gradient_sync(True)
            model.zero_grad()
        runs.append(full_params(model))
    out["same"] = all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    model.to("meta")  # moved off the host (as off a GPU by model.cpu()): fsdp2 holds nothing there
    out["moved_off"] = fsdp2.held_bytes(model, "cpu")
    out["moved_to"] = sorted(fsdp2.held_bytes(model, "meta"))
    return out


@pytest.mark.parametrize("lib_name", ["fsdp2", "torch"])
def test_a_device_round_trip_between_steps_trains_on_exactly(lib_name: str) -> None:
    for out in _at(2)["moves" if lib_name == "fsdp2" else "moves_torch"]:
        assert out["same"], out


def test_release_memory_gives_back_what_fsdp2_can_rebuild_and_training_goes_on() -> None:
    for out in _at(2)["release"]:
        before, after = out["before"], out["after"]
        assert before.get("unsharded parameters", 0) > 0 and before.get("pooled buffers", 0) > 0, before
        assert set(after) <= {"sharded parameters", "gradients"}, after
        assert after["sharded parameters"] == out["flat_bytes"], out  # each shard's memory once
        assert "waiting to be reduced" in out["refused"] and out["unchanged"], out
        assert out["same"], out
        assert out["moved_off"] == {} and "sharded parameters" in out["moved_to"], out
