"""What fsdp2 holds for a model, by device and category, and giving back what it can
rebuild (``fsdp2.held_bytes``, ``fsdp2.release_memory``): between the phases of a
reinforcement-learning loop, while an inference engine wants the device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._module import groups_under
from ..bucket.deposit import ReduceState
from ..comm.rank import this_rank
from ..runtime.group_setup import TrainingState
from .tracker import _claim_group, _key

POOLED = "pooled buffers"  # this rank's idle communication buffers, shared by its models


def held_bytes(model: nn.Module, device: torch.device | str | None = None) -> dict[str, int]:
    """Bytes fsdp2 holds for ``model`` on ``device`` (every device when None), by
    category: the sharded parameters, their gradients, the unsharded parameters (storage
    left gathered, kept or pending), communication buffers, gradients waiting to be
    reduced, and this rank's idle pooled buffers (``"pooled buffers"``, shared by every
    model of the rank). Each storage is counted once, under its first category."""
    want = None if device is None else torch.device(device)
    seen: dict[int, str] = {}
    out: dict[str, int] = {}

    def claim(t: Any, category: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        found = _key(t, meta=True)
        if found is None or found[0] in seen:
            return
        key, storage = found
        if want is not None and not _same_device(storage.device, want):
            return
        seen[key] = category
        out[category] = out.get(category, 0) + storage.nbytes()

    for group in groups_under(model):
        for p in group.params:
            if p.sharded is not None:
                claim(p.sharded.grad, "gradients")
        _claim_group(group, claim)
    for dev, pool in this_rank()._pools.items():
        if want is None or _same_device(dev, want):
            for raw in (r for free in pool._free.values() for r in free):
                claim(raw, POOLED)
    return {k: v for k, v in out.items() if v}


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def release_memory(model: nn.Module) -> None:
    """Give back what fsdp2 can rebuild for ``model``: reshard its groups, free the
    unsharded storage (also storage kept by ``set_keep_unsharded_storage``, made anew
    at the next gather, at new addresses), and drop this rank's idle pooled buffers on
    the model's devices. The sharded parameters, gradients and optimizer state stay;
    ``model.cpu()`` moves those, and releases the same.

    Between steps only: raises, before anything changes, inside a forward or backward
    and while gradients wait to be reduced (a backward without gradient sync, or one
    whose ``finalize_backward`` has not run)."""
    groups = groups_under(model)
    for group in groups:
        if group.training_state is not TrainingState.IDLE or (group.ctx is not None and group.ctx.in_backward):
            raise RuntimeError(
                f"release_memory(model): {group.name} is inside a forward or backward; call it between steps"
            )
        if group.finalize_pending or any(_reduce_pending(b) for b in group.buckets):
            raise RuntimeError(
                f"release_memory(model): {group.name} still has gradients waiting to be reduced (a backward "
                "without gradient sync, or finalize_backward not called yet); finish the accumulation with "
                "a synchronized backward, or zero the gradients, before releasing"
            )
    devices = set()
    for group in groups:
        group.reshard()
        for b in group.buckets:
            devices.add(b.device)
            b.free_unsharded(even_kept=True)
            b.kept.clear()
    for dev in devices:
        pool = this_rank()._pools.get(dev)
        if pool is not None:
            pool.drop_idle()


def _reduce_pending(b: Any) -> bool:
    r = b.reduce
    if r.state is not ReduceState.IDLE or r.ready or r._unreplicated is not None:
        return True
    return any(p.unsharded is not None and p.unsharded.grad is not None for p in b.params)
