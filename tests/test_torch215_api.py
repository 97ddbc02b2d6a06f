"""torch 2.15's additions to ``fully_shard``, which fsdp2 has on every torch: manual
backward finalization (``set_manual_backward_finalization``, ``finalize_backward``,
``GradientReductionHandle``), ``set_keep_unsharded_storage`` and
``MixedPrecisionPolicy(param_dtype_override_fn=...)``.

Each scenario runs on fsdp2 and, where the installed torch has the API (2.15), on torch's
``fully_shard`` in the same ranks: the parity ones against one local replica fed the
global batch, in float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _comm import CommCounter
from _dist import cached_outcome, run_ranks, run_scenarios
from _models import ToyModel, batch, full_params, impl, loss_fn, worst
from torch.distributed.tensor import DTensor

from fsdp2._compat import TORCH

LIBS = ["fsdp2"] + (["torch"] if hasattr(impl("torch").FSDPModule, "finalize_backward") else [])
MICRO = 3


def _sharded(lib_name: str, **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    lib = impl(lib_name)
    torch.manual_seed(0)
    master = ToyModel(scalar_gate=lib_name == "fsdp2").double()
    model = copy.deepcopy(master)
    for block in model.blocks:
        lib.fully_shard(block, **kwargs)
    lib.fully_shard(model, **kwargs)
    return master, model


def _manual_parity(rank: int, world: int, lib_name: str, async_op: bool, sync_each: bool = False) -> dict[str, Any]:
    """Micro-batches accumulated without synchronization and kept gathered (as torch 2.15's
    pipeline stages drive a stage), then one manual finalize: equal to the local replica.
    ``sync_each``: every micro-batch reduces during its backward, the finalize waits."""
    master, model = _sharded(lib_name)
    model.set_manual_backward_finalization(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.1)
    errors, grads_before_finalize = [], []
    for step in range(2):
        ids, targets = batch(step, 2 * MICRO * world)
        model.set_requires_gradient_sync(sync_each)
        model.set_reshard_after_backward(sync_each)
        for ids_mb, tg_mb in zip(ids.chunk(world)[rank].chunk(MICRO), targets.chunk(world)[rank].chunk(MICRO)):
            (loss_fn(model(ids_mb), tg_mb) / MICRO).backward()
        grads_before_finalize.append(sum(isinstance(p.grad, DTensor) for p in model.parameters()))
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            handle.wait()
            handle.wait()  # a second wait does nothing
        (loss_fn(master(ids), targets)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        got, want = full_params(model), full_params(master)
        errors.append(worst([(got[n] - want[n]).abs().max().item() for n in want]))
    return {"errors": errors, "grads_before_finalize": grads_before_finalize}


def _raised(fn: Any) -> str:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _manual_misuse(rank: int, world: int, lib_name: str) -> dict[str, str]:
    """What torch 2.15 refuses, refused alike."""
    _, model = _sharded(lib_name)
    ids, targets = batch(0, 4)
    out: dict[str, str] = {}
    # Before the first forward a finalize does nothing; an inner module's mode is refused
    # once the root is known.
    out["before_forward"] = repr(model.finalize_backward())
    _, inner = _sharded(lib_name)  # torch's model stays unusable after this error: another one
    inner.blocks[0].set_manual_backward_finalization(True)
    out["inner_mode"] = _raised(lambda: inner(ids))
    loss_fn(model(ids), targets).backward()  # automatic: finalized by backward itself
    out["not_manual"] = _raised(lambda: model.finalize_backward())
    out["on_inner"] = _raised(lambda: model.blocks[0].finalize_backward())
    model.set_manual_backward_finalization(True)
    loss_fn(model(ids), targets).backward()
    out["mode_change_after_backward"] = _raised(lambda: model.set_manual_backward_finalization(False))
    handle = model.finalize_backward(async_op=True)
    out["forward_before_wait"] = _raised(lambda: model(ids))
    out["finalize_before_wait"] = _raised(lambda: model.finalize_backward())
    handle.wait()
    with torch.no_grad():  # the refused forward left nothing behind: the gradients stay
        model(ids)
    out["grads_after_refused_forward"] = str(sum(p.grad is not None for p in model.parameters()))
    loss_fn(model(ids), targets).backward()
    handle = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    out["wait_after_reset"] = _raised(handle.wait)
    out["wait_again_after_reset"] = _raised(handle.wait)
    out["grads_after_reset"] = str(sum(p.grad is not None for p in model.parameters()))
    return out


def _keep_unsharded_storage(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    """Kept, the unsharded parameters' data pointers are the same at every unshard and
    their storage stays allocated after reshard; not kept, it is freed."""
    _, model = _sharded(lib_name)
    ids, targets = batch(0, 4)
    block = model.blocks[1]
    seen: dict[str, list] = {"kept": [], "freed": []}
    for keep in (True, False):
        model.set_keep_unsharded_storage(keep)
        for _ in range(2):
            block.unshard()
            leaf = block.fc1.weight
            ptr = leaf.data_ptr()
            block.reshard()
            seen["kept" if keep else "freed"].append((ptr, leaf.untyped_storage().nbytes()))
            loss_fn(model(ids), targets).backward()
        if keep:  # turned off: what the resharded groups kept goes at once (fsdp2)
            model.set_keep_unsharded_storage(False)
            seen["off"] = leaf.untyped_storage().nbytes()
    return seen


class _Norm(torch.nn.Module):
    """Scales in float32 whatever dtype comes in (as RMSNorm implementations do)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight).to(x.dtype)


def _override_dtypes(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    """``param_dtype_override_fn`` keeps the norm weights in their own dtype; a dtype that
    is neither raises naming the parameter, before anything changes."""
    lib = impl(lib_name)
    torch.manual_seed(0)

    def build() -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Linear(6, 6), _Norm(6), torch.nn.Linear(6, 4))

    model = build()
    norms = {id(m.weight) for m in model.modules() if isinstance(m, _Norm)}

    def keep_norms(p: torch.nn.Parameter) -> torch.dtype | None:
        return p.dtype if id(p) in norms else None

    mp = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=keep_norms)
    bad = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)
    probe = build()
    error = _raised(lambda: lib.fully_shard(probe, mp_policy=bad))
    untouched = not isinstance(probe, lib.FSDPModule) and not isinstance(probe[0].weight, DTensor)
    seen: dict[str, str] = {}

    def record(module: torch.nn.Module, args: Any, output: Any) -> None:
        seen.update({n: str(p.dtype) for n, p in module.named_parameters()})

    model.register_forward_hook(record)
    lib.fully_shard(model, mp_policy=mp)
    loss = model(torch.randn(4, 6)).float().pow(2).sum()
    loss.backward()
    grads = {n: str(p.grad.dtype) for n, p in model.named_parameters()}
    return {"error": error.split(":")[0], "untouched": untouched, "seen": seen, "grads": grads}


def _reduce_dtype_default(rank: int, world: int, lib_name: str) -> list[str]:
    """float32 parameters, ``param_dtype=torch.bfloat16``, no ``reduce_dtype``: the dtypes
    the gradient reduce runs in (torch 2.15: the gradients' own, float32; before: bf16)."""
    lib = impl(lib_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    lib.fully_shard(model, mp_policy=lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with CommCounter().active() as counter:
        model(torch.randn(4, 6)).float().pow(2).sum().backward()
    return sorted(str(dtype) for kind, dtype in counter.dtypes if kind == "reduce")


def _grad_dtype(rank: int, world: int, lib_name: str) -> dict[str, tuple[str, str]]:
    """A parameter's explicit ``grad_dtype`` (float32 on a bf16 model) carries over to its
    sharded parameter, whose reduced gradient comes in that dtype."""
    lib = impl(lib_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).bfloat16()
    model[0].weight.grad_dtype = torch.float32
    lib.fully_shard(model)
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    return {n: (str(p.grad.dtype), str(p.grad_dtype)) for n, p in model.named_parameters()}


def _refusals(rank: int, world: int) -> dict[str, str]:
    """fsdp2's checks at ``fully_shard``, before anything changes."""
    import _subclass

    import fsdp2

    out = {}
    lin = torch.nn.Linear(4, 4)
    lin.weight.grad_dtype = None  # any gradient dtype: ranks could reduce in different ones
    out["grad_dtype_none"] = _raised(
        lambda: fsdp2.fully_shard(lin, mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    )
    lin = torch.nn.Linear(4, 4).double()
    lin.weight = torch.nn.Parameter(_subclass.BadRelease(lin.weight.detach().clone()))
    out["release_not_bool"] = _raised(lambda: fsdp2.fully_shard(lin))
    return out


def _direct_unused_zeros(rank: int, world: int, manual: bool) -> list[str]:
    """One rank, no dtype change (the leaves are the shards): with
    ``set_reduce_scatter_unused_params(True)`` an unused layer gets zeros, finalized by
    backward or by hand alike."""
    import fsdp2

    model = ToyModel().double()
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    for m in model.modules():
        if isinstance(m, fsdp2.FSDPModule):
            m.set_reduce_scatter_unused_params(True)
    model.set_manual_backward_finalization(manual)
    ids, targets = batch(0, 2)
    loss_fn(model(ids, use_extra=False), targets).backward()
    if manual:
        model.finalize_backward()
    return [str(None if p.grad is None else float(p.grad.full_tensor().abs().sum())) for p in model.extra.parameters()]


def _hsdp_partial_refused(rank: int, world: int) -> str:
    """HSDP with ``set_requires_all_reduce(False)`` under manual finalization: refused,
    as torch 2.15 refuses it (the reduced rows would wait for a later all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp2

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
    fsdp2.fully_shard(model[0], mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    model.set_manual_backward_finalization(True)
    model.set_requires_all_reduce(False)
    model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
    return _raised(model.finalize_backward)


@cached_outcome
def _outcomes() -> dict[str, list[Any]]:
    scenarios: dict[str, tuple] = {}
    scenarios["refusals"] = (_refusals, ())
    for lib in ("fsdp2", "torch"):  # a default both versions of torch have, changed in 2.15
        scenarios[f"reduce-default-{lib}"] = (_reduce_dtype_default, (lib,))
    for lib in LIBS:
        scenarios[f"parity-{lib}"] = (_manual_parity, (lib, False))
        scenarios[f"parity-async-{lib}"] = (_manual_parity, (lib, True))
        scenarios[f"parity-sync-each-{lib}"] = (_manual_parity, (lib, False, True))
        scenarios[f"misuse-{lib}"] = (_manual_misuse, (lib,))
        scenarios[f"keep-{lib}"] = (_keep_unsharded_storage, (lib,))
        scenarios[f"override-{lib}"] = (_override_dtypes, (lib,))
        scenarios[f"grad-dtype-{lib}"] = (_grad_dtype, (lib,))
    return run_scenarios(2, scenarios)


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("mode", ["", "-async", "-sync-each"])
def test_manual_finalization_matches_local(lib_name: str, mode: str) -> None:
    result = _outcomes()[f"parity{mode}-{lib_name}"][0]
    if mode != "-sync-each":  # (reducing during backward, torch writes some .grad before it)
        assert result["grads_before_finalize"] == [0, 0]  # nothing reduced before the finalize
    assert worst(result["errors"]) <= 1e-12, result["errors"]


@pytest.mark.parametrize("lib_name", LIBS)
def test_manual_finalization_refuses_what_torch_refuses(lib_name: str) -> None:
    out = _outcomes()[f"misuse-{lib_name}"][0]
    assert out["before_forward"] == "None"
    assert "root" in out["inner_mode"], out
    assert "manual backward finalization" in out["not_manual"], out
    assert "root" in out["on_inner"], out
    assert out["mode_change_after_backward"].startswith("RuntimeError"), out
    assert "waited on before forward" in out["forward_before_wait"], out
    assert "waited on before finalizing backward again" in out["finalize_before_wait"], out
    assert "invalidated" in out["wait_after_reset"] and "invalidated" in out["wait_again_after_reset"], out
    assert out["grads_after_refused_forward"] != "0", out
    # torch 2.15's reset drops the gradients too; 2.13's kept them (fsdp2 follows the installed one).
    assert (out["grads_after_reset"] == "0") == (lib_name == "torch" or TORCH.reset_clears_grads), out


@pytest.mark.parametrize("lib_name", LIBS)
def test_keep_unsharded_storage_keeps_data_pointers(lib_name: str) -> None:
    seen = _outcomes()[f"keep-{lib_name}"][0]
    (p0, n0), (p1, n1) = seen["kept"]
    assert p0 == p1 and n0 > 0 and n1 > 0
    assert [n for _, n in seen["freed"]] == [0, 0]
    if lib_name == "fsdp2":
        assert seen["off"] == 0, seen


@pytest.mark.parametrize("lib_name", LIBS)
def test_param_dtype_override_fn(lib_name: str) -> None:
    out = _outcomes()[f"override-{lib_name}"][0]
    assert out["error"] == "ValueError" and out["untouched"], out
    assert out["seen"] == {
        "0.weight": "torch.bfloat16", "0.bias": "torch.bfloat16", "1.weight": "torch.float32",
        "2.weight": "torch.bfloat16", "2.bias": "torch.bfloat16",
    }, out
    assert all(v == "torch.float32" for v in out["grads"].values()), out


def test_policy_repr_as_the_installed_torch() -> None:
    import fsdp2

    assert repr(fsdp2.MixedPrecisionPolicy()) == repr(impl("torch").MixedPrecisionPolicy())


@pytest.mark.parametrize("lib_name", ["fsdp2", "torch"])
def test_reduce_dtype_default_follows_the_installed_torch(lib_name: str) -> None:
    """Tested on both sides of the change: CI runs the suite on torch 2.13 and on 2.15."""
    want = "torch.float32" if TORCH.reduce_follows_grad_dtype else "torch.bfloat16"
    assert _outcomes()[f"reduce-default-{lib_name}"][0] == [want]


@pytest.mark.parametrize("lib_name", LIBS)
def test_explicit_grad_dtype_carries_over(lib_name: str) -> None:
    bf16, fp32 = "torch.bfloat16", "torch.float32"
    assert _outcomes()[f"grad-dtype-{lib_name}"][0] == {
        "0.weight": (fp32, fp32), "0.bias": (bf16, bf16), "1.weight": (bf16, bf16), "1.bias": (bf16, bf16),
    }


def test_policy_override_fn_must_be_callable() -> None:
    import fsdp2

    with pytest.raises(TypeError, match="param_dtype_override_fn expects a callable"):
        fsdp2.MixedPrecisionPolicy(param_dtype_override_fn=torch.float32)


def test_refusals_at_fully_shard() -> None:
    out = _outcomes()["refusals"][0]
    # torch 2.15 accepts grad_dtype=None without a reduce_dtype and raises at the backward;
    # fsdp2 says so at fully_shard. Before 2.15 the reduce runs in param_dtype: no question.
    if TORCH.reduce_follows_grad_dtype:
        assert out["grad_dtype_none"].startswith("ValueError") and "reduce_dtype" in out["grad_dtype_none"], out
    else:
        assert out["grad_dtype_none"] == "no error", out
    assert out["release_not_bool"].startswith("TypeError") and "must return a bool" in out["release_not_bool"], out


def test_manual_finalization_on_one_rank_gives_unused_parameters_zeros() -> None:
    auto, manual = (run_ranks(_direct_unused_zeros, 1, m)[0] for m in (False, True))
    assert auto == manual == ["0.0", "0.0"], (auto, manual)


def test_manual_finalization_refuses_partial_hsdp_reductions() -> None:
    for out in run_ranks(_hsdp_partial_refused, 4):
        assert out.startswith("RuntimeError") and "partial gradient reductions" in out, out
