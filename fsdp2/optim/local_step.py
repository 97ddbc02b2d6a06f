"""Optimizer steps on the local shards.

A ``Shard(0)`` DTensor parameter costs a Python ``__torch_dispatch__`` round trip on
every op of the optimizer's per-parameter math (about 15 ops per parameter for AdamW),
often more than the forward and backward of a small block. For optimizers whose update
is elementwise, updating the DTensor equals updating each rank's local shard by itself.
So, for the duration of ``optimizer.step()`` only, each parameter group's list in
``param_groups`` is replaced by one where each managed parameter is a plain tensor
aliasing its local shard, with ``.grad`` and the DTensor optimizer state likewise
replaced by their local tensors; afterwards the original list is put back, and the
optimizer's state keeps its DTensors (updated in place) for ``state_dict()`` and
checkpointing.

Better still, a whole bucket (the parameters of one dtype of one ``fully_shard`` group)
steps as one flat tensor, the bucket's sharded flat buffer, when its gradients are views
of one flat tensor at the same offsets (as the reduce-scatter produces them), every
parameter has a gradient and is in the same parameter group, and its per-parameter
scalars (the step count) agree: the optimizer then runs its ~15 ops once per bucket
instead of once per parameter. Each DTensor state entry is moved once into a flat
buffer of the same layout (its per-parameter DTensors become views of it), and the
scalars are copied back to every parameter afterwards. Elementwise math is the same
either way, up to the last bit where a vectorized loop ends at another element.

The fast path runs only when nothing else could observe the swap or be changed by it:
the optimizer is exactly one of the elementwise ``torch.optim`` classes (a subclass may
compute norms), not ``differentiable``, stepped without a closure, with no step hooks
but fsdp2's, and the state of every parameter with a gradient already exists (the first
step creates it through the DTensor path, so its types and shapes are the regular ones).
A parameter group holding a DTensor fsdp2 does not manage, or a gradient or state entry
whose placement differs from its parameter's, steps on DTensors as before.

Planning costs Python work per parameter and state entry every step (about 5% of a
one-rank step of a small model). A parameter group whose every managed parameter stepped
flat keeps its plan for the next step, reused as long as its parameter list, each
parameter's local shard, state dict and state entries are the same objects, the step
counts were not written since (version counters), and every bucket's gradients are
still the flat ones its last backward committed (``GradCommit.flat_grad``); anything
else plans afresh.

If the step raises midway, the post-step hook does not run: the swap is undone at the
next ``step()``, ``state_dict()``, ``load_state_dict()`` or root forward, including a
``zero_grad(set_to_none=True)`` that ran on the aliases in between.

What a fast path needs between steps (last step's plans, a swap not yet undone, counters)
is held per optimizer (``LocalSteps``, a weak attachment: it goes with the optimizer),
and a swap not yet undone is also noted on the model's groups it touched (so that model's
next forward, on the stepping thread, can undo it); nothing is process-wide but the two
global step hooks (``install_hooks``).

``FSDP2_LOCAL_OPTIMIZER_STEP=0`` in the environment turns the fast path off (a debugging
switch, read at each step: nothing is decided at import).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch.optim import optimizer as _optimizer
from torch.utils.hooks import RemovableHandle

from ..params.param import HoldingGroup
from ._plan import _plan_group, _remember_plans, _reuse_plan
from ._swap import _GroupSwap, _restore

ENABLED = True  # False: never step on local shards (tests)
# Optimizers whose update of one element reads only that element's parameter, gradient
# and state (plus per-parameter scalars such as the step count).
ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.Adadelta,
        torch.optim.ASGD,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
    }
)


class LocalSteps:
    """One optimizer's fast path: its plans, the swap of a step in flight, its counters."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.plans: dict[int, _GroupSwap] = {}  # id(param group) -> last step's plan, all flat
        # The swap of a step not yet undone, and the thread stepping it.
        self.active: tuple[list[_GroupSwap], threading.Thread] | None = None
        # Steps taken on local shards, buckets stepped flat, groups stepped on last step's
        # plan: for tests and debugging (``fsdp2.optim.local_step_stats``).
        self.local_steps = self.flat_buckets = self.reused_plans = 0
        # Before the optimizer's state is read or replaced, a swap still in flight goes.
        optimizer.register_state_dict_pre_hook(repair)
        optimizer.register_load_state_dict_pre_hook(_before_load)


# optimizer -> its LocalSteps: a weak attachment (the entry goes with the optimizer; one
# optimizer's entry is never read for another).
# process-wide: torch.optim has no per-optimizer slot of ours; keyed by the optimizer.
_ATTACHED: weakref.WeakKeyDictionary[torch.optim.Optimizer, LocalSteps] = weakref.WeakKeyDictionary()


def attached(optimizer: torch.optim.Optimizer, create: bool = False) -> LocalSteps | None:
    found = _ATTACHED.get(optimizer)
    if found is None and create:
        found = _ATTACHED[optimizer] = LocalSteps(optimizer)
    return found


def local_step_stats(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """How often ``optimizer`` stepped on local shards, how many buckets it stepped as one
    flat tensor and how many parameter groups reused last step's plan (debugging)."""
    found = attached(optimizer)
    if found is None:
        return {"local_steps": 0, "flat_buckets": 0, "reused_plans": 0}
    return {"local_steps": found.local_steps, "flat_buckets": found.flat_buckets, "reused_plans": found.reused_plans}


def pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict, managed: Callable) -> None:
    """Swap managed parameters for their local shards, when safe (see the module doc)."""
    mine = attached(optimizer)
    if mine is not None and mine.active is not None:
        repair(optimizer)
    if not _eligible(optimizer, args, kwargs):
        return
    swaps: list[_GroupSwap] = []
    seen: set[int] = set()
    plans = mine.plans if mine is not None else {}
    for key in plans.keys() - {id(g) for g in optimizer.param_groups}:
        del plans[key]  # a group the optimizer dropped: its plan would hold its state
    reused = 0
    for group in optimizer.param_groups:
        planned = _reuse_plan(optimizer, group, plans.get(id(group)), seen)
        if planned is None:
            planned = _plan_group(optimizer, group, managed, seen)
        else:
            reused += 1
        if planned is not None:
            swaps.append(planned)
    if not swaps:
        return
    mine = attached(optimizer, create=True)
    if mine is None:
        raise AssertionError("fsdp2 internal error: expected mine is not None")
    mine.reused_plans += reused
    mine.active = (swaps, threading.current_thread())  # first: repairable from here on
    _note_on_groups(optimizer, swaps)
    state = optimizer.state
    for swap in swaps:
        swap.group["params"] = swap.swapped_list
        for s in swap.entries:
            s.alias.grad = s.grad
            if s.local_state is not None:
                state[s.alias] = s.local_state
        for f in swap.flats:
            f.alias.grad = f.grad
            state[f.alias] = f.local_state
        mine.flat_buckets += len(swap.flats)
    mine.local_steps += 1


def post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    mine = attached(optimizer)
    if mine is not None and mine.active is not None:
        swaps = _undo(optimizer, mine)
        _remember_plans(optimizer, swaps, mine.plans)


def repair(optimizer: torch.optim.Optimizer) -> None:
    """Put back what a fast-path step of ``optimizer`` swapped, if anything."""
    mine = attached(optimizer)
    if mine is not None and mine.active is not None:
        _undo(optimizer, mine)


def _undo(optimizer: torch.optim.Optimizer, mine: LocalSteps) -> list[_GroupSwap]:
    if mine.active is None:
        raise AssertionError("fsdp2 internal error: expected mine.active is not None")
    swaps, mine.active = mine.active[0], None
    for g in _groups(swaps):
        g.keep_unfinished_steps(lambda r: r() not in (optimizer, None))
    _restore(optimizer, swaps)
    return swaps


def _before_load(optimizer: torch.optim.Optimizer, state_dict: object = None) -> None:
    repair(optimizer)
    mine = attached(optimizer)
    if mine is not None:
        mine.plans.clear()  # the load replaces groups and state: plan afresh


def _note_on_groups(optimizer: torch.optim.Optimizer, swaps: list[_GroupSwap]) -> None:
    """The model's groups remember the step in flight over them (``repair_owned``)."""
    for g in _groups(swaps):
        g.note_unfinished_step(weakref.ref(optimizer))


def repair_owned(groups: Sequence[HoldingGroup]) -> None:
    """At a root's forward: undo the unfinished swaps (a step that raised) of optimizers
    stepping parameters of ``groups`` on this thread. A step in flight on another
    thread (threaded process groups) and the optimizers of other models are left alone."""
    me = threading.current_thread()
    for g in groups:
        for ref in list(g.unfinished_steps):
            opt = ref()
            mine = attached(opt) if opt is not None else None
            if mine is not None and mine.active is not None:
                thread = mine.active[1]
                if thread is me or not thread.is_alive():
                    _undo(cast(torch.optim.Optimizer, opt), mine)  # also forgets it on every group it touched (mine: opt is alive)
        # What is left: steps still in flight on other threads (dead optimizers go).
        g.keep_unfinished_steps(_in_flight)


def _in_flight(ref: weakref.ref) -> bool:
    opt = ref()
    mine = attached(opt) if opt is not None else None
    return mine is not None and mine.active is not None


def _groups(swaps: list[_GroupSwap]) -> list[HoldingGroup]:
    """The fsdp2 groups (``ParamGroup``) whose parameters ``swaps`` touched (found once
    per plan: a reused plan keeps them)."""
    found: dict[int, HoldingGroup] = {}
    for swap in swaps:
        if swap.groups is None:
            fps = [s.fp for s in swap.entries] + [fp for f in swap.flats for fp in f.fps]
            swap.groups = list({id(g): g for g in (fp.group() for fp in fps) if g is not None}.values())
        found.update((id(g), g) for g in swap.groups)
    return list(found.values())


def _eligible(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    return (
        ENABLED
        and os.environ.get("FSDP2_LOCAL_OPTIMIZER_STEP", "1") != "0"
        and type(optimizer) in ELEMENTWISE
        and len(args) <= 1
        and kwargs.get("closure") is None
        and not optimizer.defaults.get("differentiable", False)
        and len(_optimizer._global_optimizer_pre_hooks) == 1
        and not _optimizer._global_optimizer_post_hooks.keys() - {h.id for h in _HOOKS[1:]}
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and not torch.compiler.is_compiling()
    )


# The global optimizer step hooks (pre, post), installed by the first fully_shard. They
# must be global: fsdp2 cannot see an optimizer being created over its parameters, only
# its steps, and a user's optimizer needs no call of ours. Each is a no-op for
# optimizers stepping no fsdp2 parameter.
# process-wide: so are the hooks it holds (installed once).
_HOOKS: list[RemovableHandle] = []


_HOOKS_LOCK = threading.Lock()  # ranks as threads may call fully_shard at once


def install_hooks(pre_hook: Callable[[torch.optim.Optimizer, tuple, dict], None]) -> None:
    """Install the global step hooks once per process (``pre_hook`` calls ``pre_step``)."""
    with _HOOKS_LOCK:
        if not _HOOKS:
            _HOOKS.append(_optimizer.register_optimizer_step_pre_hook(pre_hook))
            _HOOKS.append(_optimizer.register_optimizer_step_post_hook(post_step))


def forget_plans_of(buckets: Sequence[object]) -> None:
    """Drop every optimizer's kept plan that steps a parameter of ``buckets``: their
    parameters moved (``module._apply``), and a kept plan holds the flat optimizer state
    of the old device, which the user's own move of the state would leave behind."""
    ids = {id(b) for b in buckets}
    for steps in list(_ATTACHED.values()):
        for key, plan in list(steps.plans.items()):
            if any(id(f.bucket) in ids for f in plan.flats):
                del steps.plans[key]
