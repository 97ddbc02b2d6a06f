"""``fsdp2.full_weights``: a model's full weights, one group at a time, one all-gather
per bucket (``gather.py``), for an inference engine or a checkpoint writer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .._module import groups_under
from ..params.param import FSDPParam
from ..runtime.group import TrainingState
from .gather import GroupOut, finish_group, start_group


def full_weights(
    model: nn.Module, *, dtype: torch.dtype | None = None, rank0_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each of ``model``'s parameters and persistent buffers,
    full (unsharded), under the names of ``model.state_dict()``; a tied parameter once,
    under its first name.

    The parameters of each ``fully_shard`` group come out together, in one all-gather
    per bucket of the group (plus one per tensor-parallel or expert mesh dimension the
    group's parameters are sharded on), cast to ``dtype`` before the gather (half the
    bytes of float32 masters in bf16); the next group's gather runs while this one's
    tensors are handed out, so fsdp2 holds at most two groups at full size (and what the
    caller keeps). Values are those of ``p.full_tensor().to(dtype)``, bit for bit, read
    from the sharded parameters (also while a module is unsharded); quantized
    communication does not apply here. Floating-point tensors are cast, others not.

    Every rank must iterate to the end (the gathers are collectives); with
    ``rank0_only=True`` only global rank 0 gets the tensors, the others' loops run no
    body. Each tensor is fresh (no other reference to it), on the mesh's device.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"full_weights(dtype=...) takes a floating-point torch.dtype or None, got {dtype!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"full_weights(model) takes an nn.Module, got {type(model).__name__}")
    groups = groups_under(model)
    busy = [g.name for g in groups if g.training_state is not TrainingState.IDLE]
    if busy:
        raise RuntimeError(
            f"full_weights(model) was called inside a forward or backward (groups {busy} are running); "
            "export the weights between steps, after the backward (and finalize_backward) returned"
        )
    return _export(model, dtype, rank0_only and dist.is_initialized() and dist.get_rank() != 0)


def _slots(model: nn.Module) -> tuple[list[Any], dict[int, list[tuple[str, FSDPParam]]]]:
    """What to export, in ``state_dict()`` order and under its names (activation
    checkpoint wrappers' prefixes and all): a group (at its first parameter) or
    ``(name, tensor)``; and each group's ``(name, FSDPParam)`` pairs, a tied parameter once."""
    owners: dict[int, FSDPParam] = {}
    for g in groups_under(model):
        for owned in g.params:
            for t in (owned.sharded, owned.unsharded, getattr(owned.sharded, "_local_tensor", None)):
                if t is not None:
                    owners[id(t)] = owned
    slots: list[Any] = []
    named: dict[int, list[tuple[str, FSDPParam]]] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        fp = owners.get(id(t)) or owners.get(id(getattr(t, "_local_tensor", None)))
        if id(fp if fp is not None else t) in seen:
            continue  # tied: once, under its first name
        seen.add(id(fp if fp is not None else t))
        group = fp.group() if fp is not None else None
        if group is None or fp is None:  # (a group only through its parameter)
            slots.append((name, t))
            continue
        if id(group) not in named:
            named[id(group)] = []
            slots.append(group)
        named[id(group)].append((name, fp))
    return slots, named


def _export(model: nn.Module, dtype: torch.dtype | None, silent: bool) -> Iterator[tuple[str, torch.Tensor]]:
    slots, named = _slots(model)
    groups = [s for s in slots if not isinstance(s, tuple)]
    ahead: dict[int, GroupOut] = {}

    def start(i: int) -> None:
        if i < len(groups):
            ahead[i] = start_group(groups[i].buckets, dtype)

    start(0)
    index = 0
    for slot in slots:
        if isinstance(slot, tuple):
            name, t = slot
            value = _plain(t, dtype)
            if not silent:
                yield name, value
            continue
        current = ahead.pop(index)
        start(index + 1)  # the next group's gather runs while this one is handed out
        index += 1
        with torch.no_grad():
            finish_group(current, dtype)
        for name, fp in named[id(slot)]:
            if fp.dispatched:  # a subclass sharded by its own ops: DTensor's gather, on every rank
                value = _plain(cast(DTensor, fp.sharded), dtype)  # sharded since fully_shard
            elif silent:
                continue  # nothing to cut out on a rank that yields nothing
            else:
                value = cast(torch.Tensor, current.take(fp, dtype))  # gathered: not dispatched
            if not silent:
                yield name, value
            del value
        del current


def _plain(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor fsdp2 does not shard, full and cast (a copy)."""
    with torch.no_grad():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            return t.to(dtype, copy=True)
        return t.clone()
