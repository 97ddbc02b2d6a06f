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

``FSDP2_LOCAL_OPTIMIZER_STEP=0`` in the environment turns the fast path off.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as _optimizer

from ._param import make_dtensor

ENABLED = os.environ.get("FSDP2_LOCAL_OPTIMIZER_STEP", "1") != "0"
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
# Steps taken on local shards, buckets stepped as one flat tensor, and parameter groups
# that stepped on last step's plan: for tests and debugging.
local_steps = 0
flat_buckets = 0
reused_plans = 0


class _Swapped:
    """One parameter stepped through a plain alias of its local shard."""

    __slots__ = ("alias", "fp", "grad", "local_state", "locals", "param", "state")

    def __init__(
        self,
        param: torch.Tensor,
        fp: Any,
        alias: torch.Tensor,
        grad: torch.Tensor | None,
        state: dict | None,
        local_state: dict | None,
        locals_: dict[Any, torch.Tensor],
    ) -> None:
        self.param = param
        self.fp = fp
        self.alias = alias
        self.grad = grad
        self.state = state
        self.local_state = local_state
        self.locals = locals_


class _FlatSwapped:
    """A whole bucket stepped as one flat alias of its sharded flat buffer."""

    __slots__ = ("alias", "bucket", "flats", "fps", "grad", "local_state", "params", "snapshot", "states")

    def __init__(
        self,
        alias: torch.Tensor,
        grad: torch.Tensor,
        entries: list[_Swapped],
        local_state: dict,
        flats: dict[Any, torch.Tensor],
    ) -> None:
        self.alias = alias
        self.bucket = entries[0].fp.bucket
        self.snapshot: tuple[list, list] = ([], [])  # taken after the step (``_snapshot``)
        self.grad = grad
        self.params = [s.param for s in entries]
        self.fps = [s.fp for s in entries]
        self.states: list[dict | None] = [s.state for s in entries]
        self.local_state = local_state
        self.flats = flats  # state key -> the flat tensor the parameters' DTensor state views


class _GroupSwap:
    """One parameter group's list, replaced for the step."""

    __slots__ = ("entries", "flats", "group", "original", "params", "swapped_list")

    def __init__(
        self, group: dict, swapped_list: list, entries: list[_Swapped], flats: list[_FlatSwapped]
    ) -> None:
        self.group = group
        self.original = group["params"]
        self.params = tuple(self.original)  # its contents when planned
        self.swapped_list = swapped_list
        self.entries = entries
        self.flats = flats


# id(optimizer) -> (weak ref to it, what its unfinished fast-path step swapped, the
# thread stepping it). Each entry is one optimizer's own: only that optimizer's next
# step, state_dict or load, or a forward of a model it steps (on the stepping thread,
# or once that thread is gone: the step raised, see ``repair_owned``), restores it.
_ACTIVE: dict[int, tuple[weakref.ref, list[_GroupSwap], threading.Thread]] = {}
_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers with our state_dict repair hooks
# optimizer -> {id(param group): its plan from the last step, all flat} (module doc)
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict, managed: Callable) -> None:
    """Swap managed parameters for their local shards, when safe (see the module doc)."""
    global local_steps, flat_buckets, reused_plans
    if _ACTIVE:
        repair(optimizer)
    if not _eligible(optimizer, args, kwargs):
        return
    swaps: list[_GroupSwap] = []
    seen: set[int] = set()
    plans = _PLANS.get(optimizer, {})
    if plans:
        for key in plans.keys() - {id(g) for g in optimizer.param_groups}:
            del plans[key]  # a group the optimizer dropped: its plan would hold its state
    for group in optimizer.param_groups:
        planned = _reuse_plan(optimizer, group, plans.get(id(group)), seen)
        if planned is None:
            planned = _plan_group(optimizer, group, managed, seen)
        else:
            reused_plans += 1
        if planned is not None:
            swaps.append(planned)
    if not swaps:
        return
    if optimizer not in _HOOKED:
        _HOOKED.add(optimizer)
        optimizer.register_state_dict_pre_hook(repair)
        optimizer.register_load_state_dict_pre_hook(_before_load)
    state = optimizer.state
    _ACTIVE[id(optimizer)] = (weakref.ref(optimizer), swaps, threading.current_thread())  # first: repairable from here on
    for swap in swaps:
        swap.group["params"] = swap.swapped_list
        for s in swap.entries:
            s.alias.grad = s.grad
            if s.local_state is not None:
                state[s.alias] = s.local_state
        for f in swap.flats:
            f.alias.grad = f.grad
            state[f.alias] = f.local_state
        flat_buckets += len(swap.flats)
    local_steps += 1


def post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if _ACTIVE:
        swaps = _undo(optimizer)
        if swaps is not None:
            _remember_plans(optimizer, swaps)


def repair(optimizer: torch.optim.Optimizer) -> None:
    """Put back what a fast-path step of ``optimizer`` swapped, if anything."""
    _undo(optimizer)


def _undo(optimizer: torch.optim.Optimizer) -> list[_GroupSwap] | None:
    entry = _ACTIVE.pop(id(optimizer), None)
    if entry is not None and entry[0]() is optimizer:
        _restore(optimizer, entry[1])
        return entry[1]
    return None


def _before_load(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    repair(optimizer)
    _PLANS.pop(optimizer, None)  # the load replaces groups and state: plan afresh


def repair_owned(groups: list[Any]) -> None:
    """At a root's forward: undo the unfinished swaps (a step that raised) of optimizers
    stepping parameters of ``groups`` on this thread. A step in flight on another
    thread (threaded process groups) and the optimizers of other models are left alone."""
    me = threading.current_thread()
    mine = {id(g) for g in groups}
    for key, (ref, swaps, thread) in list(_ACTIVE.items()):
        if (thread is not me and thread.is_alive()) or not any(id(fp.group()) in mine for fp in _swapped_params(swaps)):
            continue  # a step in flight on another thread, or another model's optimizer
        _ACTIVE.pop(key, None)
        opt = ref()
        if opt is not None:
            _restore(opt, swaps)


def _swapped_params(swaps: list[_GroupSwap]) -> Any:
    for swap in swaps:
        for s in swap.entries:
            yield s.fp
        for f in swap.flats:
            yield from f.fps


def _eligible(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    return (
        ENABLED
        and type(optimizer) in ELEMENTWISE
        and len(args) <= 1
        and kwargs.get("closure") is None
        and not optimizer.defaults.get("differentiable", False)
        and len(_optimizer._global_optimizer_pre_hooks) == 1
        and not _optimizer._global_optimizer_post_hooks.keys() - _OUR_POST_HOOKS
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and not torch.compiler.is_compiling()
    )


_OUR_POST_HOOKS: set[int] = set()


def register_post_hook() -> Any:
    handle = _optimizer.register_optimizer_step_post_hook(post_step)
    _OUR_POST_HOOKS.add(handle.id)
    return handle


# ------------------------------------------------------------------ plan reuse
def _remember_plans(optimizer: torch.optim.Optimizer, swaps: list[_GroupSwap]) -> None:
    """After a completed step: keep the plans of groups that stepped entirely flat."""
    state = optimizer.state
    plans = _PLANS.setdefault(optimizer, {})
    for swap in swaps:
        if swap.entries:
            plans.pop(id(swap.group), None)
            continue
        for f in swap.flats:
            f.snapshot = _snapshot(state, f)
            f.grad = None  # a kept plan must not keep this step's gradients alive
        plans[id(swap.group)] = swap


def _reuse_plan(
    optimizer: torch.optim.Optimizer, group: dict, cached: _GroupSwap | None, seen: set[int]
) -> _GroupSwap | None:
    """``cached`` again, with this step's gradients, if nothing it relied on changed."""
    if cached is None or cached.group is not group:
        return None
    params = group["params"]
    if (
        params is not cached.original
        or len(params) != len(cached.params)
        or not all(map(operator.is_, params, cached.params))
        or not seen.isdisjoint(map(id, params))
    ):
        return None
    grads = []
    for f in cached.flats:
        grad = f.bucket.commit.flat_grad()
        if grad is None or not _same_snapshot(_snapshot(optimizer.state, f), f.snapshot):
            return None
        grads.append(grad)
    for f, grad in zip(cached.flats, grads):
        f.grad = grad
    seen.update(map(id, params))
    return cached


def _snapshot(state: dict, f: _FlatSwapped) -> tuple[list, list]:
    """What a flat plan relies on: (objects compared by identity, values compared by ==)."""
    objects: list = [f.bucket.sharded_flat]
    values: list = []
    for p in f.params:
        st = state.get(p)
        objects.append(p._local_tensor)
        objects.append(st)
        for k, v in st.items() if st is not None else ():
            values.append(k)
            if isinstance(v, torch.Tensor):
                objects.append(v)
                if not isinstance(v, DTensor):
                    values.append(v._version)  # a step count written since: plan afresh
            else:
                values.append(v)
    return objects, values


def _same_snapshot(a: tuple[list, list], b: tuple[list, list]) -> bool:
    return len(a[0]) == len(b[0]) and all(map(operator.is_, a[0], b[0])) and a[1] == b[1]


# ------------------------------------------------------------------------ planning
def _plan_group(
    optimizer: torch.optim.Optimizer, group: dict, managed: Callable, seen: set[int]
) -> _GroupSwap | None:
    """What swapping this parameter group means, or ``None`` if it must stay DTensor.
    Plans only: nothing is changed until every group is planned (except that DTensor
    state may move, values unchanged, into the flat buffer of its bucket)."""
    params = group["params"]
    # Plain SGD keeps no state at all: nothing for a first DTensor step to create.
    stateless = type(optimizer) is torch.optim.SGD and not group.get("momentum")
    entries: dict[int, _Swapped] = {}
    state = optimizer.state
    for p in params:
        fp = managed(p)
        if fp is None:
            if isinstance(p, DTensor):
                return None  # a DTensor we do not manage: a foreach list may not mix kinds
            continue
        if id(p) in seen:
            return None  # listed twice (torch only warns): one alias could not stand for both
        if fp.extension:
            return None  # a subclass (all-gather extension): its own ops, on the DTensor path
        seen.add(id(p))
        local = p._local_tensor
        grad = p.grad
        if grad is not None and not _same_layout(grad, p, local):
            return None
        st = state.get(p)
        if not st:
            if grad is not None and not stateless:
                return None  # first step: let the DTensor path create the state
            st = None
        local_state = None
        locals_: dict[Any, torch.Tensor] = {}
        if st is not None:
            local_state = {}
            for k, v in st.items():
                if isinstance(v, DTensor):
                    if not _same_layout(v, p, local):
                        return None
                    v = locals_[k] = v._local_tensor
                elif v is None or (isinstance(v, torch.Tensor) and v.dim() > 0):
                    # A placeholder the step may fill (SGD's momentum_buffer saved as None),
                    # or a full-size plain tensor where DTensor state belongs: the DTensor
                    # path decides what happens, as it would without fsdp2's fast path.
                    return None
                local_state[k] = v
        alias = fp.optimizer_alias(local)
        local_grad = None if grad is None else grad._local_tensor
        entries[id(p)] = _Swapped(p, fp, alias, local_grad, st, local_state, locals_)
    if not entries:
        return None
    flats, merged = _merge_buckets(entries)
    swapped_list = []
    for p in params:
        s = entries.get(id(p))
        if s is None:
            swapped_list.append(p)
        elif id(p) in merged:
            flat = merged[id(p)]
            if flat is not None:  # the bucket's first parameter stands for the bucket
                swapped_list.append(flat.alias)
        else:
            swapped_list.append(s.alias)
    rest = [s for s in entries.values() if id(s.param) not in merged]
    return _GroupSwap(group, swapped_list, rest, flats)


def _merge_buckets(entries: dict[int, _Swapped]) -> tuple[list[_FlatSwapped], dict[int, _FlatSwapped | None]]:
    """Buckets whose parameters can step as one flat tensor (see the module doc)."""
    by_bucket: dict[int, list[_Swapped]] = {}
    for s in entries.values():
        by_bucket.setdefault(id(s.fp.bucket), []).append(s)
    flats: list[_FlatSwapped] = []
    merged: dict[int, _FlatSwapped | None] = {}
    for group in by_bucket.values():
        flat = _flat_swap(group)
        if flat is not None:
            flats.append(flat)
            for i, s in enumerate(group):
                merged[id(s.param)] = flat if i == 0 else None
    return flats, merged


def _flat_swap(entries: list[_Swapped]) -> _FlatSwapped | None:
    bucket = entries[0].fp.bucket
    if len(entries) != len(bucket.params) or bucket.scalars or len(entries) < 2:
        return None
    entries.sort(key=lambda s: s.fp.offset)
    numel = bucket.shard_numel
    flat_param = bucket.sharded_flat
    if flat_param.numel() != numel:
        return None
    storage = flat_param.untyped_storage().data_ptr()
    base = flat_param.storage_offset()
    stateless = entries[0].state is None  # plain SGD
    for s in entries:
        local = s.param._local_tensor  # compared by storage: an empty tensor's data_ptr is 0
        if (
            s.grad is None
            or (s.state is None) != stateless
            or local.untyped_storage().data_ptr() != storage
            or local.storage_offset() != base + s.fp.offset
        ):
            return None
    grad = _flat_view([s.grad for s in entries], entries, numel, flat_param.dtype)
    if grad is None:
        return None
    first = entries[0].state or {}
    keys = list(first)
    for s in entries[1:] if not stateless else ():
        if len(s.state) != len(keys) or any(k not in s.state for k in keys):
            return None
    local_state: dict[Any, Any] = {}
    flats: dict[Any, torch.Tensor] = {}
    to_rehome = []
    for k in keys:
        if k in entries[0].locals:
            values = [s.locals.get(k) for s in entries]
            if any(v is None for v in values) or any(v.dtype != values[0].dtype for v in values):
                return None
            view = _flat_view(values, entries, numel, values[0].dtype)
            del values  # no reference of ours may outlive a move into a flat buffer
            if view is None:
                to_rehome.append(k)
            else:
                flats[k] = local_state[k] = view
        else:
            v0 = first[k]
            if isinstance(v0, torch.Tensor):
                if v0.device.type != "cpu" or v0.dim() != 0:
                    return None  # comparing device scalars would synchronize
                value = v0.item()
                if any(
                    not isinstance(s.state[k], torch.Tensor) or s.state[k].item() != value for s in entries
                ):
                    return None
            elif any(s.state[k] != v0 for s in entries):
                return None
            local_state[k] = v0
    for k in to_rehome:
        flats[k] = local_state[k] = _rehome(entries, k, numel)
    alias = bucket.optimizer_flat_alias()
    return _FlatSwapped(alias, grad, entries, local_state, flats)


def _flat_view(
    tensors: list[torch.Tensor], entries: list[_Swapped], numel: int, dtype: torch.dtype
) -> torch.Tensor | None:
    """One flat tensor over ``tensors`` if each sits at its parameter's offset in one storage."""
    storage = tensors[0].untyped_storage()
    start = tensors[0].storage_offset() - entries[0].fp.offset
    for t, s in zip(tensors, entries):
        if t.dtype != dtype or not t.is_contiguous() or t.storage_offset() - s.fp.offset != start:
            return None
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
    if start < 0 or (start + numel) * tensors[0].element_size() > storage.nbytes():
        return None
    return torch.empty(0, dtype=dtype, device=tensors[0].device).set_(storage, start, (numel,), (1,))


def _rehome(entries: list[_Swapped], key: Any, numel: int) -> torch.Tensor:
    """Move one DTensor state entry of a bucket's parameters into one flat buffer; the
    parameters' state becomes DTensor views of it, with the same values."""
    first = entries[0].locals[key]
    flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
    for s in entries:
        local = s.locals[key]
        view = flat[s.fp.offset : s.fp.offset + local.numel()].view(local.shape)
        view.copy_(local)
        s.state[key] = _like_param(view, s.param)  # shares the parameter's spec: cheaper checks later
        s.locals[key] = view
        if s.local_state is not None:
            s.local_state[key] = view  # drop the last reference to the old tensor now
    return flat


def _same_layout(t: DTensor, p: DTensor, local: torch.Tensor) -> bool:
    if not isinstance(t, DTensor):
        return False
    spec, pspec = t._spec, p._spec
    if spec is not pspec and (spec.placements != pspec.placements or spec.mesh != pspec.mesh):
        return False
    return t._local_tensor.shape == local.shape


# ----------------------------------------------------------------------- restoring
def _restore(optimizer: torch.optim.Optimizer, swaps: list[_GroupSwap]) -> None:
    state = optimizer.state
    for swap in swaps:
        if swap.group["params"] is swap.swapped_list:
            swap.group["params"] = swap.original
        for s in swap.entries:
            _restore_one(state, s)
        for f in swap.flats:
            _restore_flat(state, f)


def _restore_one(state: dict, s: _Swapped) -> None:
    if s.alias.grad is None and s.param.grad is not None:
        s.param.grad = None  # zero_grad(set_to_none=True) ran on the alias after a failed step
    s.alias.grad = None
    local_state = state.pop(s.alias, None)
    if s.state is None:
        if local_state:
            state[s.param] = {k: _as_param_layout(v, s) for k, v in local_state.items()}
        return
    if local_state is not None:
        for k, v in local_state.items():
            if k in s.locals:
                if v is not s.locals[k]:  # the optimizer replaced the tensor
                    orig = s.state[k]
                    s.state[k] = make_dtensor(v, orig._spec)
            else:
                s.state[k] = _as_param_layout(v, s)


def _restore_flat(state: dict, f: _FlatSwapped) -> None:
    if f.alias.grad is None:
        for p in f.params:
            p.grad = None  # zero_grad(set_to_none=True) ran on the alias after a failed step
    f.alias.grad = None
    local_state = state.pop(f.alias, None) or {}
    for k, v in local_state.items():
        flat = f.flats.get(k)
        if flat is not None:
            if v is not flat:  # the optimizer replaced the tensor: keep ours, with its values
                flat.copy_(v)
            continue
        for i, (p, fp) in enumerate(zip(f.params, f.fps)):
            st = f.states[i]
            if st is None:
                st = f.states[i] = state[p] = {}
            old = st.get(k)
            if old is v:
                continue
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # new full-size state: per-parameter views
                local = v[fp.offset : fp.offset + p._local_tensor.numel()].view(p._local_tensor.shape)
                st[k] = _like_param(local, p)
            elif isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape:
                old.copy_(v)  # the step count: every parameter keeps its own tensor
            else:
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v


def _as_param_layout(value: Any, s: _Swapped) -> Any:
    """A state tensor the step created on the alias, as the DTensor path would have made
    it: with the parameter's layout when it has the shard's shape (0-dim ones stay plain:
    a step count cannot be told from a 0-dim parameter's moment)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == s.alias.shape:
        return _like_param(value, s.param)
    return value


def _like_param(local: torch.Tensor, p: DTensor) -> DTensor:
    """``local`` as a DTensor laid out like the parameter ``p`` (its own dtype), sharing
    ``p``'s spec when the dtypes agree."""
    spec = p._spec
    if spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
        spec = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )._spec
    return make_dtensor(local, spec)
