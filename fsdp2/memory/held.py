"""What fsdp2 holds for a model, by device and category, and giving back what it can
rebuild (``fsdp2.held_bytes``, ``fsdp2.release_memory``): between the phases of a
reinforcement-learning loop, while an inference engine wants the device."""

from __future__ import annotations

import torch
from torch import nn

from .._module import groups_under
from ..bucket.bucket import FlatBucket, comm_pools
from ..runtime.group import TrainingState
from .tracker import claim_group, storage_data_ptr, storage_key

POOLED = "pooled buffers"  # this rank's idle communication buffers, shared by its models


def held_bytes(model: nn.Module, device: torch.device | str | None = None) -> dict[str, int]:
    """Bytes fsdp2 holds for ``model`` on ``device`` (every device when None), by
    category: the sharded parameters, their gradients, the unsharded parameters (storage
    left gathered, kept or pending), communication buffers, gradients waiting to be
    reduced, and this rank's idle pooled buffers (``"pooled buffers"``, shared by every
    model of the rank). Memory is counted once, under the first category that claims it
    (a shard's storage is a slice of its bucket's flat buffer: counted with the buffer)."""
    want = None if device is None else torch.device(device)
    found: dict[int, tuple[torch.UntypedStorage, str]] = {}

    def claim(t: object, category: str) -> None:
        if isinstance(t, torch.Tensor):
            key = storage_key(t, meta=True)
            if key is not None and key[0] not in found and (want is None or _same_device(key[1].device, want)):
                found[key[0]] = (key[1], category)

    groups = groups_under(model)
    for group in groups:
        for p in group.params:
            if p.sharded is not None:
                claim(p.sharded.grad, "gradients")
        claim_group(group, claim)
    for pool in comm_pools([b for g in groups for b in g.buckets]):
        for raw in pool.idle_buffers():
            claim(raw, POOLED)
    out: dict[str, int] = {}
    for storage, category in _outermost(list(found.values())):
        out[category] = out.get(category, 0) + storage.nbytes()
    return {k: v for k, v in out.items() if v}


def _outermost(claimed: list[tuple[torch.UntypedStorage, str]]) -> list[tuple[torch.UntypedStorage, str]]:
    """The storages not inside another one's memory: a slice goes with its base, under
    the base's category (storages nest or are disjoint)."""
    spans = sorted((storage_data_ptr(s), -s.nbytes(), i) for i, (s, _) in enumerate(claimed))
    inside, reach = set(), 0
    for start, neg, i in spans:
        if start and start < reach and start - neg <= reach:
            inside.add(i)
        elif start:
            reach = start - neg
    return [c for i, c in enumerate(claimed) if i not in inside]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def release_memory(model: nn.Module) -> None:
    """Give back what fsdp2 can rebuild for ``model``: reshard its groups, free the
    unsharded storage (also storage kept by ``set_keep_unsharded_storage``, made anew
    at the next gather, at new addresses), and drop the idle buffers of the pools its
    groups communicate from (shared by the rank's models: another model allocates again).
    The sharded parameters, gradients and optimizer state stay.

    Between steps only: raises, before anything changes, inside a forward or backward
    and while gradients wait to be reduced (a backward without gradient sync, or one
    whose ``finalize_backward`` has not run)."""
    groups = groups_under(model)
    for group in groups:
        ctx = group.ctx
        if group.training_state is not TrainingState.IDLE or (
            ctx is not None and (ctx.in_backward or ctx.active_forwards)
        ):
            raise RuntimeError(
                f"release_memory(model): {group.name} is inside a forward or backward; call it between steps"
            )
        if group.finalize_pending or any(_reduce_pending(b) for b in group.buckets):
            raise RuntimeError(
                f"release_memory(model): {group.name} still has gradients waiting to be reduced (a backward "
                "without gradient sync, or finalize_backward not called yet); finish the accumulation with "
                "a synchronized backward, or zero the gradients, before releasing"
            )
    for group in groups:
        group.reshard()
        for b in group.buckets:
            b.free_unsharded(even_kept=True)
            b.kept.clear()
    for pool in comm_pools([b for g in groups for b in g.buckets]):
        pool.drop_idle()


def _reduce_pending(b: FlatBucket) -> bool:
    return b.reduce.is_pending() or any(p.unsharded is not None and p.unsharded.grad is not None for p in b.params)
