"""``fsdp2.plan``: the ``fully_shard`` calls for a whole model, fitted to a memory budget.

    plan = fsdp2.plan(model, mesh=mesh, mp_policy=mp_policy)
    print(plan)            # the table: group, modules, parameters, gathered MiB, reshard, AC, offload, why
    print(plan.code())     # the same calls as Python
    plan.apply(model)      # exactly those calls

See ``docs/planning.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..api import MixedPrecisionPolicy
from .dryrun import DryRunError
from .fit import BudgetError, fit
from .groups import Group, block_classes, find_blocks, find_experts, find_groups, local, scale_to_dtype
from .plan import Estimate, Plan, fingerprint, selective_context
from .render import experts_on

__all__ = ["BudgetError", "DryRunError", "Estimate", "Group", "Plan", "experts_on", "plan", "selective_context"]


def plan(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    world_size: int | tuple[int, int] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    expert_mesh: DeviceMesh | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    blocks: Iterable[type | str] | None = None,
    memory_budget: int | str | None = None,
    inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Callable[..., Any] | None = None,
) -> Plan:
    """The groups of ``model`` and how each is sharded (see ``docs/planning.md``).

    Args:
        model: the unsharded model (on any device, meta included).
        mesh: the mesh every call gets (1-D or ``(replicate, shard)``); ``None`` as for
            ``fully_shard``. Its shape is the job's shape for the estimate.
        world_size: the job's size when planning before launch, without a mesh: the
            estimate's mesh is ``(world_size,)``, or the HSDP shape ``(replicate, shard)``
            given as a tuple; the plan's calls get ``mesh=None`` (``adopt`` moves the
            settings onto the plan made with the job's mesh).
        mp_policy: the ``MixedPrecisionPolicy`` of every call (default: none).
        expert_mesh: the mesh of routed experts (Mixture-of-Experts): each block's
            experts module is sharded on it through ``shard_placement_fn``.
        ignored_params: passed to every call; not counted in any group.
        blocks: the block classes (or their names), instead of ``_no_split_modules`` or
            the repeated class.
        memory_budget: bytes per rank (an int, or a string such as ``"40GiB"``,
            ``"512MiB"``); the plan is then fitted to it (``BudgetError`` if nothing
            fits). Needs ``inputs``.
        inputs: one local batch (real or meta tensors; a tensor, a tuple of positional
            inputs or a dict of keyword inputs): with it the plan carries the tracked
            peak of one step (``plan.estimate``).
        loss_fn: the loss from the model's output (default: ``output.loss``, else the
            output's mean).
        optimizer: the job's optimizer class or factory (default ``torch.optim.AdamW``),
            for its state.
    """
    from ..api import MixedPrecisionPolicy

    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp2.plan expects an nn.Module, got {type(model).__name__}")
    shape = _world_shape(world_size)
    if mesh is not None and shape is not None and tuple(mesh.mesh.shape) != shape:
        raise ValueError(f"fsdp2.plan: world_size={world_size} but the mesh is {tuple(mesh.mesh.shape)}; give one of them")
    budget = parse_budget(memory_budget)
    if budget is not None and inputs is None:
        raise ValueError("fsdp2.plan: memory_budget= needs inputs= (one local batch) to measure the step it fits")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    ignored = set(ignored_params or ())
    classes, where = block_classes(model, blocks)
    block_names = find_blocks(model, classes)
    if blocks is not None and not block_names:
        raise ValueError(f"fsdp2.plan: no module of the classes {sorted(classes)} (blocks=) in this model")
    groups = find_groups(model, block_names, ignored)
    scale_to_dtype(groups, mp_policy.param_dtype)
    job_shape, names = _job_shape(mesh, shape)
    shard_size = job_shape[-1]  # the ranks each call shards over
    for g in groups:
        if g.kind == "block":
            g.why = f"repeated block {type(model.get_submodule(g.modules[0])).__name__}"
            _place_experts(model, g, expert_mesh, shard_size)
    described = f"{', '.join(sorted(classes)) or 'none'} ({where}), {len(block_names)} found"
    ignored_fqns = [n for n, p in model.named_parameters() if p in ignored]
    result = Plan(groups, mesh=mesh, mp_policy=mp_policy, expert_mesh=expert_mesh, ignored_fqns=ignored_fqns,
                  fingerprint=fingerprint(model), blocks_from=described)
    if inputs is None:
        return result
    _check_estimable(model, expert_mesh)
    from .dryrun import DryRun

    with DryRun(model, job_shape, names, inputs, loss_fn, optimizer) as run:
        if budget is None:
            result.estimate = run.measure(result)
            return result
        return fit(result, run, budget)


def _world_shape(world_size: int | tuple[int, ...] | None) -> tuple[int, ...] | None:
    if world_size is None:
        return None
    shape = (world_size,) if isinstance(world_size, int) else tuple(world_size)
    if not 1 <= len(shape) <= 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(f"fsdp2.plan: world_size must be a positive int or a (replicate, shard) pair, got {world_size!r}")
    return shape


def _place_experts(model: nn.Module, g: Group, expert_mesh: DeviceMesh | None, shard_size: int) -> None:
    """A block's routed experts: on the expert mesh when one is given; else on the call's
    mesh, sharded on dim 1 where more ranks shard them than there are experts
    (torchtitan's choice, no padding), left to the default (dim 0) otherwise."""
    experts = find_experts(model, g.modules[0])
    if experts is None:
        return
    short = experts[len(g.modules[0]) + 1:]
    if expert_mesh is not None:
        g.experts = experts
        g.why += f"; experts ({short}) on the expert mesh"
        return
    rows = min(local(p).shape[0] for p in model.get_submodule(experts).parameters() if p.ndim > 1)
    if shard_size > rows:
        g.experts = experts
        g.why += f"; experts ({short}) sharded on dim 1: {rows} experts, {shard_size} ranks"


def _check_estimable(model: nn.Module, expert_mesh: DeviceMesh | None) -> None:
    """The dry run copies plain parameters to the meta device over one meta mesh."""
    from torch.distributed.tensor import DTensor

    tp = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if tp or expert_mesh is not None:
        what = f"DTensor parameters ({', '.join(tp[:2])}, ...: tensor or expert parallel)" if tp else "an expert_mesh"
        raise ValueError(
            f"fsdp2.plan: the estimate (inputs=, memory_budget=) does not run models with {what} yet; make "
            "the plan without inputs= and measure the job with python -m fsdp2.estimate"
        )


def _job_shape(mesh: DeviceMesh | None, shape: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """The job's mesh shape and dim names: ``mesh``'s, ``world_size=``'s, or the default
    process group's size (1 without one)."""
    if mesh is not None:
        return tuple(mesh.mesh.shape), mesh.mesh_dim_names
    if shape is None:
        import torch.distributed as dist

        shape = (dist.get_world_size() if dist.is_initialized() else 1,)
    return shape, None


def parse_budget(budget: int | float | str | None) -> int | None:
    """Bytes from an int or a string with a unit (``"40GiB"``, ``"512 MiB"``, ``"80GB"``)."""
    if budget is None:
        return None
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12}
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        if m is None or m.group(2).lower() not in units:
            raise ValueError(f"fsdp2.plan: memory_budget must be bytes or a size such as '40GiB' or '512MiB', "
                             f"got {budget!r}")
        return int(float(m.group(1)) * units[m.group(2).lower()])
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"fsdp2.plan: memory_budget must be a positive number of bytes, got {budget!r}")
    return int(budget)
