"""Planning a fast-path optimizer step (see ``local_step``): which parameters step on
their local shards, which buckets step as one flat tensor, and reusing last step's plan."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from typing import cast

import torch
from torch.distributed.tensor import DTensor

from ._swap import _FlatSwapped, _GroupSwap, _like_param, _Swapped


# ------------------------------------------------------------------ plan reuse
def _remember_plans(optimizer: torch.optim.Optimizer, swaps: list[_GroupSwap], plans: dict[int, _GroupSwap]) -> None:
    """After a completed step: keep (in ``plans``) the plans of groups that stepped entirely flat."""
    state = optimizer.state
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
    """What a flat plan relies on: (objects compared by identity, values compared by ==):
    the flat buffer, each local shard, each state dict and its values (taken after a
    step and compared before the next, so even a float the step stored is the same
    object unless someone replaced it); its keys, and the versions of plain tensors in
    it (a step count written since: plan afresh). Built with C-level iteration: this
    runs for every bucket every step."""
    sts = [state.get(p) for p in f.params]
    present = [st for st in sts if st is not None]
    vals = list(itertools.chain.from_iterable(st.values() for st in present))
    objects = [f.bucket.sharded_flat, *[p._local_tensor for p in f.params], *sts, *vals]
    values = list(itertools.chain.from_iterable(present))
    values += [v._version for v in vals if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)]
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
        locals_: dict[str, torch.Tensor] = {}
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
    if bucket is None:  # a managed parameter's bucket made it (``FlatBucket.__init__``)
        raise AssertionError("fsdp2 internal error: a flat step over a parameter in no bucket")
    if len(entries) != len(bucket.params) or bucket.scalars or len(entries) < 2:
        return None
    entries.sort(key=lambda s: s.fp.offset)
    numel = bucket.shard_numel
    flat_param = bucket.sharded_flat
    if flat_param.numel() != numel:
        return None
    base, size = flat_param.data_ptr(), flat_param.element_size()
    stateless = entries[0].state is None  # plain SGD
    for s in entries:
        local = s.param._local_tensor  # still over its rows of the flat buffer (a storage slice)
        if (
            s.grad is None
            or (s.state is None) != stateless
            or not local.is_contiguous()
            or (local.numel() > 0 and local.data_ptr() != base + s.fp.offset * size)
        ):
            return None
    grad = _flat_view(cast("list[torch.Tensor]", [s.grad for s in entries]), entries, numel, flat_param.dtype)
    if grad is None:
        return None
    first = entries[0].state or {}
    keys = list(first)
    for s in entries[1:] if not stateless else ():
        st = cast(dict, s.state)  # not stateless: every entry has state (checked above)
        if len(st) != len(keys) or any(k not in st for k in keys):
            return None
    local_state: dict[str, object] = {}
    flats: dict[str, torch.Tensor] = {}
    to_rehome = []
    for k in keys:
        if k in entries[0].locals:
            found = [s.locals.get(k) for s in entries]
            if any(v is None for v in found):
                return None
            values = cast("list[torch.Tensor]", found)
            if any(v.dtype != values[0].dtype for v in values):
                return None
            view = _flat_view(values, entries, numel, values[0].dtype)
            del values, found  # no reference of ours may outlive a move into a flat buffer
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
                    not isinstance(cast(dict, s.state)[k], torch.Tensor) or cast(dict, s.state)[k].item() != value
                    for s in entries
                ):
                    return None
            elif any(cast(dict, s.state)[k] != v0 for s in entries):
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


def _rehome(entries: list[_Swapped], key: str, numel: int) -> torch.Tensor:
    """Move one DTensor state entry of a bucket's parameters into one flat buffer; the
    parameters' state becomes DTensor views of it, with the same values."""
    first = entries[0].locals[key]
    flat = torch.zeros(numel, dtype=first.dtype, device=first.device)
    for s in entries:
        local = s.locals[key]
        view = flat[s.fp.offset : s.fp.offset + local.numel()].view(local.shape)
        view.copy_(local)
        cast(dict, s.state)[key] = _like_param(view, s.param)  # shares the parameter's spec: cheaper checks later
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

