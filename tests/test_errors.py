"""Every misuse raises a clear error (type + message fragment), before any state changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from _models import ToyModel, batch, loss_fn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2


def _expect(fn, exc: type[BaseException], fragment: str) -> str:  # noqa: ANN001
    try:
        fn()
    except exc as e:
        assert fragment in str(e), f"{fragment!r} not in {e!s}"
        return "ok"
    raise AssertionError(f"expected {exc.__name__} containing {fragment!r}, nothing raised")


@dataclasses.dataclass(frozen=True)
class _NewerTorchPolicy:
    """Stands for a later torch's MixedPrecisionPolicy with a field fsdp2 does not know."""

    param_dtype: torch.dtype | None = None
    stochastic_rounding: bool = False


_NewerTorchPolicy.__name__ = _NewerTorchPolicy.__qualname__ = "MixedPrecisionPolicy"
_NewerTorchPolicy.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_api"


def _fully_shard_errors(rank: int, world: int) -> dict[str, str]:
    out: dict[str, str] = {}
    mesh3d = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("a", "b", "c"))
    unnamed2d = init_device_mesh("cpu", (1, world))

    def check(name: str, fn, exc: type[BaseException], fragment: str) -> None:  # noqa: ANN001
        model_before = None
        out[name] = _expect(fn, exc, fragment)
        del model_before

    lin = nn.Linear(4, 4)
    before = lin.weight
    check("mesh_type", lambda: fsdp2.fully_shard(lin, mesh="cpu"), TypeError, "expects a DeviceMesh, got str")
    check("mesh_3d", lambda: fsdp2.fully_shard(lin, mesh=mesh3d), ValueError, "parallelize the model over mesh['tp'] first")
    spmd = init_device_mesh("cpu", (world, 1), mesh_dim_names=("sdp", "stp"))
    dims = fsdp2.DataParallelMeshDims
    check("dp_mesh_dims_type", lambda: fsdp2.fully_shard(lin, mesh=spmd, dp_mesh_dims="sdp"), TypeError, "expects a DataParallelMeshDims")
    check("dp_mesh_dims_unnamed", lambda: fsdp2.fully_shard(lin, mesh=unnamed2d, dp_mesh_dims=dims(shard="sdp")), ValueError, "with mesh_dim_names")
    check("dp_mesh_dims_name", lambda: fsdp2.fully_shard(lin, mesh=spmd, dp_mesh_dims=dims(shard="dp")), ValueError, "['dp'] that are not dims of the mesh")
    check("dp_mesh_dims_order", lambda: fsdp2.fully_shard(lin, mesh=spmd, dp_mesh_dims=dims(shard=("stp", "sdp"))), ValueError, "list them in that order: ('sdp', 'stp')")
    check("dp_mesh_dims_twice", lambda: fsdp2.fully_shard(lin, mesh=spmd, dp_mesh_dims=dims(shard="sdp", replicate="sdp")), ValueError, "a mesh dim twice")
    check("dp_mesh_dims_plain", lambda: fsdp2.fully_shard(lin, mesh=spmd, dp_mesh_dims=dims(shard="sdp")), ValueError, "weight is a plain tensor")
    on_dp = nn.Linear(4, 4)
    on_dp.weight = nn.Parameter(torch.distributed.tensor.distribute_tensor(on_dp.weight.detach(), spmd, [torch.distributed.tensor.Shard(0), torch.distributed.tensor.Replicate()]))
    on_dp.bias = nn.Parameter(torch.distributed.tensor.distribute_tensor(on_dp.bias.detach(), spmd, [torch.distributed.tensor.Replicate()] * 2))
    check("dp_mesh_dims_placement", lambda: fsdp2.fully_shard(on_dp, mesh=spmd, dp_mesh_dims=dims(shard="sdp")), ValueError, "expected Replicate() on the data-parallel dim 'sdp'")
    check("dp_mesh_dims_other_mesh", lambda: fsdp2.fully_shard(on_dp, mesh=mesh3d, dp_mesh_dims=dims(shard="c")), ValueError, "not on the mesh passed to fully_shard")
    out["untouched_spmd"] = "ok" if type(on_dp) is nn.Linear else "changed"
    check("raf_type", lambda: fsdp2.fully_shard(lin, reshard_after_forward="yes"), TypeError, "reshard_after_forward expects")
    check("raf_divisor", lambda: fsdp2.fully_shard(lin, reshard_after_forward=3), ValueError, "must divide the shard size")
    check("raf_zero", lambda: fsdp2.fully_shard(lin, reshard_after_forward=0), ValueError, "must divide the shard size")
    check("not_module", lambda: fsdp2.fully_shard([lin, "x"]), TypeError, "expects nn.Module")
    check("empty_list", lambda: fsdp2.fully_shard([]), ValueError, "non-empty list")
    check("module_twice", lambda: fsdp2.fully_shard([lin, lin]), ValueError, "same Linear twice")
    check("mp_type", lambda: fsdp2.fully_shard(lin, mp_policy=torch.bfloat16), TypeError, "MixedPrecisionPolicy, got torch.dtype; pass e.g.")
    check("mp_class", lambda: fsdp2.fully_shard(lin, mp_policy=fsdp2.MixedPrecisionPolicy), TypeError, "(call it: MixedPrecisionPolicy(...))")
    check("mp_newer_torch", lambda: fsdp2.fully_shard(lin, mp_policy=_NewerTorchPolicy()), TypeError, "this torch is newer than fsdp2 knows")
    check("offload_type", lambda: fsdp2.fully_shard(lin, offload_policy=True), TypeError, "OffloadPolicy")
    check("mp_dtype", lambda: fsdp2.MixedPrecisionPolicy(param_dtype="bf16"), TypeError, "torch.dtype")
    check("mp_int", lambda: fsdp2.MixedPrecisionPolicy(param_dtype=torch.int32), ValueError, "floating-point")
    check("placement", lambda: fsdp2.fully_shard(lin, shard_placement_fn=lambda p: torch.distributed.tensor.Replicate()), ValueError, "may return None, Shard(dim)")
    check("placement_dim", lambda: fsdp2.fully_shard(lin, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(-3)), ValueError, "must lie in [-2, 1]")
    import _subclass

    sub = nn.Linear(4, 4)
    sub.weight = nn.Parameter(_subclass.Doubled(sub.weight.detach()))
    check("extension_dim", lambda: fsdp2.fully_shard(sub, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(p.dim() - 1)), NotImplementedError, "is sharded on dim 1; fsdp2 supports the all-gather extension")

    out["extension_untouched"] = "ok" if type(sub) is nn.Linear else "changed"
    # Nothing above changed the module.
    out["untouched"] = "ok" if lin.weight is before and type(lin) is nn.Linear else "changed"

    fsdp2.fully_shard(lin)
    check("twice", lambda: fsdp2.fully_shard(lin), ValueError, "already applied")

    model = ToyModel()
    fsdp2.fully_shard(model)
    check("top_down", lambda: fsdp2.fully_shard(model.blocks[0]), ValueError, "bottom-up")

    # A tied weight split across groups, named by full names: found by the root's call...
    tied = ToyModel()  # head.weight is emb.weight
    fsdp2.fully_shard(tied.emb)
    check("shared_param", lambda: fsdp2.fully_shard(tied), ValueError, "parameter 'head.weight' (names under the ToyModel being sharded) is the same tensor as 'emb.weight'")
    # ... or, when a sibling's call finds it, at the root's first forward, before any collective.
    shared = ToyModel(tie=False)
    shared.extra.weight = nn.Parameter(torch.randn(6, 6))
    shared.blocks[0].fc2.weight = shared.extra.weight
    fsdp2.fully_shard(shared.extra)
    fsdp2.fully_shard(shared.blocks[0])
    fsdp2.fully_shard(shared)
    check("shared_param_sibling", lambda: shared(batch(0, 2)[0]), ValueError, "parameter 'blocks.0.fc2.weight' (found by the fully_shard call on 'blocks.0') is the same tensor as 'extra.weight'")

    fsdp_model = ToyModel()
    fsdp2.fully_shard(fsdp_model.blocks[0])
    fsdp2.fully_shard(fsdp_model)
    check("prefetch_type", lambda: fsdp_model.set_modules_to_forward_prefetch(fsdp_model.blocks[0]), TypeError, "expects a list")
    check("prefetch_plain", lambda: fsdp_model.set_modules_to_backward_prefetch([fsdp_model.blocks[1]]), ValueError, "fully_shard was applied to")
    check("set_bool", lambda: fsdp_model.set_requires_gradient_sync(None), TypeError, "expects a bool")
    check("set_raf", lambda: fsdp_model.set_reshard_after_forward(None), ValueError, "got None")
    check("divide", lambda: fsdp_model.set_gradient_divide_factor(0), ValueError, "positive number")
    check("unshard_arg", lambda: fsdp_model.unshard(async_op="yes"), TypeError, "expects a bool")
    loss_fn(fsdp_model(batch(0, 2)[0]), batch(0, 2)[1]).backward()
    # After the first forward an inner module's call sets the root's flag, as torch's
    # (its state is shared by the root's modules): not an error.
    fsdp_model.blocks[0].set_is_last_backward(False)
    root = fsdp_model._fsdp2_state.group
    out["last_backward_non_root"] = "ok" if root.is_last_backward is False else "not the root's"
    fsdp_model.set_is_last_backward(True)
    return out


def test_fully_shard_misuse_errors() -> None:
    for out in run_ranks(_fully_shard_errors, 2):
        bad = {k: v for k, v in out.items() if v != "ok"}
        assert not bad, bad


def _meta_forward(rank: int, world: int) -> str:
    with torch.device("meta"):
        model = ToyModel()
    fsdp2.fully_shard(model)
    return _expect(lambda: model(batch(0, 2)[0]), RuntimeError, "to_empty(device=...)")


def test_forward_on_meta_parameters() -> None:
    assert run_ranks(_meta_forward, 2) == ["ok", "ok"]


def _early_optimizer(rank: int, world: int) -> str:
    model = ToyModel()
    opt = torch.optim.AdamW(model.parameters())
    fsdp2.fully_shard(model)
    loss_fn(model(batch(0, 2)[0]), batch(0, 2)[1]).backward()
    return _expect(opt.step, RuntimeError, "Create the optimizer after fully_shard")


def test_optimizer_created_before_fully_shard() -> None:
    assert run_ranks(_early_optimizer, 2) == ["ok", "ok"]


def test_default_mesh_needs_process_group() -> None:
    with pytest.raises(ValueError, match="init_process_group"):
        fsdp2.fully_shard(nn.Linear(2, 2))


def _divergent_ranks(rank: int, world: int) -> str:
    import os

    os.environ["FSDP2_DEBUG_COLLECTIVES"] = "1"
    model = ToyModel()
    for block in model.blocks:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    ids = batch(0, 2)[0]

    def skip_first_block(ids: torch.Tensor) -> torch.Tensor:
        x = model.emb(ids)
        for block in model.blocks[1:]:
            x = block(x)
        return model.head(model.extra(x))

    if rank == 1:  # a data-dependent branch: rank 1 skips block 0
        model.forward = skip_first_block  # type: ignore[method-assign]
    return _expect(lambda: model(ids), RuntimeError, "ranks disagree on the next collective")


def test_debug_mode_reports_divergent_ranks() -> None:
    assert run_ranks(_divergent_ranks, 2, timeout=60) == ["ok", "ok"]
