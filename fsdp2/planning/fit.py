"""Fitting a plan to a per-rank memory budget.

The choices form one ladder, each rung the previous one plus one more conservative
setting, in order of cost:

1. every group kept gathered from forward to backward (no extra all-gather);
2. ``reshard_after_forward=True`` group by group, the largest first (one more
   all-gather of that group per step); the last block and the head stay gathered,
   since backward needs them at once;
3. selective activation checkpointing block by block, in forward order (recomputes the
   cheap ops), then full checkpointing block by block (recomputes the block);
4. CPU offload of every group (parameters and optimizer state on the host).

The plan is the first rung whose tracked peak fits: a binary search over the rungs
(peaks fall along the ladder), each probe one dry run. A smaller budget can only move
the choice down the ladder, so choices get more conservative as the budget shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.tracker import CATEGORIES
from .dryrun import DryRun, DryRunError
from .groups import Group
from .plan import Estimate, Plan

_MIB = 2**20
Setting = tuple[bool | int | None, str, bool]  # reshard_after_forward, ac, offload


class BudgetError(ValueError):
    """No plan fits the budget; ``plan`` is the most conservative one, with its estimate."""

    def __init__(self, message: str, plan: Plan) -> None:
        super().__init__(message)
        self.plan = plan


@dataclass
class Ladder:
    rungs: list[list[Setting]]
    labels: list[str]


def ladder(groups: list[Group], selective: bool = True) -> Ladder:
    settings: list[Setting] = [(None if g.kind == "root" else False, "none", False) for g in groups]
    rungs, labels = [list(settings)], ["every group kept gathered"]
    blocks = [i for i, g in enumerate(groups) if g.kind == "block"]
    last_block = blocks[-1] if blocks else None
    flips = [i for i, g in enumerate(groups) if g.kind in ("embeddings", "block") and i != last_block]
    for i in sorted(flips, key=lambda i: (-groups[i].gathered_bytes, i)):
        settings[i] = (True, "none", False)
        rungs.append(list(settings))
        labels.append(f"{groups[i].name}: reshard after forward")
    for mode in ("selective", "full") if selective else ("full",):
        for i in blocks:
            settings[i] = (settings[i][0], mode, False)
            rungs.append(list(settings))
            labels.append(f"{groups[i].name}: {mode} activation checkpointing")
    settings = [(r, ac, True) for r, ac, _ in settings]
    rungs.append(settings)
    labels.append("every group offloaded to the CPU")
    return Ladder(rungs, labels)


def with_setting(plan: Plan, rung: list[Setting]) -> None:
    for g, (reshard, ac, offload) in zip(plan.groups, rung):
        g.reshard_after_forward, g.ac, g.offload = reshard, ac, offload


def measure(run: DryRun, plan: Plan) -> Estimate:
    """The plan's tracked peak; with offload, the sharded parameters and the optimizer
    state count on the host (the dry run keeps everything on one device)."""
    estimate = run.measure(plan)
    if any(g.offload for g in plan.groups):
        moved = estimate.split["sharded parameters"] + estimate.split["optimizer state"]
        estimate.peak -= moved
        estimate.split = {**estimate.split, "sharded parameters": 0, "optimizer state": 0}
        estimate.note = f"offloaded: {moved / _MIB:,.1f} MiB of sharded parameters and optimizer state on the host"
    return estimate


def fit(plan: Plan, run: DryRun, budget: int) -> Plan:
    """Set ``plan``'s groups to the first rung that fits ``budget`` bytes (see above)."""
    first = ladder(plan.groups, selective=False).rungs[0]
    with_setting(plan, first)
    loosest = measure(run, plan)
    if loosest.peak <= budget:  # nothing to give up
        plan.estimate = _with_budget(loosest, budget)
        plan.estimate.note = _joined(plan.estimate.note, f"fitted: rung 0 (every group kept gathered), {run.runs} dry run")
        return plan
    selective, why = selective_runs(plan, run)
    steps = ladder(plan.groups, selective)
    seen: dict[int, Estimate] = {0: loosest}

    def peak(r: int) -> Estimate:
        if r not in seen:
            with_setting(plan, steps.rungs[r])
            seen[r] = measure(run, plan)
        return seen[r]

    lo, hi = 1, len(steps.rungs) - 1
    if peak(hi).peak > budget:
        with_setting(plan, steps.rungs[hi])
        plan.estimate = _with_budget(seen[hi], budget)
        raise BudgetError(_over(plan.estimate, steps.labels[hi]), plan)
    while lo < hi:  # the first rung that fits lies in [lo, hi]
        mid = (lo + hi) // 2
        if peak(mid).peak <= budget:
            hi = mid
        else:
            lo = mid + 1
    with_setting(plan, steps.rungs[lo])
    plan.estimate = _with_budget(peak(lo), budget)
    plan.estimate.note = _joined(plan.estimate.note, f"fitted: rung {lo} of {len(steps.rungs) - 1} "
                                 f"({steps.labels[lo]}), {run.runs} dry runs{why}")
    return plan


def _joined(note: str, more: str) -> str:
    return f"{note}\n{more}" if note else more


def selective_runs(plan: Plan, run: DryRun) -> tuple[bool, str]:
    """Whether selective checkpointing runs on this model's blocks: torch's refuses blocks
    whose recomputation differs from their forward (Hugging Face's attention slices its
    inputs differently, for one); then the ladder goes from none to full."""
    blocks = [g for g in plan.groups if g.kind == "block"]
    if not blocks:
        return False, ""
    saved = [(g.reshard_after_forward, g.ac, g.offload) for g in plan.groups]
    blocks[0].ac = "selective"
    try:
        run.measure(plan)
    except DryRunError as e:
        cause = str(e.__cause__).splitlines()[0].split(". ")[0]
        return False, f"; selective checkpointing left out, torch's refuses these blocks ({cause})"
    finally:
        with_setting(plan, saved)
    return True, ""


def _with_budget(e: Estimate, budget: int) -> Estimate:
    return Estimate(peak=e.peak, split=dict(e.split), phase=e.phase, budget=budget, note=e.note, settings=e.settings)


def _over(e: Estimate, label: str) -> str:
    if e.budget is None:
        raise AssertionError("fsdp2 internal error: an estimate over no budget")
    top = max(CATEGORIES, key=lambda c: e.split.get(c, 0))
    return (
        f"fsdp2.plan: no plan fits the budget of {e.budget / _MIB:,.1f} MiB per rank: the most conservative one "
        f"({label}, every block fully checkpointed) needs {e.peak / _MIB:,.1f} MiB, "
        f"{(e.peak - e.budget) / _MIB:,.1f} MiB over; the largest part is {top} "
        f"({e.split.get(top, 0) / _MIB:,.1f} MiB). Raise the budget, add ranks, shrink the local batch, "
        "or shard over more dims (tensor parallel); the error's .plan holds that plan and its estimate"
    )
