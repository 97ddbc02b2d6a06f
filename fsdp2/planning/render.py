"""A plan as a table (``str(plan)``) and as Python (``plan.code()``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from .groups import ROOT, Group, local

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ..api import ShardPlacementResult

_MIB = 2**20


def mib(n: int) -> str:
    """Bytes as MiB, with more decimals for small sizes."""
    return f"{n / _MIB:,.1f}" if n >= 10 * _MIB or n == 0 else f"{n / _MIB:.3f}"


def experts_on(
    experts: nn.Module, mesh: DeviceMesh | None
) -> Callable[[torch.Tensor], ShardPlacementResult | None]:
    """A ``shard_placement_fn`` putting ``experts``' parameters on ``mesh`` (``None``: the
    default process group's ranks) and every other parameter of the call on the call's
    mesh. As torchtitan does, experts are sharded on dim 1 when more ranks shard them
    than there are experts (no padding), else on dim 0."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from ..api import ShardPlacementResult

    size = mesh.size(mesh.ndim - 1) if mesh is not None else dist.get_world_size()
    placements: dict[torch.Tensor, ShardPlacementResult] = {}
    for p in experts.parameters():
        rows = local(p).shape[0] if p.ndim > 1 else size
        placements[p] = ShardPlacementResult(Shard(1) if size > rows else Shard(0), mesh)
    return placements.get


class RenderedEstimate(Protocol):
    """What the table reads of a plan's ``plan.Estimate`` (plan.py imports this module)."""

    @property
    def peak(self) -> int: ...
    @property
    def split(self) -> dict[str, int]: ...
    @property
    def phase(self) -> str: ...
    @property
    def budget(self) -> int | None: ...
    @property
    def note(self) -> str: ...
    @property
    def settings(self) -> tuple: ...
    @property
    def fits(self) -> bool: ...


class RenderedPlan(Protocol):
    """What the table reads of a ``plan.Plan`` (plan.py imports this module)."""

    @property
    def groups(self) -> Sequence[Group]: ...
    @property
    def blocks_from(self) -> str: ...
    @property
    def estimate(self) -> RenderedEstimate | None: ...

    def settings(self) -> tuple[tuple[bool | int | None, str, bool], ...]: ...


def render_table(plan: RenderedPlan) -> str:
    """``plan`` (a ``Plan``) as a table, with its estimate when it has one."""
    head = ("group", "modules", "params", "gathered MiB", "reshard", "AC", "offload", "why")
    rows = [head]
    for g in plan.groups:
        reshard = "default" if g.reshard_after_forward is None else str(g.reshard_after_forward)
        rows.append((g.name, str(len(g.modules)), f"{g.params:,}", mib(g.gathered_bytes), reshard,
                     g.ac, "yes" if g.offload else "no", g.why))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(c.ljust(w) if i in (0, 4, 5, 6) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"blocks: {plan.blocks_from}")
    if plan.estimate is not None:
        lines += _estimate_lines(plan)
    return "\n".join(lines)


def _estimate_lines(plan: RenderedPlan) -> list[str]:
    from ..memory.tracker import CATEGORIES

    e = plan.estimate
    if e is None:
        raise AssertionError("no estimate to print")
    out = [f"estimated peak per rank: {mib(e.peak)} MiB ({e.phase})"
           + (f", budget {mib(e.budget)} MiB: " + ("fits" if e.fits else
              f"over by {mib(e.peak - e.budget)} MiB") if e.budget is not None else "")]
    if e.settings and e.settings != plan.settings():
        out.append("  (measured before the groups' settings changed: not this plan's; fsdp2.plan again to measure)")
    for c in CATEGORIES:
        share = e.split.get(c, 0) / e.peak if e.peak else 0.0
        out.append(f"  {c:22s} {mib(e.split.get(c, 0)):>12s} MiB  {share:6.1%}")
    if e.note:
        out.append(e.note)
    return out


# ---------------------------------------------------------------------------- code
def render_calls(calls: list[tuple[str, tuple[str, ...], dict[str, Any]]], model: str) -> str:
    units: list[tuple[dict[str, Any] | None, tuple[str, ...], dict[str, Any]]] = []
    pending: dict[str, Any] | None = None
    for fn, modules, kwargs in calls:
        if fn == "checkpoint":
            pending = kwargs
        else:
            units.append((pending, modules, kwargs))
            pending = None
    lines = ["import fsdp2"]
    if any(u[0] is not None for u in units):
        lines.append("from torch.distributed._composable import checkpoint")
    if any(u[0] and "context_fn" in u[0] for u in units):
        lines.append("from fsdp2.planning import selective_context")
    if any("shard_placement_fn" in u[2] for u in units):
        lines.append("from fsdp2.planning import experts_on")
    lines.append("")
    i = 0
    while i < len(units):
        run = _run(units, i)
        lines += _loop(units[i:i + run], model) if run > 2 else _unit(units[i], model, "")
        i += max(run if run > 2 else 1, 1)
    return "\n".join(lines) + "\n"


_INDEXED = re.compile(r"^(.*\.)?(\d+)$")


def _run(units: list, start: int) -> int:
    """How many units from ``start`` are one module each, named ``prefix.<i>`` with
    consecutive ``i``, with the same arguments (but the experts' fqn)."""
    def key(u: Any) -> Any:
        ac, modules, kwargs = u
        m = _INDEXED.match(modules[0]) if len(modules) == 1 else None
        if m is None:
            return None
        expert = kwargs.get("shard_placement_fn")
        tail = expert.fqn[len(modules[0]):] if expert else None
        same = tuple((k, id(v) if k in ("mesh", "mp_policy", "ignored_params") else repr(v))
                     for k, v in kwargs.items() if k != "shard_placement_fn")
        return (m.group(1), ac and tuple(ac), same, tail), int(m.group(2))

    first = key(units[start])
    if first is None:
        return 1
    n = 1
    while start + n < len(units):
        k = key(units[start + n])
        if k is None or k[0] != first[0] or k[1] != first[1] + n:
            break
        n += 1
    return n


def _loop(units: list, model: str) -> list[str]:
    first = units[0][1][0]
    indexed = _INDEXED.match(first)
    if indexed is None:
        raise AssertionError(f"fsdp2 internal error: {first} is not an indexed block")
    prefix, index = indexed.group(1) or "", int(indexed.group(2))
    head = f"for i in range({index}, {index + len(units)}):"
    body = _unit(units[0], model, "    ", target=f'{model}.get_submodule(f"{prefix}{{i}}")', name="block")
    return [head, *body]


def _unit(unit: Any, model: str, indent: str, target: str | None = None, name: str | None = None) -> list[str]:
    ac, modules, kwargs = unit
    if target is None:
        parts = [model if m == ROOT else f'{model}.get_submodule("{m}")' for m in modules]
        target = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    lines = []
    ref = target
    if ac is not None or (name and "shard_placement_fn" in kwargs):
        lines.append(f"{indent}{name or 'block'} = {target}")
        ref = name or "block"
    if ac is not None:
        lines.append(f"{indent}checkpoint({ref}{', context_fn=selective_context' if 'context_fn' in ac else ''})")
    args = []
    for k, v in kwargs.items():
        if k in ("mesh", "mp_policy", "ignored_params"):
            args.append(f"{k}={k}")
        elif k == "offload_policy":
            args.append("offload_policy=fsdp2.CPUOffloadPolicy()")
        elif k == "shard_placement_fn":
            sub = v.fqn[len(modules[0]) + 1:] if name else v.fqn
            base = ref if name else model
            on = "expert_mesh" if v.own_mesh else "mesh"
            args.append(f'shard_placement_fn=experts_on({base}.get_submodule("{sub}"), {on})')
        else:
            args.append(f"{k}={v!r}")
    lines.append(f"{indent}fsdp2.fully_shard({ref}, {', '.join(args)})")
    return lines
