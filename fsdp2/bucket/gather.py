"""The all-gather of one bucket's parameters.

Phase 1 (``start``) issues it: from the sharded flat buffer (cast to the compute dtype;
copied to the device first when offloaded) or, after an integer ``reshard_after_forward``,
from the kept rows (``partial``) over the smaller group; into a pooled buffer, a custom
collective's buffer, or in place (gloo's strategy, ``in_place.py``, possibly deferred
behind a reduce in the same storage). Phase 2 (``finish``) waits and copies the gathered
rows out parameter-major into the unsharded storage. Subclasses with an all-gather
extension gather through ``extension.ExtensionGather`` instead, which also carries the
other buckets of their group and mesh (``RidingGather``): one all-gather, as torch's.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from ..comm.collectives import Pending, all_gather_flat, debug_enabled, traced, wait_future, wait_pending

if TYPE_CHECKING:
    from .view import BucketView, CarrierView


class PartialTarget(NamedTuple):
    """``reshard_after_forward=factor``: after forward keep the rows of ``factor`` ranks,
    and gather the rest back in backward over those ranks only."""

    factor: int
    group: dist.ProcessGroup  # the ``factor`` consecutive shard ranks this rank belongs to
    index: int  # type: ignore[assignment]  # which block of ``factor`` ranks that is (shadows tuple.index)


class BucketGather:
    """One bucket's all-gather in flight, its buffers, and an integer reshard's kept rows."""

    rides = False  # its rows travel in another bucket's gather (``RidingGather``)

    def __init__(self, bucket: BucketView) -> None:
        self.bucket = bucket
        self._pending: Pending | None = None
        self.buf: torch.Tensor | None = None  # the output, owned until copied out
        self._pooled = True  # ``buf`` came from the pool (else from a custom collective)
        self.input: torch.Tensor | None = None  # kept alive until the gather is waited
        self._issue: torch.futures.Future | None = None  # a deferred in-place gather
        self.partial: torch.Tensor | None = None  # rows kept after forward (integer reshard)
        self.target: PartialTarget | None = None  # whose rows ``partial`` holds
        self._targets: dict[int, PartialTarget] = {}  # per factor, made once

    def partial_target(self, factor: int) -> PartialTarget | None:
        """Where ``reshard_after_forward=factor`` keeps rows on this bucket's mesh (made
        the first time, at ``fully_shard`` or ``set_reshard_after_forward``); ``None``
        where the factor is this mesh's shard size (per-parameter meshes of other sizes
        share one value): every row is freed."""
        world = self.bucket.comm.shard_size
        if world % factor:
            raise AssertionError(f"fsdp2 internal error: reshard factor {factor} does not divide {world}")
        if factor == world:
            return None
        target = self._targets.get(factor)
        if target is None:
            target = self._targets[factor] = PartialTarget(factor, *self.bucket.comm.partial_group(factor))
        return target

    def set_partial_factor(self, factor: int | None) -> None:
        """``reshard_after_forward`` changed (``None``: to a bool): its process groups are
        made now, and rows kept for another factor are dropped (the next gather reads the
        whole shards)."""
        target = None if factor is None else self.partial_target(factor)
        if target != self.target:
            self.partial, self.target = None, None

    def in_flight(self) -> bool:
        """A collective still writes the unsharded storage (or a deferred one will)."""
        ext = self.bucket.extension_gather
        return self._pending is not None or self._issue is not None or (ext is not None and ext.in_flight)

    def kept_rows(self, target: PartialTarget) -> torch.Tensor:
        """A copy of the gathered rows of ranks ``[index*W/factor, (index+1)*W/factor)``
        (``target``)."""
        b = self.bucket
        factor, _, index = target
        rows = b.comm.shard_size // factor
        keep = torch.empty(rows * b.shard_numel, dtype=b.compute_dtype, device=b.device)
        if b.shard_numel:
            torch.cat(
                [v[index * rows : (index + 1) * rows] for v in self.gathered_blocks()],
                dim=1,
                out=keep.view(rows, b.shard_numel),
            )
        return keep

    def start(self, from_partial: bool, after: torch.futures.Future | None = None) -> None:
        """Phase 1 of unshard: issue the all-gather, from the rows kept after forward if
        ``from_partial`` and they are kept (over their ranks only), else of the whole
        shards (``start_whole``)."""
        b = self.bucket
        if b.shard_numel == 0 or b.gather_is_identity:
            return
        if b.extension_gather is not None:
            b.extension_gather.start(b.comm.shard_group, b.mp_policy, b.user.all_gather)
        elif from_partial and self.target is not None and self.partial is not None:
            self._gather(self.partial, self.target.group)
        else:
            self.start_whole(after)

    def start_whole(self, after: torch.futures.Future | None) -> None:
        """The all-gather of the whole shards. In place, with ``after`` (a reduce in
        storage still in flight), it is issued only once that reduce completed and freed
        its storage, so the two never hold memory at once."""
        b = self.bucket
        source = b.sharded_flat[: b.shard_numel]
        if b.in_place is not None and b.in_place.gathers and b.user.all_gather is None:
            if after is not None and not after.done() and not debug_enabled():
                issue = functools.partial(self._start_in_place, source)
                self._issue = b.comm.local.gather_queue.issue_after(after, issue)
            else:
                self._start_in_place(source)
            return
        self._gather(self.compute_input(source), b.comm.shard_group)

    def _gather(self, source: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Gather ``source`` over ``group``: with the user's collective, or into a pooled buffer."""
        b, comm = self.bucket, self.bucket.comm
        self.input = source
        label = f"all-gather of {b.name}"
        custom = b.user.all_gather
        if custom is not None:
            numel = group.size() * source.numel()
            output = self.buf = custom.allocate((numel,), dtype=b.compute_dtype, device=source.device)
            self._pooled = False
            self._pending = Pending(custom(output, source, group, async_op=True), output, label)
            return
        self.buf = comm.pool.acquire(b.comm_numel(), b.compute_dtype, source.device)
        self._pooled = True
        output = self.buf[: comm.shard_size * b.shard_numel]
        self._pending = all_gather_flat(source, output, group, label=label)

    def compute_input(self, shards: torch.Tensor) -> torch.Tensor:
        """The all-gather input made of this bucket's ``shards``: on the device (copied
        there when offloaded), in the compute dtype."""
        b = self.bucket
        if b.offload is not None:
            shards = b.offload.to_compute(shards)
        if b.compute_dtype != b.dtype:
            with traced("fsdp2::cast_for_all_gather"):
                shards = shards.to(b.compute_dtype)
        return shards

    def _start_in_place(self, shard: torch.Tensor) -> None:
        b = self.bucket
        if b.in_place is None:
            raise AssertionError("fsdp2 internal error: expected b.in_place is not None")
        self._pending = b.in_place.start_gather(shard)

    def finish(self) -> None:
        """Phase 2 of unshard: wait, then copy the gathered shards out parameter-major
        (unless they were gathered in place)."""
        b = self.bucket
        if b.gather_is_identity:
            return
        if self._issue is not None:
            wait_future(self._issue, f"all-gather of {b.name}")
            self._issue = None
        if b.extension_gather is not None:
            b.extension_gather.finish()
            return
        b.alloc_unsharded()
        if b.shard_numel > 0:
            if self._pending is None:
                raise AssertionError("fsdp2 internal error: no all-gather issued")
            output = wait_pending(self._pending)
            self._pending = None
            self.input = None
            if self.buf is not None:
                with traced("fsdp2::copy_out"):
                    self.copy_out(output.view(b.comm.shard_size, b.shard_numel))
                if self._pooled:
                    b.comm.pool.release(self.buf)
                self.buf = None
        self.partial = None
        if b.scalars or b.offload is not None:
            self._finish_tail()

    def _finish_tail(self) -> None:
        """The replicated scalars (never gathered) into the unsharded storage; with
        offload, wait for the host copies."""
        b = self.bucket
        if b.scalars:
            start = b.comm.shard_size * b.shard_numel
            tail = b.unsharded_write[start : start + len(b.scalars)]
            if b.offload is not None:
                b.offload.copy_in(tail, b.sharded_flat[b.shard_numel :])
            else:
                tail.copy_(b.sharded_flat[b.shard_numel :])
        if b.offload is not None:
            b.offload.wait_copied_in()

    def copy_out(self, blocks: torch.Tensor) -> None:
        """Gathered blocks (``W x S``, rank-major) into the unsharded parameters: one
        ``split_with_sizes_copy`` when they all shard on dim 0, otherwise the dim-0 ones
        by region and the others by their layout."""
        b = self.bucket
        sizes = [p.shard_numel for p in b.sharded_params]
        if b.blocks_are_the_values:
            torch.split_with_sizes_copy(blocks, sizes, dim=1, out=b.regions)
            return
        for p, src, region in zip(b.sharded_params, blocks.split(sizes, dim=1), b.regions):
            if p.layout.blocks_are_the_value:
                region.copy_(src)
            else:
                p.layout.copy_blocks_out(src, b.write_views[p.bucket_index])

    def gathered_blocks(self) -> list[torch.Tensor]:
        """The gathered parameters as ``W x shard_numel`` blocks, one per sharded parameter
        (views where they shard on dim 0, copies otherwise)."""
        b = self.bucket
        blocks = []
        for p, region in zip(b.sharded_params, b.regions):
            if p.layout.blocks_are_the_value:
                blocks.append(region)
            else:
                cut = torch.empty_like(region)
                p.layout.write_blocks(cut, b.write_views[p.bucket_index], accumulate=False)
                blocks.append(cut)
        return blocks

    def drop(self) -> None:
        b = self.bucket
        if b.extension_gather is not None:
            b.extension_gather.drop()
        if self._issue is not None:
            try:
                wait_future(self._issue, f"all-gather of {b.name}")
            finally:
                self._issue = None
        if self._pending is not None:
            try:
                wait_pending(self._pending)
            finally:
                if self.buf is not None and self._pooled:
                    b.comm.pool.release(self.buf)
                self.buf = None
                self._pending = None
                self.input = None


class RidingGather(BucketGather):
    """The gather of a bucket whose rows travel in the all-gather of another bucket of
    its group and mesh, one with an all-gather extension (``carrier``): the group sends
    one collective, as torch's does. The carrier issues it and copies the rows out
    (``ExtensionGather.start`` / ``finish``); it comes first in its group, so it is
    finished by the time this one is. Such a bucket gathers whole, like its carrier (an
    integer ``reshard_after_forward`` frees it like ``True``)."""

    rides = True

    def __init__(self, bucket: BucketView, carrier: CarrierView) -> None:
        super().__init__(bucket)
        self.carrier = carrier

    def in_flight(self) -> bool:
        return self.carrier.extension_gather.in_flight or super().in_flight()

    def start(self, from_partial: bool, after: torch.futures.Future | None = None) -> None:
        return  # issued with the carrier's

    def carried_input(self) -> torch.Tensor:
        """Its rows of the carrier's all-gather (a plain bucket's: an extension bucket's
        come from its hooks, ``ExtensionGather.collect``)."""
        b = self.bucket
        return self.compute_input(b.sharded_flat[: b.shard_numel])

    def take_carried(self, gathered: torch.Tensor, col: int) -> int:
        """Its gathered blocks, columns ``col`` onwards of the carrier's ``W x bytes`` rows,
        into its unsharded storage (as ``copy_out`` does); returns the next column."""
        b = self.bucket
        b.alloc_unsharded()
        nbytes = b.shard_numel * b.compute_dtype.itemsize
        rows = gathered[:, col : col + nbytes]
        if b.blocks_are_the_values:  # byte copies: its columns need not align to its dtype
            sizes = [p.shard_numel * b.compute_dtype.itemsize for p in b.sharded_params]
            torch.split_with_sizes_copy(rows, sizes, dim=1, out=[r.view(torch.uint8) for r in b.regions])
        else:
            blocks = torch.empty(rows.shape[0], b.shard_numel, dtype=b.compute_dtype, device=rows.device)
            blocks.view(torch.uint8).copy_(rows)
            self.copy_out(blocks)
        return col + nbytes

    def finish(self) -> None:
        b = self.bucket
        if b.gather_is_identity:
            return
        carried = self.carrier.extension_gather
        if carried.in_flight:  # finished out of the group's order (a reshard): finish it now
            carried.finish()
        if b.extension_gather is None:
            b.alloc_unsharded()  # the rows are in (unless there were none)
            self.partial = None
            if b.scalars or b.offload is not None:
                self._finish_tail()
