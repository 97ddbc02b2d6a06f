"""Reduced gradients into ``.grad``, at the end of a backward that completed.

Commits accumulate into existing gradients (gradient accumulation) and keep ``.grad``
a DTensor laid out like the parameter. When one commit gives every parameter of a
bucket a fresh gradient laid out like the shards, the flat tensor behind them is
remembered (weakly), so the optimizer can step the bucket as one tensor while each
``.grad`` is still one of those (``fsdp2.optim.local_step``). A reduce that carries
other buckets' parameters (``BucketReduce.carry``) commits theirs too, and remembers
for each of those buckets its stretch of the flat tensor.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from ..params.param import FSDPParam

if TYPE_CHECKING:
    from .view import BucketView


class GradCommit:
    def __init__(self, bucket: BucketView) -> None:
        self.bucket = bucket
        # Weak: ``zero_grad(set_to_none=True)`` frees them. (flat tensor, the bucket's
        # stretch of it as (start, numel) or None for all of it, the gradient DTensors
        # over it in ``params`` order)
        self._committed: tuple[weakref.ref, tuple[int, int] | None, list[weakref.ref]] | None = None

    def commit(self) -> list[FSDPParam]:
        """Accumulate the staged gradients into ``.grad``. Runs at the end of a backward
        that completed, so a backward that raised leaves ``.grad`` as it was. Returns the
        parameters given a gradient (their post-accumulate hooks run after every commit)."""
        b, ready = self.bucket, self.bucket.reduce.ready
        if b.offload is not None:
            b.offload.wait_host()  # the gradients' device -> host copies landed
        riders = b.reduce.riders
        flat = None
        if riders:
            fresh = self._fresh_stretches(ready, [b, *(r.bucket for r in riders)])
        elif len(ready) == 1 and self.all_grads_none():
            layout, grads = ready[0][:2]
            if len(layout.params) == len(b.params):  # every parameter, at its shard offset
                flat = grads
        given: list[FSDPParam] = []
        for layout, grads, used_flags, scalar_vals in ready:
            # Flags follow layout.params, then layout.scalars; a dry run on the meta device
            # (the planner's) has no values: every parameter counts as used.
            used = used_flags.tolist() if used_flags.device.type != "meta" else [1] * used_flags.numel()
            for flag, p, off in zip(used, layout.params, layout.offsets):
                if flag > 0:
                    _accumulate_grad(p, grads[off : off + p.layout.local_numel].view(p.local_shape))
                    given.append(p)
            for flag, p, value in zip(used[len(layout.params) :], layout.scalars, scalar_vals):
                if flag > 0:
                    _accumulate_grad(p, value.view(()))
                    given.append(p)
        if riders:
            for bucket, start in fresh:
                bucket.commit.remember(ready[0][1], (start, bucket.shard_numel))
        ready.clear()
        if flat is not None:
            self.remember(flat)
        return given

    def _fresh_stretches(self, ready: list, buckets: list[BucketView]) -> list[tuple[BucketView, int]]:
        """With riders: the buckets whose parameters all get a fresh gradient laid out like
        their shards, with where their stretch of the flat gradient starts. The layout
        lists the buckets one after the other, each in its own order, so a bucket that
        has every parameter there (no scalar, none frozen) sits at its own offsets from
        its first parameter's column."""
        if len(ready) != 1:
            return []
        layout = ready[0][0]
        column = dict(zip(map(id, layout.params), layout.offsets))
        return [
            (bucket, column[id(bucket.params[0])])
            for bucket in buckets
            if not bucket.scalars
            and all(id(p) in column for p in bucket.params)
            and bucket.commit.all_grads_none()
        ]

    def commit_direct(self, divide_factor: float, backward_ran: bool) -> list[FSDPParam]:
        """Direct mode: move the leaves' accumulated gradients into ``.grad``. When every
        parameter got one and none had one yet, they go into one flat tensor laid out like
        the shards, so the optimizer can step the bucket as one tensor. With the reduce's
        ``zero_unused``, trainable parameters the group's backward gave no gradient get
        zeros, as a reduce would give them."""
        params = self.bucket.params
        if backward_ran and self.bucket.user.zero_unused:
            for p in params:
                leaf = p.unsharded
                if leaf is not None and leaf.requires_grad and not p.has_unsharded_grad:
                    leaf.grad = torch.zeros_like(leaf)
        has_grads = [p.unsharded.grad is not None for p in params]  # type: ignore[union-attr]
        if len(params) > 1 and not self.bucket.scalars and all(has_grads) and self.all_grads_none():
            # Local tensors: a tensor-parallel leaf's gradient is a TP DTensor.
            grads = [p.take_unsharded_grad() for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
            if divide_factor != 1:
                flat.div_(divide_factor)
            for p in params:
                local = flat[p.offset : p.offset + p.shard_numel].view(p.local_shape)
                p.sharded.grad = p.grad_dtensor(local)  # type: ignore[union-attr]
            self.remember(flat)
            return list(params)
        given = []
        for p in params:
            grad = p.take_unsharded_grad()
            if grad is not None:
                if divide_factor != 1:
                    grad.div_(divide_factor)
                _accumulate_grad(p, grad)
                given.append(p)
        return given

    def flat_grad(self) -> torch.Tensor | None:
        """The flat gradient of the last fresh commit while every parameter's ``.grad`` is
        still the DTensor made over it (accumulating into them keeps it valid)."""
        committed = self._committed
        if committed is None:
            return None
        for p, ref in zip(self.bucket.params, committed[2]):
            if p.sharded.grad is not ref() or ref() is None:  # type: ignore[union-attr]
                return None
        flat, span = committed[0](), committed[1]
        if flat is None or span is None:
            return flat
        return flat[span[0] : span[0] + span[1]]  # a view each time: one kept would keep the flat alive

    def all_grads_none(self) -> bool:
        return all(p.sharded.grad is None for p in self.bucket.params)  # type: ignore[union-attr]

    def remember(self, flat: torch.Tensor, span: tuple[int, int] | None = None) -> None:
        """The bucket's gradients were just made over ``flat`` (or its stretch ``span``,
        as (start, numel)), at their shard offsets."""
        grads = [p.sharded.grad for p in self.bucket.params]  # type: ignore[union-attr]
        self._committed = None
        if all(g is not None for g in grads):
            self._committed = (weakref.ref(flat), span, [weakref.ref(g) for g in grads])


def _accumulate_grad(p: FSDPParam, local: torch.Tensor) -> None:
    param = p.sharded
    if param is None:
        raise AssertionError("fsdp2 internal error: expected param is not None")
    if param.grad is None:
        param.grad = p.grad_dtensor(local)
    else:
        existing = param.grad
        (existing.to_local() if isinstance(existing, DTensor) else existing).add_(local)


def run_post_accumulate_hooks(params: list[FSDPParam]) -> None:
    """The hooks registered with ``register_post_accumulate_grad_hook`` on the sharded
    parameters: autograd never accumulates into those (it accumulates into the unsharded
    ones), so they run here, once the reduced gradient is in ``.grad`` (as torch's
    ``fully_shard`` runs them after its reduce-scatter), after every group committed and
    resharded (a hook that raises leaves no group half done). A hook may step an optimizer and
    clear ``.grad`` (optimizer in backward); the bucket's flat gradient is remembered
    before, and ``flat_grad`` notices a ``.grad`` that changed."""
    for p in params:
        hooks = getattr(p.sharded, "_post_accumulate_grad_hooks", None)
        for hook in list((hooks or {}).values()):
            hook(p.sharded)
