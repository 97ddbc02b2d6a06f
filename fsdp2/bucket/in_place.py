"""gloo's in-place strategy for large buckets: gather and reduce in the unsharded storage.

Chosen once per bucket (``InPlace.applies``): gloo on CPU, a floating compute dtype,
every parameter sharded on dim 0 (so each rank's block is a contiguous piece of the
unsharded parameters), at least ``IN_PLACE_MIN_BYTES`` and ``IN_PLACE_MIN_WORLD``
ranks. Then there is no all-gather output and, usually, no reduce input:

* the all-gather is an all-reduce of the unsharded flat itself, where each rank wrote
  its own rows and -0.0 everywhere else (no pooled buffer, no copy-out, and none of
  the full-size temporary that gloo's own all-gather allocates and copies from); it
  moves twice the bytes, which on 2 ranks made it slower than gloo's all-gather at
  every size (tools/bench_collectives.py), and the 2-rank wide benchmark ran 3-5%
  slower in place, so 2 ranks keep the pooled path;
* once a backward no longer reads the parameters, their gradients are written where
  the parameters were (``W*S + R``), followed by the "used" flags, and summed by one
  all-reduce of that storage (``lend``); as soon as it completes (on gloo's thread)
  this rank's rows are copied out and the storage is freed. Buckets with frozen
  parameters, a ``reduce_dtype`` other than the compute dtype, HSDP, or gradients
  accumulated without synchronization keep using a pooled reduce input.

The GPU path never builds one of these.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..comm.collectives import (
    Pending,
    all_gather_in_place,
    all_reduce_in_place,
    then,
    traced,
    wait_future,
)
from ..params.param import FSDPParam
from .reduce import BucketReduce, Staged, stage, write
from .reduce_layout import ReduceLayout

if TYPE_CHECKING:
    from .view import BucketView, ReduceView

# Buckets of at least this many bytes, on at least this many ranks, gather and reduce
# in place on gloo; smaller ones are latency-bound and 2 ranks run faster pooled
# (gloo's all-gather is quicker there: tools/bench_collectives.py). Read when a bucket is
# built (tests lower them: ``tests/_models.force_in_place``). ``GATHER_IN_PLACE`` False
# keeps the pooled all-gather with the in-place reduce (tests).
IN_PLACE_MIN_BYTES = 1 << 20
IN_PLACE_MIN_WORLD = 3
GATHER_IN_PLACE = True


class InPlace:
    """The in-place gather and reduce of one bucket."""

    @staticmethod
    def applies(bucket: BucketView) -> bool:
        world = bucket.comm.shard_size
        return (
            world > 1
            and not bucket.extension  # gathered through the subclass's own hooks
            and bucket.quant.gather is None and bucket.quant.reduce is None  # quantized rows travel instead
            and world >= IN_PLACE_MIN_WORLD
            and bucket.sharded_flat.device.type == "cpu"  # the copy-out runs on gloo's thread
            and bucket.offload is None
            and bucket.compute_dtype.is_floating_point
            and bucket.blocks_are_the_values
            and world * bucket.shard_numel * bucket.compute_dtype.itemsize >= IN_PLACE_MIN_BYTES
        )

    def __init__(self, bucket: BucketView) -> None:
        self.bucket = bucket
        self.gathers = GATHER_IN_PLACE
        self.gather_group = bucket.comm.local.gather_group(bucket.comm.shard_group) if self.gathers else None
        # The reduce of this backward sums the gradients inside the unsharded storage
        # (``lend``): it stays allocated until the reduce completes.
        self.lent = False
        # That reduce's staged gradients, taken out as soon as it completes (``then``).
        self.staged: torch.futures.Future | None = None

    def own_rows(self) -> list[torch.Tensor]:
        """Where this rank's block of each sharded parameter sits in the unsharded storage."""
        rank = self.bucket.comm.shard_rank
        return [region[rank] for region in self.bucket.regions]

    # -------------------------------------------------------------------- gather
    def start_gather(self, shard: torch.Tensor) -> Pending:
        """Write this rank's rows into the unsharded storage, -0.0 everywhere else, and
        sum over ranks: the storage then holds every rank's rows, parameter-major."""
        b = self.bucket
        if self.lent:
            raise AssertionError(f"fsdp2 internal error: {b.name} gathers into storage a reduce uses")
        b.alloc_unsharded()
        region = b.unsharded_write[: b.comm.shard_size * b.shard_numel]
        with traced("fsdp2::copy_in"):
            region.fill_(-0.0)
            if b.compute_dtype != b.dtype:
                shard = shard.to(b.compute_dtype)
            sizes = [p.shard_numel for p in b.sharded_params]
            torch.split_with_sizes_copy(shard, sizes, out=self.own_rows())
        if self.gather_group is None:
            raise AssertionError("fsdp2 internal error: expected self.gather_group is not None")
        return all_gather_in_place(region, self.gather_group, b.comm.local.gather_queue, label=f"all-gather of {b.name}")

    # -------------------------------------------------------------------- reduce
    def lend(self, reduce: BucketReduce) -> None:
        """Called once nothing reads the unsharded parameters any more (before the
        gradients are deposited, and again before the reduce is issued): when every
        parameter is reduced, the reduce dtype is the compute dtype and there are no
        replicas, the gradients go into the parameters' own places in the unsharded
        storage and are summed there (gradients already in a pooled buffer are moved
        over); the storage is freed once the reduce completed. Idempotent."""
        b = self.bucket
        if self.lent:
            return
        # Only conditions every rank agrees on: which gradients a rank deposited so far
        # depends on its data, and all ranks must issue the same reduce.
        if b.comm.is_hsdp or b.reduce_dtype != b.compute_dtype or not reduce.is_complete() or self.staged is not None:
            return
        b.alloc_unsharded()  # a group freed early (the root) gets it back here
        self.lent = True
        if reduce.has_pooled_input():  # gradients accumulated in a pooled buffer: move them
            layout, buf = reduce.layout(), reduce.input2d()
            for p, off, rows in zip(layout.params, layout.offsets, b.regions):
                if reduce.deposited[p.rs_index]:
                    rows.copy_(buf[:, off : off + p.shard_numel])
            for i, p in enumerate(layout.scalars):
                if reduce.deposited[p.rs_index]:
                    b.write_views[p.bucket_index].copy_(buf[0, layout.scalar_base + i])
            reduce.release_buffers()

    def deposit(self, p: FSDPParam, grad: torch.Tensor, first: bool) -> None:
        write(self.bucket.write_views[p.bucket_index], grad, first)

    def start_reduce(self, reduce: ReduceView) -> Pending:
        """The storage holds each gradient where its parameter was (every rank's rows),
        then the replicated scalars' gradients, then one flag per parameter: one in-place
        all-reduce sums it all, and each rank reads its own rows."""
        b, deposited = self.bucket, reduce.deposited
        world_numel = b.comm.shard_size * b.shard_numel
        with traced("fsdp2::reduce_prepare"):
            for p, rows in zip(b.sharded_params, b.regions):
                if not deposited[p.rs_index]:
                    rows.zero_()
            for p in b.scalars:
                if not deposited[p.rs_index]:
                    b.write_views[p.bucket_index].zero_()
            flags_at = world_numel + len(b.scalars)
            flags = b.unsharded_write[flags_at : flags_at + len(deposited)]
            flags.copy_(torch.tensor(reduce.used_flags(), dtype=flags.dtype))
        pending = all_reduce_in_place(
            b.unsharded_write[: flags_at + len(deposited)], b.comm.shard_group, label=f"reduce-scatter of {b.name}"
        )
        # Take this rank's rows out and free the storage the moment the sum is done,
        # not when the next group's gradients need room: by then they are all resident.
        self.staged = then(pending, functools.partial(self._stage, reduce.layout(), reduce.divide_factor))
        return pending

    def _stage(self, layout: ReduceLayout, divide_factor: float) -> Staged:
        """The reduce completed: copy out this rank's rows of every parameter (laid out
        like its shards), the flags and the scalars, then free the storage. Runs on
        gloo's thread; nothing else touches this bucket's storage meanwhile (an unshard
        first waits for it: ``ParamGroup.unshard``)."""
        b = self.bucket
        world_numel = b.comm.shard_size * b.shard_numel
        flags_at = world_numel + len(b.scalars)
        with traced("fsdp2::grad_copy"):
            rows = self.own_rows()
            grads = torch.cat(rows) if rows else b.unsharded_write[:0].clone()
            n_flags = len(layout.params) + len(layout.scalars)
            used = b.unsharded_write[flags_at : flags_at + n_flags].clone()
            scalar_vals = b.unsharded_write[world_numel:flags_at].to(b.grad_dtype, copy=True)
            staged = stage(layout, grads.to(b.grad_dtype), used, scalar_vals, divide_factor)
        if not b.user.keep_unsharded_storage:  # ``set_keep_unsharded_storage``: it stays
            b.unsharded_flat.untyped_storage().resize_(0)
        self.lent = False  # only now: an unshard may take the storage again
        return staged

    def finish_reduce(self, label: str, discard: bool = False) -> Staged | None:
        """Wait for the reduce in storage; its staged gradients (None with ``discard``,
        after an exception: the storage is ours again either way)."""
        staged, self.staged = self.staged, None
        if staged is None:
            raise AssertionError("fsdp2 internal error: no reduce in storage issued")
        try:
            result = wait_future(staged, label)
        finally:
            if discard and self.lent:
                self.lent = False
                self.bucket.free_unsharded()
        return None if discard else result

    def in_flight(self) -> torch.futures.Future | None:
        """The reduce still running (done once its storage is free)."""
        staged = self.staged
        return staged if staged is not None and not staged.done() else None
