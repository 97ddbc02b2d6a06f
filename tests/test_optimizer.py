"""Optimizer steps on local shards (``fsdp2.optim.local_step``): exact for every elementwise
``torch.optim`` class, state kept as DTensors, the DTensor path wherever the fast
path would not be exact, and nothing left swapped when a step raises."""

from __future__ import annotations

import copy
import functools
import io
import warnings
import weakref
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn as nn
from _dist import cached_outcome, run_scenarios
from _models import ToyModel, batch, full_params, loss_fn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import fsdp2
from fsdp2.optim import _plan, local_step, local_step_stats
from fsdp2.params.param import sharded_owner as _managed_by

# The first step creates the optimizer's state (most classes), the second plans a flat
# step and keeps the plan, the third reuses it: every path a longer run takes.
STEPS = 3
PER_RANK_BATCH = 2

OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.1)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=0.05, amsgrad=True, weight_decay=0.01)),
    "adamw_maximize": (torch.optim.AdamW, dict(lr=0.05, maximize=True)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, foreach=True)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, fused=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01)),
    "adamax": (torch.optim.Adamax, dict(lr=0.05)),
    "adadelta": (torch.optim.Adadelta, dict(lr=1.0)),
    "asgd": (torch.optim.ASGD, dict(lr=0.05, t0=1)),
    "nadam": (torch.optim.NAdam, dict(lr=0.05, decoupled_weight_decay=True, weight_decay=0.1)),
    "radam": (torch.optim.RAdam, dict(lr=0.05)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01, centered=True, momentum=0.5)),
}


class AdamWSubclass(torch.optim.AdamW):
    """A subclass may compute norms over a whole parameter: it steps on DTensors."""


def _build(rank: int, world: int, scalar_gate: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = ToyModel(scalar_gate=scalar_gate).double()
    model = ToyModel(scalar_gate=scalar_gate).double()
    model.load_state_dict(ref.state_dict())
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    return model, ref


def _train_step(
    model: nn.Module, ref: nn.Module, step: int, rank: int, world: int, use_extra: bool = True
) -> None:
    ids, targets = batch(step, PER_RANK_BATCH * world)
    loss_fn(ref(ids, use_extra), targets).backward()
    loss_fn(model(ids.chunk(world)[rank], use_extra), targets.chunk(world)[rank]).backward()


def _parity(
    rank: int, world: int, make_opt: Any, scalar_gate: bool = True, unused_every_other: bool = False
) -> dict[str, int]:
    """Train STEPS steps against a local reference; return the fast-path steps taken and
    the buckets stepped as one flat tensor."""
    model, ref = _build(rank, world, scalar_gate)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(STEPS):
        _train_step(model, ref, step, rank, world, use_extra=not (unused_every_other and step % 2))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}"
        )
    _check_state(model, opt, ref, ref_opt)
    assert _padding_is_zero(model)
    stats = local_step_stats(opt)
    return {"fast": stats["local_steps"], "flat": stats["flat_buckets"]}


def _padding_is_zero(model: nn.Module) -> bool:
    """Flat steps also update the shards' padding (rows past a parameter's end on this
    rank): it must stay zero, as the DTensor path leaves it."""
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            for b in m._fsdp2_state.group.buckets:
                covered = torch.zeros(b.sharded_flat.numel(), dtype=torch.bool)
                for p in b.params:
                    covered[p.offset : p.offset + b.local_view(p).numel()] = True
                if b.sharded_flat[~covered].count_nonzero():
                    return False
    return True


def _check_state(
    model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module | None = None, ref_opt: Any = None
) -> None:
    """After a step the optimizer holds the model's DTensor parameters and DTensor state,
    and (given the reference) every per-parameter scalar, such as the step count, and every
    state tensor equals the reference's."""
    params = list(model.parameters())
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(params) and all(a is b for a, b in zip(held, params))
    assert all(p.grad is None or isinstance(p.grad, DTensor) for p in params)
    for p in params:
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                assert isinstance(value, DTensor), key
                assert value.placements == p.placements, key
    assert set(map(id, opt.state)) <= set(map(id, params))
    if ref is None:
        return
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        mine, theirs = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert mine.keys() == theirs.keys(), name
        for key, want in theirs.items():
            got = mine[key]
            got = got.full_tensor() if isinstance(got, DTensor) else got
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(
                    got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name} {key}: {m}"
                )
            else:
                assert got == want, (name, key)


def _worker_all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        make = functools.partial(cls, **kwargs)
        out[name] = _parity(rank, world, make)
        out[name + "/no_scalars"] = _parity(rank, world, make, scalar_gate=False)
    adamw = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    out["adamw/unused"] = _parity(rank, world, adamw, scalar_gate=False, unused_every_other=True)
    return out


def _results(world: int) -> list[dict[str, Any]]:
    return _at(world)["all"]


CASES = [(w, n) for w in (1, 2) for n in OPTIMIZERS]


@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}-{n}" for w, n in CASES])
def test_elementwise_optimizers_match_local_training_on_local_shards(world: int, name: str) -> None:
    """Parameters, state tensors and step counts match local training. With a 0-dim
    parameter in each block only the root's bucket steps as one flat tensor; without,
    all four buckets do."""
    # The first step creates the state through DTensors; Adagrad creates it at
    # construction and plain SGD keeps none, so those take every step fast. On every
    # rank: at world 2 rank 1 holds no rows of the (1,)-shaped gate.
    fast = STEPS if name in ("sgd", "adagrad") else STEPS - 1
    for results in _results(world):
        assert results[name] == {"fast": fast, "flat": fast}
        assert results[name + "/no_scalars"] == {"fast": fast, "flat": 4 * fast}


@pytest.mark.parametrize("world", [1, 2])
def test_bucket_with_an_unused_parameter_steps_per_parameter(world: int) -> None:
    """``extra`` gets no gradient every other step: the root's bucket steps per parameter
    then, and afterwards too (its step counts differ from the embedding's)."""
    result = _results(world)[0]["adamw/unused"]
    # Steps 1..2 fast: the 3 blocks flat each time, the root never (no gradient for
    # extra at step 1, one step fewer counted for it than for emb at step 2).
    assert result["fast"] == STEPS - 1 and result["flat"] == 3 * (STEPS - 1), result


def _worker_fallbacks(rank: int, world: int) -> dict[str, int]:
    out = {}
    adamw = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    out["subclass"] = _parity(rank, world, functools.partial(AdamWSubclass, lr=0.05, weight_decay=0.1))[
        "fast"
    ]

    seen: list[bool] = []

    def with_hook(params: Any) -> torch.optim.Optimizer:
        opt = adamw(params)
        if isinstance(opt.param_groups[0]["params"][0], DTensor):
            opt.register_step_pre_hook(
                lambda o, a, k: seen.append(all(isinstance(p, DTensor) for p in o.param_groups[0]["params"]))
            )
        return opt

    out["hooked"] = _parity(rank, world, with_hook)["fast"]
    out["hook_saw_dtensors"] = len(seen) == STEPS and all(seen)

    # A closure may zero and recompute gradients inside step().
    model, ref = _build(rank, world)
    opt, ref_opt = adamw(model.parameters()), adamw(ref.parameters())
    for step in range(STEPS):

        def closure(m: nn.Module = model, r: nn.Module = ref, s: int = step) -> None:
            for o in (opt, ref_opt):
                o.zero_grad()
            _train_step(m, r, s, rank, world)

        opt.step(closure)
        ref_opt.step(lambda: None)
    got, want = full_params(model), full_params(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
    out["closure"] = local_step_stats(opt)["local_steps"]

    # A DTensor fsdp2 does not manage, in the same parameter group.
    model, _ = _build(rank, world)
    mesh = next(model.parameters()).device_mesh
    other = nn.Parameter(distribute_tensor(torch.ones(4, 3, dtype=torch.float64), mesh, [Shard(0)]))
    opt = adamw([*model.parameters(), other])
    for step in range(STEPS):
        ids, targets = batch(step, PER_RANK_BATCH)
        (loss_fn(model(ids), targets) + other.to_local().sum()).backward()
        opt.step()
        opt.zero_grad()
    out["foreign_dtensor"] = local_step_stats(opt)["local_steps"]
    # Planning a group that then falls back leaves no gradient on any alias.
    out["no_grad_left_on_aliases"] = all(
        fp._alias is None or fp._alias[1].grad is None for fp in map(_managed_by, model.parameters())
    )

    # A parameter listed twice (torch warns) and a state placeholder the step fills in.
    model, _ = _build(rank, world)
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = torch.optim.SGD([*params, params[1]], lr=0.1, momentum=0.9)
    for step in range(2):
        ids, targets = batch(step, PER_RANK_BATCH)
        loss_fn(model(ids), targets).backward()
        opt.step()
        opt.zero_grad()
    out["duplicate"] = local_step_stats(opt)["local_steps"]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        opt.state[p]["momentum_buffer"] = None  # as torch <= 2.2 saved momentum-free SGD
    ids, targets = batch(0, PER_RANK_BATCH)
    loss_fn(model(ids), targets).backward()
    opt.step()
    out["placeholder_filled_as_dtensor"] = all(
        isinstance(opt.state[p]["momentum_buffer"], DTensor) for p in params
    )
    return out


def test_fast_path_only_where_exact() -> None:
    """Subclasses, step hooks, closures, unmanaged DTensors, duplicates and state
    placeholders step on DTensors, and the results still match local training."""
    out = _at(2)["fallbacks"][0]
    assert out == dict(
        subclass=0,
        hooked=0,
        hook_saw_dtensors=True,
        closure=0,
        foreign_dtensor=0,
        no_grad_left_on_aliases=True,
        duplicate=0,
        placeholder_filled_as_dtensor=True,
    )


def _worker_raise(rank: int, world: int, scalar_gate: bool) -> dict[str, Any]:
    model, ref = _build(rank, world, scalar_gate)
    make = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    out: dict[str, Any] = {}
    steps = 4  # step 2 raises: a regular step follows it
    for step in range(steps):
        _train_step(model, ref, step, rank, world)
        if step == 2:
            # The step raises after the swap: the post-step hook never runs.
            with mock.patch("torch.optim.sgd._single_tensor_sgd", side_effect=RuntimeError("injected")):
                try:
                    opt.step()
                except RuntimeError as e:
                    out["raised"] = str(e)
            out["aliases_left"] = any(not isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
            sd = opt.state_dict()  # repairs first
            out["state_dict_dtensor"] = all(
                isinstance(v, DTensor)
                for s in sd["state"].values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            )
            opt.zero_grad()  # set_to_none on whatever the optimizer holds
            ref_opt.zero_grad()
            out["grads_cleared"] = all(p.grad is None for p in model.parameters())
            continue
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    got, want = full_params(model), full_params(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
    _check_state(model, opt, ref, ref_opt)

    # Raised, then zero_grad on the aliases, then forward: the root forward repairs,
    # and the gradients the aliases dropped are dropped on the parameters too.
    _train_step(model, ref, steps, rank, world)
    with (
        mock.patch("torch.optim.sgd._single_tensor_sgd", side_effect=RuntimeError("injected")),
        pytest.raises(RuntimeError, match="injected"),
    ):
        opt.step()
    opt.zero_grad()
    ids, _ = batch(0, PER_RANK_BATCH)
    other, _ = _build(rank, world)  # another model in the process: its forward is its own
    other(ids)
    out["left_by_another_model"] = any(not isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    model(ids)
    out["repaired_at_forward"] = all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"]) and all(
        p.grad is None for p in model.parameters()
    )
    return out


@pytest.mark.parametrize("scalar_gate", [True, False], ids=["per_param_blocks", "all_flat"])
def test_step_that_raises_leaves_nothing_swapped(scalar_gate: bool) -> None:
    out = _at(2)[f"raise_{scalar_gate}"][0]
    assert out == dict(
        raised="injected",
        aliases_left=True,
        state_dict_dtensor=True,
        grads_cleared=True,
        left_by_another_model=True,
        repaired_at_forward=True,
    )


def _worker_threads(rank: int, world: int) -> dict[str, Any]:
    """One thread is inside ``optimizer.step()`` (swapped to the local shards) while
    another runs a forward of the same kind of model, then of the same model's root
    after the step: the step in flight is left alone and finishes as without threads."""
    import threading

    model, ref = _build(rank, world, scalar_gate=False)
    other, _ = _build(rank, world, scalar_gate=False)
    make = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    for step in range(2):
        _train_step(model, ref, step, rank, world)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    _train_step(model, ref, 2, rank, world)
    inside, release = threading.Event(), threading.Event()
    import torch.optim.sgd as sgd_module

    original = sgd_module._single_tensor_sgd

    def slow(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(60)
        return original(*args, **kwargs)

    errors: list[BaseException] = []

    def step() -> None:
        try:
            opt.step()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with mock.patch("torch.optim.sgd._single_tensor_sgd", side_effect=slow):
        worker = threading.Thread(target=step)
        worker.start()
        inside.wait(60)
        ids, _ = batch(0, PER_RANK_BATCH)
        other(ids)  # another model's root forward on this thread
        swapped_during = any(not isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
        release.set()
        worker.join(60)
    ref_opt.step()
    got, want = full_params(model), full_params(ref)
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    # A step that raises on a thread which then ends: the model's next forward repairs it.
    opt.zero_grad()
    ids, targets = batch(3, PER_RANK_BATCH)
    loss_fn(model(ids), targets).backward()
    with mock.patch("torch.optim.sgd._single_tensor_sgd", side_effect=RuntimeError("injected")):
        worker = threading.Thread(target=step)
        worker.start()
        worker.join(60)
    left = any(not isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    model(ids)
    repaired = all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
    return {
        "raised_on_dead_thread_repaired": left and repaired and "injected" in repr(errors[-1:]),
        "errors": [repr(e) for e in errors[:-1]],
        "swapped_during": swapped_during,
        "restored": all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"]),
        "exact": worst <= 1e-12,
    }


def test_a_step_in_flight_on_another_thread_is_left_alone() -> None:
    out = _at(1)["threads"][0]
    assert out == dict(
        raised_on_dead_thread_repaired=True, errors=[], swapped_during=True, restored=True, exact=True
    )


def _worker_disabled(rank: int, world: int) -> int:
    with mock.patch.object(local_step, "ENABLED", False):
        return _parity(rank, world, functools.partial(torch.optim.AdamW, lr=0.05))["fast"]


def test_disabled_steps_on_dtensors() -> None:
    assert _at(2)["disabled"] == [0, 0]


def _worker_save(rank: int, world: int) -> bool:
    """torch.save / deepcopy / torch.load of both state dicts after flat steps (their
    DTensors are views into flat buffers), then resuming matches not stopping."""
    make = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    model, ref = _build(rank, world, scalar_gate=False)
    opt = make(model.parameters())
    for step in range(STEPS):
        _train_step(model, ref, step, rank, world)
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    copy.deepcopy(opt.state_dict())
    copy.deepcopy(model.state_dict())
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed, _ = _build(rank, world, scalar_gate=False)
    resumed.load_state_dict(saved["model"])
    resumed_opt = make(resumed.parameters())
    resumed_opt.load_state_dict(saved["optim"])
    for m, o in ((model, opt), (resumed, resumed_opt)):
        _train_step(m, ref, STEPS, rank, world)
        o.step()
        o.zero_grad()
    return all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), resumed.parameters())
    )


def test_state_dicts_save_and_resume_after_flat_steps() -> None:
    assert _at(2)["save"] == [True, True]


def _worker_rehome(rank: int, world: int) -> list[int]:
    model, ref = _build(rank, world, scalar_gate=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    alive: list[int] = []
    original = _plan._rehome

    def checked(entries: list, key: Any, numel: int) -> torch.Tensor:
        old = [weakref.ref(s.locals[key]) for s in entries]
        flat = original(entries, key, numel)
        alive.append(sum(r() is not None for r in old))
        return flat

    with mock.patch.object(_plan, "_rehome", checked):
        for step in range(2):
            _train_step(model, ref, step, rank, world)
            opt.step()
            opt.zero_grad()
    return alive


def test_moving_state_into_flat_buffers_frees_the_old_tensors_at_once() -> None:
    """Moving a state entry of one bucket frees its old per-parameter tensors before the
    next entry moves: the transient is one bucket's entry, not the optimizer's state.
    (torch itself may still hold one old tensor, seen right after the DTensor-path
    step; while fsdp2 held them, every one of them stayed.)"""
    alive = _at(1)["rehome"][0]
    assert len(alive) == 8 and sum(alive) <= 1, alive  # 4 buckets x (exp_avg, exp_avg_sq)


def _reuse_worker(rank: int, world: int) -> dict[str, Any]:
    model, ref = _build(rank, world, scalar_gate=False)
    make = functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    reused = []
    for step in range(7):
        _train_step(model, ref, step, rank, world)
        if step == 3:  # a gradient replaced by another tensor (not the flat one committed)
            for p in (model.blocks[1].fc1.weight, ref.blocks[1].fc1.weight):
                p.grad = p.grad * 0.5
        if step == 6:  # one step count written: its bucket's parameters no longer agree
            for o, p in ((opt, model.blocks[0].fc1.weight), (ref_opt, ref.blocks[0].fc1.weight)):
                o.state[p]["step"].fill_(7.0)
        before = local_step_stats(opt)["reused_plans"]
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        reused.append(local_step_stats(opt)["reused_plans"] - before)
    got, want = full_params(model), full_params(ref)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    _check_state(model, opt, ref, ref_opt)
    return {"reused": reused}


@pytest.mark.parametrize("world", [1, 2])
def test_a_kept_plan_is_dropped_when_what_it_relied_on_changes(world: int) -> None:
    """A step that went all flat keeps its plan; the next step reuses it, unless a
    gradient or a step count changed behind it (results match local training either way)."""
    # 0: creates the state; 1: plans, kept; 2: reused; 3: a new gradient: plans afresh,
    # per parameter for that bucket, not kept; 4: plans, kept; 5: reused; 6: a step count
    # written: plans afresh.
    for out in _at(world)["reuse"]:
        assert out["reused"] == [0, 0, 1, 0, 0, 1, 0], out


def _reset_worker(rank: int, world: int) -> int:
    import gc

    model, _ = _build(rank, world, scalar_gate=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(i: int) -> None:
        ids, targets = batch(i, PER_RANK_BATCH * world)
        loss_fn(model(ids.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()

    for i in range(3):  # the last steps on a kept plan
        step(i)
    refs = [weakref.ref(v._local_tensor) for st in opt.state.values() for v in st.values() if v.dim() > 0]
    opt.state.clear()  # the user resets the optimizer: a new param group, new state
    opt.param_groups.clear()
    opt.add_param_group({"params": list(model.parameters())})
    for i in range(3, 5):
        step(i)
    gc.collect()
    return sum(r() is not None for r in refs)


def test_a_dropped_param_group_takes_its_kept_plan_and_state_along() -> None:
    assert _at(2)["reset"] == [0, 0]


@cached_outcome
def _at(world: int) -> dict[str, list]:
    """Every scenario of this file at ``world`` ranks, one after the other in one spawn
    (optimizers and models of one scenario must not affect the next one's anyway)."""
    if world == 1:
        return run_scenarios(1, {
            "all": (_worker_all, ()), "threads": (_worker_threads, ()), "rehome": (_worker_rehome, ()),
            "reuse": (_reuse_worker, ()), "dead_optimizer": (_dead_optimizer_worker, ()),
        })
    return run_scenarios(2, {
        "all": (_worker_all, ()), "fallbacks": (_worker_fallbacks, ()), "raise_True": (_worker_raise, (True,)),
        "raise_False": (_worker_raise, (False,)), "disabled": (_worker_disabled, ()), "save": (_worker_save, ()),
        "reuse": (_reuse_worker, ()), "reset": (_reset_worker, ()),
    })


def _dead_optimizer_worker(rank: int, world: int) -> str:
    """Two optimizers over one model both fail mid-step, one is then collected: the
    model's next forward undoes what is left and runs."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fsdp2.fully_shard(model)
    params = list(model.parameters())
    opt_a = torch.optim.SGD(params[:2], lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(params[2:], lr=0.1, momentum=0.9)
    x = torch.randn(2, 4)
    for _ in range(2):
        model(x).sum().backward()
        opt_a.step()
        opt_b.step()
    model(x).sum().backward()
    for o in (opt_b, opt_a):
        with mock.patch("torch.optim.sgd._single_tensor_sgd", side_effect=RuntimeError("injected")):
            try:
                o.step()
            except RuntimeError:
                pass
    del opt_a, o
    gc.collect()
    model(x)
    return "ok" if all(isinstance(p, DTensor) for p in opt_b.param_groups[0]["params"]) else "not restored"


def test_forward_after_failed_steps_of_a_collected_optimizer() -> None:
    assert _at(1)["dead_optimizer"] == ["ok"]
