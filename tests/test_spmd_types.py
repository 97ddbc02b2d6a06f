"""Parameters typed with ``spmd_types`` (torchtitan's default SPMD backend): plain tensors
whose type says, per mesh axis, how each rank's value relates to the others'.
``fully_shard(mesh=full_mesh, dp_mesh_dims=...)`` takes each as the DTensor its type
describes, trains it as torch 2.14+ does, and shows the model a plain tensor typed as it
was. Each case trains against one local replica fed the global batch (float64) and, on
a torch that takes typed parameters, against torch's ``fully_shard`` in the same ranks
(torch 2.13 refuses them: fsdp2 takes them on every torch it supports):

* 2 ranks, mesh ``('dp',)``: an MLP typed ``R``, forward under ``spmd_types``' type
  checking; the module sees a plain parameter with its type, and the state dict loads
  into a fresh model that then trains on alike; bf16 parameters with float32 reduces.
* 4 ranks, mesh ``('dp', 'tp')``: a tensor-parallel block written on local tensors, as
  torchtitan's spmd_types modules are: a sequence-parallel norm weight (``R`` on tp, its
  gradient summed over tp), column and row weights (``S(0)``, ``S(1)``), a bias after the
  row reduce (``I``: no reduce over tp).
* 4 ranks, HSDP ``('rep', 'shard')``; and types fsdp2 cannot take, refused before
  anything changes.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import cached_outcome, run_scenarios
from _models import full_params, impl

spmd = pytest.importorskip("spmd_types", reason="spmd_types is among the test extras")

TORCH_TAKES_TYPED = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
LIBS = ("fsdp2", "torch")
D, H, T, STEPS = 8, 16, 4, 3


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """One mesh per shape in a rank, shared by its scenarios: torch 2.15's fully_shard
    refuses typed parameters on a second mesh built alike in the same process ("different
    mesh objects"), which fsdp2 does not."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _shard(lib: Any, blocks: list[nn.Module], root: nn.Module, mesh: Any, dims: Any) -> str | None:
    """``fully_shard`` each block then the root over the full mesh; what refused it, if any."""
    try:
        for block in blocks:
            lib.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
        lib.fully_shard(root, mesh=mesh, dp_mesh_dims=dims)
    except ValueError as e:
        return str(e)
    return None


def _train(model: nn.Module, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> list[float]:
    """One step per batch on the mean square of the output; the losses."""
    losses = []
    for x in batches:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------------ 1-D mesh, typechecked
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)).double()


def _batch(step: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _typed_mlp(lib: Any, mesh: Any, mp: Any = None) -> nn.Sequential:
    model = _mlp()
    dp = mesh.get_group("dp")
    for p in model.parameters():
        spmd.assert_type(p, {dp: spmd.R})
    kwargs = {"mesh": mesh, "dp_mesh_dims": lib.DataParallelMeshDims(shard="dp")}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for layer in (model[0], model[2]):
        lib.fully_shard(layer, **kwargs)
    lib.fully_shard(model, **kwargs)
    return model


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, dp: Any) -> float:
    from spmd_types.checker import typecheck

    spmd.assert_type(x, {dp: spmd.V})
    with typecheck():
        loss = model(x).double().square().mean()
    with spmd.no_typecheck():
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train_1d(rank: int, world: int, lib_name: str, bf16: bool) -> dict[str, Any]:
    lib = impl(lib_name)
    mesh = _mesh((world,), ("dp",))
    mp = lib.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    try:
        model = _typed_mlp(lib, mesh, mp)
    except ValueError as e:
        return {"refused": str(e)}
    dp = mesh.get_group("dp")
    seen: list[tuple[str, dict]] = []
    model[0].register_forward_pre_hook(
        lambda m, args: seen.append((type(m.weight).__name__, {str(a): repr(t) for a, t in spmd.get_local_type(m.weight).items()}))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = [_step(model, opt, _batch(s, 2 * world).chunk(world)[rank], dp) for s in range(STEPS)]
    out = {"losses": losses, "params": full_params(model), "seen": seen[0],
           "placements": {n: str(tuple(p.placements)) for n, p in model.named_parameters()}}
    # The state dict (DTensors on the mesh) into a fresh typed model: both train on alike.
    fresh = _typed_mlp(lib, mesh, mp)
    fresh.load_state_dict(model.state_dict())
    x = _batch(STEPS, 2 * world).chunk(world)[rank]
    out["after_load"] = (_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, dp),
                         _step(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), x, dp))
    out["loaded_params"] = (full_params(model), full_params(fresh))
    return out


def _local_1d(world: int) -> dict[str, Any]:
    model = _mlp()
    losses = _train(model, torch.optim.AdamW(model.parameters(), lr=0.05), [_batch(s, 2 * world) for s in range(STEPS)])
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


# ---------------------------------------------------------- 2-D mesh, tensor parallel
class _GatherSequence(torch.autograd.Function):
    """All-gather dim 1 over tp; backward: each rank's part of the gradients summed over tp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=1)[dist.get_rank(ctx.group)], None


class _SplitSequence(torch.autograd.Function):
    """This rank's part of dim 1 (the sequence); backward: the parts all-gathered over tp."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None


class _SumOver(torch.autograd.Function):
    """All-reduce over tp (the row-parallel output); backward: the identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _Block(nn.Module):
    """norm (sequence parallel) -> column -> relu -> row -> + bias, on this rank's pieces."""

    def __init__(self, tp: Any = None) -> None:
        super().__init__()
        self.tp = tp
        self.norm = nn.Parameter(torch.rand(D, dtype=torch.float64) + 0.5)
        self.up = nn.Parameter(torch.randn(H, D, dtype=torch.float64) / 3)
        self.down = nn.Parameter(torch.randn(D, H, dtype=torch.float64) / 4)
        self.bias = nn.Parameter(torch.randn(D, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            x = _SplitSequence.apply(x, self.tp)
        y = x * self.norm
        if self.tp is not None:
            y = _GatherSequence.apply(y, self.tp)
        out = torch.relu(y @ self.up.T) @ self.down.T
        if self.tp is not None:
            out = _SumOver.apply(out, self.tp)
        return out + self.bias


def _blocks(tp: Any = None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    if tp is None:
        return model
    size, rank = dist.get_world_size(tp), dist.get_rank(tp)
    for block in model:
        block.tp = tp
        with torch.no_grad():
            block.up = nn.Parameter(block.up.chunk(size, 0)[rank].clone())
            block.down = nn.Parameter(block.down.chunk(size, 1)[rank].clone())
    return model


def _tp_batch(step: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, T, D, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _train_tp(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    mesh = _mesh((2, world // 2), ("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    model = _blocks(tp)
    for block in model:
        spmd.assert_type(block.norm, {dp: spmd.R, tp: spmd.R})
        spmd.assert_type(block.up, {dp: spmd.R, tp: spmd.S(0)})
        spmd.assert_type(block.down, {dp: spmd.R, tp: spmd.S(1)})
        spmd.assert_type(block.bias, {dp: spmd.R, tp: spmd.I})
    refused = _shard(lib, list(model), model, mesh, lib.DataParallelMeshDims(shard="dp"))
    if refused is not None:
        return {"refused": refused}
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = _train(model, opt, [_tp_batch(s, 4).chunk(2)[dist.get_rank(dp)] for s in range(STEPS)])
    placements = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
    return {"losses": losses, "params": full_params(model), "placements": placements}


def _local_tp() -> dict[str, Any]:
    model = _blocks()
    # the mean over the global batch: the mean of the data-parallel ranks' halves
    losses = _train(model, torch.optim.SGD(model.parameters(), lr=0.2), [_tp_batch(s, 4) for s in range(STEPS)])
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


# ------------------------------------------------------------------------------ HSDP
def _train_hsdp(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    lib = impl(lib_name)
    mesh = _mesh((2, world // 2), ("rep", "shard"))
    model = _mlp()
    axes = {mesh.get_group("rep"): spmd.R, mesh.get_group("shard"): spmd.R}
    for p in model.parameters():
        spmd.assert_type(p, axes)
    refused = _shard(lib, [model[0], model[2]], model, mesh, lib.DataParallelMeshDims(shard="shard", replicate="rep"))
    if refused is not None:
        return {"refused": refused}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = _train(model, opt, [_batch(s, 2 * world).chunk(world)[rank] for s in range(STEPS)])
    return {"losses": losses, "params": full_params(model)}


def _refusals(rank: int, world: int) -> dict[str, Any]:
    import fsdp2

    mesh = _mesh((2, world // 2), ("rep", "shard"))
    dims = fsdp2.DataParallelMeshDims(shard="shard", replicate="rep")
    out = {}
    cases = {
        # typed on one of the two axes, no current spmd_types mesh for the other
        "partial": {mesh.get_group("shard"): spmd.R},
        # partial sums on a data-parallel axis: fsdp2 reduces there itself
        "partial_sum_on_dp": {mesh.get_group("rep"): spmd.P, mesh.get_group("shard"): spmd.R},
    }
    for name, axes in cases.items():
        lin = nn.Linear(D, D).double()
        spmd.assert_type(lin.weight, axes)
        spmd.assert_type(lin.bias, axes)
        before = (type(lin.weight), lin.weight)
        try:
            fsdp2.fully_shard(lin, mesh=mesh, dp_mesh_dims=dims)
            out[name] = None
        except ValueError as e:
            out[name] = (str(e), before == (type(lin.weight), lin.weight), type(lin).__name__)
    lin = nn.Linear(D, D).double()  # no type at all
    try:
        fsdp2.fully_shard(lin, mesh=mesh, dp_mesh_dims=dims)
    except ValueError as e:
        out["untyped"] = str(e)
    # typed, but sharded over the data-parallel mesh alone (no dp_mesh_dims), as torch refuses too
    lin = nn.Linear(D, D).double()
    spmd.assert_type(lin.weight, {mesh.get_group("rep"): spmd.R, mesh.get_group("shard"): spmd.R})
    try:
        fsdp2.fully_shard(lin, mesh=mesh)
    except ValueError as e:
        out["no_dp_mesh_dims"] = (str(e), type(lin).__name__)
    # a partial sum on tp; and a typed call made inside a type-checking context
    from spmd_types.checker import typecheck

    full = _mesh((2, world // 2), ("dp", "tp"))
    tp_dims = fsdp2.DataParallelMeshDims(shard="dp")
    for name, kind in (("partial_sum_on_tp", spmd.P), ("inside_typecheck", spmd.S(0))):
        lin = nn.Linear(D, D).double()
        for p in lin.parameters():
            spmd.assert_type(p, {full.get_group("dp"): spmd.R, full.get_group("tp"): kind})
        try:
            with typecheck():
                fsdp2.fully_shard(lin, mesh=full, dp_mesh_dims=tp_dims)
            out[name] = str(tuple(lin.weight.placements))
        except ValueError as e:
            out[name] = str(e)
    return out


@cached_outcome
def _world2() -> dict[str, list[Any]]:
    return run_scenarios(2, {
        f"{lib}-{dt}": (_train_1d, (lib, dt == "bf16")) for lib in LIBS for dt in ("fp64", "bf16")
    })  # fmt: skip


@cached_outcome
def _world4() -> dict[str, list[Any]]:
    scenarios: dict[str, tuple] = {"refusals": (_refusals, ())}
    for lib in LIBS:
        scenarios[f"tp-{lib}"] = (_train_tp, (lib,))
        scenarios[f"hsdp-{lib}"] = (_train_hsdp, (lib,))
    return run_scenarios(4, scenarios)


def _close(ours: dict, theirs: dict, atol: float = 1e-12) -> None:
    assert list(ours) == list(theirs)
    for name in theirs:
        assert not ours[name].isnan().any(), name
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=atol, msg=name)


def test_typed_parameters_train_like_the_local_model_under_type_checking() -> None:
    ranks, local = _world2()["fsdp2-fp64"], _local_1d(2)
    for r in ranks:
        kind, types = r["seen"]  # what the module saw in forward: a plain parameter, typed R
        assert kind == "Parameter" and list(types.values()) == ["R"]
        assert r["placements"]["0.weight"] == "(Shard(dim=0),)"
        _close(r["params"], local["params"])
    global_losses = [sum(pair) / 2 for pair in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert global_losses == pytest.approx(local["losses"], rel=1e-12, abs=0)


def test_typed_state_dict_loads_into_a_fresh_model() -> None:
    for r in _world2()["fsdp2-fp64"]:
        trained, fresh = r["after_load"]
        assert trained == fresh
        _close(*r["loaded_params"], atol=0)


@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
def test_typed_parameters_match_torchs_fully_shard(dtype: str) -> None:
    world = _world2()
    for ours, theirs in zip(world[f"fsdp2-{dtype}"], world[f"torch-{dtype}"]):
        if not TORCH_TAKES_TYPED:
            assert "must be DTensors on the full SPMD mesh" in theirs["refused"]
            continue
        assert ours["seen"] == theirs["seen"] and ours["placements"] == theirs["placements"]
        assert ours["losses"] == theirs["losses"]
        _close(ours["params"], theirs["params"], atol=0)
        assert ours["after_load"] == theirs["after_load"]


def test_tensor_parallel_types_train_like_the_local_model() -> None:
    world, local = _world4(), _local_tp()
    for r in world["tp-fsdp2"]:
        # column / row weights keep their tp shard under the data-parallel one
        assert r["placements"]["0.up"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert r["placements"]["0.down"] == "(Shard(dim=0), Shard(dim=1))"
        assert r["placements"]["0.bias"] == "(Shard(dim=0), Replicate())"
        _close(r["params"], local["params"])


def test_tensor_parallel_types_match_torchs_fully_shard() -> None:
    world = _world4()
    for ours, theirs in zip(world["tp-fsdp2"], world["tp-torch"]):
        if not TORCH_TAKES_TYPED:
            assert "must be DTensors on the full SPMD mesh" in theirs["refused"]
            continue
        assert ours["placements"] == theirs["placements"]
        assert ours["losses"] == theirs["losses"]
        _close(ours["params"], theirs["params"], atol=0)


def test_hsdp_typed_parameters_train_like_the_local_model_and_torch() -> None:
    world, local = _world4(), _local_1d(4)
    for ours, theirs in zip(world["hsdp-fsdp2"], world["hsdp-torch"]):
        _close(ours["params"], local["params"])
        if TORCH_TAKES_TYPED:
            assert ours["losses"] == theirs["losses"]
            _close(ours["params"], theirs["params"], atol=0)
        else:
            assert "must be DTensors on the full SPMD mesh" in theirs["refused"]


def test_types_fsdp2_cannot_take_are_refused_before_anything_changes() -> None:
    r = _world4()["refusals"][0]
    message, unchanged, cls = r["partial"]
    assert "do not cover the mesh fully_shard got" in message and "set_current_mesh" in message
    assert unchanged and cls == "Linear"
    message, unchanged, cls = r["partial_sum_on_dp"]
    assert "must be typed R (or not at all) there" in message and unchanged and cls == "Linear"
    assert "plain tensor with no spmd_types type" in r["untyped"] and "spmd_types.assert_type" in r["untyped"]
    message, cls = r["no_dp_mesh_dims"]
    assert "fully_shard got no dp_mesh_dims" in message and cls == "Linear"
    assert "typed P (a partial sum)" in r["partial_sum_on_tp"]
    assert r["inside_typecheck"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"  # fully_shard ran inside typecheck()

