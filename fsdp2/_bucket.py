"""The parameters of one group that share a dtype: one all-gather, one reduce-scatter.

Layouts (``W`` ranks, ``S`` = sum of the padded shard sizes):

* sharded flat (``S + R`` elements, the parameters' dtype): each parameter's shard
  at its ``offset``, then the ``R`` replicated scalars. It is the storage of the
  sharded DTensors, so the optimizer updates it in place and the all-gather reads it
  directly (a single cast when ``param_dtype`` differs).
* all-gather output (``W x S``, rank-major): rank ``r``'s sharded flat in row ``r``.
* unsharded flat (``W*S + R``, compute dtype): parameter-major, each parameter's
  ``W * chunk_rows`` rows contiguous, so its unsharded value is a plain view.
  Filled from the all-gather output by one ``split_with_sizes_copy``; its storage is
  resized to 0 on reshard and back on unshard, so tensors autograd saved in forward
  see the re-gathered values in backward.
* reduce input (``W x N``, reduce dtype): the gradients that require grad in the
  same column layout, then one "used" flag per reduced parameter, then the gradients
  of replicated scalars. Summed over ranks, row ``r`` is rank ``r``'s result; a flag
  above zero means some rank produced a gradient, so unused parameters keep
  ``grad=None`` exactly as in local training, and every rank reduces the same bytes.

In place (``in_place``: gloo on CPU, floating compute dtype, at least
``IN_PLACE_MIN_BYTES`` and ``IN_PLACE_MIN_WORLD`` ranks) there is no all-gather output
and, usually, no reduce input:

* the all-gather is an all-reduce of the unsharded flat itself, where each rank wrote
  its own rows and -0.0 everywhere else (no pooled buffer, no copy-out, and none of
  the full-size temporary that gloo's own all-gather allocates and copies from); it
  moves twice the bytes, which on 2 ranks made it slower than gloo's all-gather at
  every size (tools/bench_collectives.py), and the 2-rank wide benchmark ran 3-5%
  slower in place, so 2 ranks keep the pooled path;
* once a backward no longer reads the parameters, their gradients are written where
  the parameters were (``W*S + R``), followed by the "used" flags, and summed by one
  all-reduce of that storage; as soon as it completes (on gloo's thread) this rank's
  rows are copied out and the storage is freed. Buckets with frozen parameters, a
  ``reduce_dtype`` other than the compute dtype, or gradients accumulated without
  synchronization keep using a pooled reduce input.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from ._buffers import BufferPool
from ._collectives import (
    Pending,
    all_gather_flat,
    all_gather_in_place,
    all_reduce_in_place,
    debug_enabled,
    gather_group,
    issue_after,
    reduce_scatter_flat,
    then,
    traced,
    wait_future,
    wait_pending,
)
from ._mesh import MeshInfo
from ._param import FSDPParam

# Buckets of at least this many bytes, on at least this many ranks, gather and reduce
# in place on gloo (``FlatBucket.in_place``); smaller ones are latency-bound and 2 ranks
# run faster pooled (gloo's all-gather is quicker there). Read when a bucket is built;
# the environment variables are for tuning and tests. ``GATHER_IN_PLACE`` False keeps
# the pooled all-gather with the in-place reduce (tests).
IN_PLACE_MIN_BYTES = int(os.environ.get("FSDP2_IN_PLACE_MIN_BYTES", str(1 << 20)))
IN_PLACE_MIN_WORLD = int(os.environ.get("FSDP2_IN_PLACE_MIN_WORLD", "3"))
GATHER_IN_PLACE = True


class ReduceLayout(NamedTuple):
    params: list[FSDPParam]  # reduced parameters that shard, in column order
    scalars: list[FSDPParam]  # reduced replicated scalars
    offsets: list[int]  # column offset of each entry of ``params``
    grad_numel: int  # columns holding sharded gradients
    numel: int  # columns per rank in all: gradients, flags, scalars
    # This rank's padding columns (rows past a parameter's end): never written by a
    # deposit, zeroed in the result so a flat optimizer step keeps the padding at zero.
    padding: list[tuple[int, int]]


class FlatBucket:
    """Storage and collectives of the same-dtype parameters of one group."""

    def __init__(
        self,
        params: list[FSDPParam],
        originals: list[torch.Tensor],
        comm: MeshInfo,
        device: torch.device,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
    ) -> None:
        self.params = params
        for i, p in enumerate(params):
            p.bucket_index = i
            p.bucket = self
        self.comm = comm
        self.dtype = params[0].dtype
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.name = f"group [{self.dtype}]"  # for messages; the group renames it at lazy init
        self.sharded_params = [p for p in params if not p.is_replicated]
        self.scalars = [p for p in params if p.is_replicated]
        offset = 0
        for p in self.sharded_params:
            p.offset = offset
            offset += p.shard_numel
        for i, p in enumerate(self.scalars):
            p.offset = offset + i
        self.shard_numel = offset  # S
        self._pending_gather: Pending | None = None
        self._gather_buf: torch.Tensor | None = None  # pooled, owned until copied out
        self._gather_input: torch.Tensor | None = None  # kept alive until the gather is waited
        self._gather_issue: torch.futures.Future | None = None  # a deferred in-place gather
        self._partial: torch.Tensor | None = None  # post-forward partial reshard (int)
        self._pending_reduce: Pending | None = None
        self._reduce_input: torch.Tensor | None = None  # pooled, owned until reduced
        self._reduce_scratch: torch.Tensor | None = None  # pooled, the all-to-all's receive buffer
        self._deposited: list[bool] = []
        # reduced, not yet in .grad: (layout, gradients, used flags, replicated values)
        self._ready_grads: list[tuple[ReduceLayout, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._layout: ReduceLayout | None = None
        self._layout_key: tuple[bool, ...] = ()
        self._flat_alias: tuple[torch.Tensor, torch.Tensor] | None = None
        # The reduce of this backward sums the gradients inside the unsharded storage
        # (``lend_storage_for_reduce``): it stays allocated until ``finish_reduce``.
        self._reduce_in_storage = False
        # Its staged gradients, taken out as soon as the reduce completes (``then``).
        self._staged: torch.futures.Future | None = None
        self._divide_factor = 1.0
        self._all_reduce = True
        # HSDP with ``set_requires_all_reduce(False)``: this rank's reduced row, summed over
        # the shard ranks only, waiting for the next backward that all-reduces.
        self._unreplicated: torch.Tensor | None = None
        # Weak references to (flat tensor, the gradient DTensors over it in ``params``
        # order) from the last commit that gave every parameter a fresh gradient laid out
        # like the shards: the optimizer can step on it while each ``.grad`` is still one
        # of those (``flat_grad``). Weak: ``zero_grad(set_to_none=True)`` frees them.
        self._committed: tuple[weakref.ref, list[weakref.ref]] | None = None
        # ``_shards_version()`` when a forward left the gathered copy in place (``is_stale``).
        self._gathered_version: int | None = None
        self._allocate_sharded(originals, device)

    # ------------------------------------------------------------------ storage
    def _allocate_sharded(self, originals: list[torch.Tensor], device: torch.device) -> None:
        total = self.shard_numel + len(self.scalars)
        self.sharded_flat = torch.zeros(total, dtype=self.dtype, device=device)
        with torch.no_grad():
            for p, orig in zip(self.params, originals):
                local = self.local_view(p)
                if device.type != "meta" and orig.device.type != "meta":
                    local.copy_(p.local_chunk(orig.detach()))
                p.sharded = torch.nn.Parameter(
                    p.to_dtensor(local), requires_grad=orig.requires_grad
                )
        self._allocate_unsharded()

    def _allocate_unsharded(self) -> None:
        world = self.comm.shard_size
        numel = world * self.shard_numel + len(self.scalars)
        # On one rank without a dtype change both layouts coincide: the unsharded
        # parameters are the shards themselves, and unshard/reshard do nothing.
        self.gather_is_identity = world == 1 and self.compute_dtype == self.dtype
        # On gloo, large buckets gather and reduce in place, in the unsharded storage:
        # no pooled buffer, no copy-out, no temporary inside gloo's all-gather.
        self.in_place = (
            world > 1
            and world >= IN_PLACE_MIN_WORLD
            and self.sharded_flat.device.type == "cpu"  # the copy-out runs on gloo's thread
            and self.comm.on_gloo
            and self.compute_dtype.is_floating_point
            and self.blocks_are_the_values
            and world * self.shard_numel * self.compute_dtype.itemsize >= IN_PLACE_MIN_BYTES
        )
        self.gather_in_place = self.in_place and GATHER_IN_PLACE
        self._gather_group = gather_group(self.comm.shard_group) if self.gather_in_place else None
        # Room after the parameters for the reduce's "used" flags, one per parameter.
        extra = len(self.params) if self.in_place else 0
        if self.gather_is_identity:
            flat = self.sharded_flat
        else:
            flat = torch.empty(numel + extra, dtype=self.compute_dtype, device=self.sharded_flat.device)
        self._unsharded_numel = numel + extra
        self.unsharded_flat = flat
        # Writes go through ``.data``, which has its own version counter: re-gathering
        # in backward must not look like an in-place change to the views autograd saved.
        self._unsharded_write = flat.data
        # Each sharded parameter's ``W x shard_numel`` region of the unsharded storage:
        # where the gathered blocks land, and in place where each rank's shard goes.
        self._regions = [
            self._unsharded_write[world * p.offset : world * (p.offset + p.shard_numel)].view(
                world, p.shard_numel
            )
            for p in self.sharded_params
        ]
        self.unsharded_views = [self._unsharded_view(flat, p) for p in self.params]
        # The same views written through ``.data``: gathers copy other dims' blocks out
        # into them, and in place the gradients go there for the reduce.
        self._write_views = [self._unsharded_view(self._unsharded_write, p) for p in self.params]
        self._own_rows = [v[self.comm.shard_rank] for v in self._regions] if self.in_place else []
        # The unsharded parameters: leaves over these views, whose ``.grad`` autograd
        # accumulates by whatever path the module's computation took.
        for p, view in zip(self.params, self.unsharded_views):
            p.set_unsharded(view)
        # One rank, no dtype change on the way in or out: the leaves alias the shards
        # and ``commit_direct`` hands their gradients to the sharded parameters, as in
        # local training: nothing to gather or reduce.
        self.direct = self.gather_is_identity and self.reduce_dtype == self.dtype and not self.comm.is_hsdp
        # How many references to the unsharded storage are our own (the tensors above);
        # any more means some tensor outside, e.g. one autograd saved, can still read it.
        self._own_storage_refs = _storage_refs(flat)
        self._free_unsharded()

    def _unsharded_view(self, flat: torch.Tensor, p: FSDPParam) -> torch.Tensor:
        if p.is_replicated:
            return flat[self.comm.shard_size * self.shard_numel + (p.offset - self.shard_numel)].view(())
        start = self.comm.shard_size * p.offset
        return flat[start : start + p.layout.shape.numel()].view(p.layout.shape)

    @property
    def blocks_are_the_values(self) -> bool:
        """Every parameter shards on dim 0 (or one rank): the gathered blocks, rank-major,
        are the unsharded parameters, so gathers write straight into them."""
        return all(p.layout.blocks_are_the_value for p in self.sharded_params)

    def optimizer_flat_alias(self) -> torch.Tensor:
        """A plain tensor sharing the sharded flat buffer, stepped by the optimizer in
        place of all of this bucket's parameters (``fsdp2._optim``)."""
        if self._flat_alias is None or self._flat_alias[0] is not self.sharded_flat:
            self._flat_alias = (self.sharded_flat, self.sharded_flat.detach())
        return self._flat_alias[1]

    def local_view(self, p: FSDPParam) -> torch.Tensor:
        """``p``'s real rows inside the sharded flat buffer."""
        if p.is_replicated:
            return self.sharded_flat[p.offset].view(())
        return self.sharded_flat[p.offset : p.offset + p.layout.local_numel].view(p.local_shape)

    def _free_unsharded(self) -> None:
        if not self.gather_is_identity and not self._reduce_in_storage:
            self.unsharded_flat.untyped_storage().resize_(0)

    def _alloc_unsharded(self) -> None:
        if self.gather_is_identity:
            return
        nbytes = self._unsharded_numel * self.unsharded_flat.element_size()
        if self.unsharded_flat.untyped_storage().nbytes() != nbytes:
            self.unsharded_flat.untyped_storage().resize_(nbytes)

    def is_unsharded_unreferenced(self) -> bool:
        """True when the gathered parameters are resident but no tensor other than this
        bucket's own views shares their storage: nothing can read them any more."""
        if self.gather_is_identity or self.unsharded_flat.untyped_storage().nbytes() == 0:
            return False
        refs = _storage_refs(self.unsharded_flat)
        return refs is not None and refs <= self._own_storage_refs  # type: ignore[operator]

    def unsharded_bytes(self) -> int:
        return self.unsharded_flat.untyped_storage().nbytes()

    def rebind(self) -> None:
        """Adopt whatever ``module._apply`` (``to_empty``, ``to``, ``double``...) put into
        the sharded parameters: copy their values into fresh flat storage on their new
        device and dtype, and point the parameters back at it."""
        current = [p.owners[0][0]._parameters[p.owners[0][1]] for p in self.params]
        locals_ = [c.to_local() if isinstance(c, torch.distributed.tensor.DTensor) else c for c in current]
        device, dtype = locals_[0].device, locals_[0].dtype
        if self.compute_dtype == self.dtype:
            self.compute_dtype = dtype
        if self.reduce_dtype == self.dtype:
            self.reduce_dtype = dtype
        self.dtype = dtype
        self.sharded_flat = torch.zeros(self.shard_numel + len(self.scalars), dtype=dtype, device=device)
        with torch.no_grad():
            for p, param, local in zip(self.params, current, locals_):
                view = self.local_view(p)
                if device.type != "meta":
                    view.copy_(local.reshape(view.shape))
                grad = param.grad
                fresh = torch.nn.Parameter(
                    p.to_dtensor(view), requires_grad=param.requires_grad
                )
                # Swap rather than ``.data =``: a DTensor keeps its local tensor in a Python
                # attribute that ``.data`` would not update; the object stays the same.
                torch.utils.swap_tensors(param, fresh)
                if grad is not None:
                    param.grad = grad
                p.sharded = param  # type: ignore[assignment]
                p.dtype = dtype
                p.register_sharded()
        self._allocate_unsharded()

    # --------------------------------------------------------------- all-gather
    def start_all_gather(
        self, partial_group: dist.ProcessGroup | None, after: torch.futures.Future | None = None
    ) -> None:
        """Phase 1 of unshard: issue the all-gather (from the partial shard if kept). In
        place, with ``after`` (a reduce in storage still in flight), it is issued only once
        that reduce completed and freed its storage, so the two never hold memory at once."""
        if self.shard_numel == 0 or self.gather_is_identity:
            return
        comm = self.comm
        if partial_group is not None and self._partial is not None:
            source, group = self._partial, partial_group
        else:
            source, group = self.sharded_flat[: self.shard_numel], comm.shard_group
            if self.gather_in_place:
                if after is not None and not after.done() and not debug_enabled():
                    issue = functools.partial(self._start_gather_in_place, source)
                    self._gather_issue = issue_after(after, issue)
                else:
                    self._start_gather_in_place(source)
                return
            if self.compute_dtype != self.dtype:
                with traced("fsdp2::cast_for_all_gather"):
                    source = source.to(self.compute_dtype)
        self._gather_buf = comm.pool.acquire(self._comm_numel(), self.compute_dtype, source.device)
        output = self._gather_buf[: comm.shard_size * self.shard_numel]
        self._gather_input = source
        self._pending_gather = all_gather_flat(
            source, output, group, label=f"all-gather of {self.name}"
        )

    def _start_gather_in_place(self, shard: torch.Tensor) -> None:
        """Write this rank's rows into the unsharded storage, -0.0 everywhere else, and
        sum over ranks: the storage then holds every rank's rows, parameter-major."""
        if self._reduce_in_storage:
            raise AssertionError(f"fsdp2 internal error: {self.name} gathers into storage a reduce uses")
        self._alloc_unsharded()
        region = self._unsharded_write[: self.comm.shard_size * self.shard_numel]
        with traced("fsdp2::copy_in"):
            region.fill_(-0.0)
            if self.compute_dtype != self.dtype:
                shard = shard.to(self.compute_dtype)
            sizes = [p.shard_numel for p in self.sharded_params]
            torch.split_with_sizes_copy(shard, sizes, out=self._own_rows)
        self._pending_gather = all_gather_in_place(
            region, self._gather_group, label=f"all-gather of {self.name}"
        )

    def finish_all_gather(self) -> None:
        """Phase 2 of unshard: wait, then copy the gathered shards out parameter-major
        (unless they were gathered in place)."""
        if self.gather_is_identity:
            return
        if self._gather_issue is not None:
            wait_future(self._gather_issue, f"all-gather of {self.name}")
            self._gather_issue = None
        self._alloc_unsharded()
        if self.shard_numel > 0:
            assert self._pending_gather is not None, "fsdp2 internal error: no all-gather issued"
            output = wait_pending(self._pending_gather)
            self._pending_gather = None
            self._gather_input = None
            if self._gather_buf is not None:
                with traced("fsdp2::copy_out"):
                    self._copy_out(output.view(self.comm.shard_size, self.shard_numel))
                self.comm.pool.release(self._gather_buf)
                self._gather_buf = None
        self._partial = None
        if self.scalars:
            start = self.comm.shard_size * self.shard_numel
            tail = self._unsharded_write[start : start + len(self.scalars)]
            tail.copy_(self.sharded_flat[self.shard_numel :])

    def _copy_out(self, blocks: torch.Tensor) -> None:
        """Gathered blocks (``W x S``, rank-major) into the unsharded parameters: one
        ``split_with_sizes_copy`` when they all shard on dim 0, otherwise the dim-0 ones
        by region and the others by their layout."""
        sizes = [p.shard_numel for p in self.sharded_params]
        if self.blocks_are_the_values:
            torch.split_with_sizes_copy(blocks, sizes, dim=1, out=self._regions)
            return
        for p, src, region in zip(self.sharded_params, blocks.split(sizes, dim=1), self._regions):
            if p.layout.blocks_are_the_value:
                region.copy_(src)
            else:
                p.layout.copy_blocks_out(src, self._write_views[p.bucket_index])

    def _gathered_blocks(self) -> list[torch.Tensor]:
        """The gathered parameters as ``W x shard_numel`` blocks, one per sharded parameter
        (views where they shard on dim 0, copies otherwise)."""
        blocks = []
        for p, region in zip(self.sharded_params, self._regions):
            if p.layout.blocks_are_the_value:
                blocks.append(region)
            else:
                cut = torch.empty_like(region)
                p.layout.write_blocks(cut, self._write_views[p.bucket_index], accumulate=False)
                blocks.append(cut)
        return blocks

    def note_kept(self) -> None:
        """A forward ends with the gathered (or partially kept) parameters left in place."""
        self._gathered_version = None if self.gather_is_identity else self._shards_version()

    def is_stale(self) -> bool:
        """Parameters a forward left gathered predate a write to the shards since."""
        return self._gathered_version is not None and self._shards_version() != self._gathered_version

    def _shards_version(self) -> int:
        """Grows with every write to the shards: through the flat buffer (a flat optimizer
        step), a local shard (``to_local()``, a per-parameter step) or the DTensor itself
        (an in-place DTensor op, ``load_state_dict``). DTensor ops run below autograd, so
        these are three separate version counters."""
        version = self.sharded_flat._version
        for p in self.params:
            version += p.sharded._version + p.sharded._local_tensor._version  # type: ignore[union-attr]
        return version

    def reshard(self) -> None:
        # Never free memory a collective still writes (or a deferred one will).
        if self._pending_gather is not None or self._gather_issue is not None:
            self.finish_all_gather()
        self._partial = None
        self._gathered_version = None
        self._free_unsharded()

    def reshard_partial(self, factor: int, index: int) -> None:
        """Keep only the ranks ``[index*W/factor, (index+1)*W/factor)`` of the gathered
        rows, so the backward all-gather runs over ``factor`` ranks only."""
        world = self.comm.shard_size
        rows = world // factor
        keep = torch.empty(rows * self.shard_numel, dtype=self.compute_dtype, device=self.sharded_flat.device)
        if self.shard_numel:
            torch.cat(
                [v[index * rows : (index + 1) * rows] for v in self._gathered_blocks()],
                dim=1,
                out=keep.view(rows, self.shard_numel),
            )
        self._free_unsharded()
        self._partial = keep

    # ----------------------------------------------------------- reduce-scatter
    def reduce_layout(self) -> ReduceLayout:
        """The reduce layout built by the last ``refresh_reduce_layout``."""
        if self._layout is None:
            return self.refresh_reduce_layout()
        return self._layout

    def refresh_reduce_layout(self) -> ReduceLayout:
        """Rebuild the reduce layout if ``requires_grad`` flags changed (checked each forward)."""
        key = tuple(bool(p.sharded is not None and p.sharded.requires_grad) for p in self.params)
        if self._layout is not None and key == self._layout_key:
            return self._layout
        if any(self._deposited) or self.has_unsharded_grads() or self._unreplicated is not None:
            raise RuntimeError(
                "requires_grad of a parameter changed while gradients were being accumulated "
                "without synchronization; change requires_grad only between optimizer steps"
            )
        params = [p for p, rg in zip(self.params, key) if rg and not p.is_replicated]
        scalars = [p for p, rg in zip(self.params, key) if rg and p.is_replicated]
        offsets, col = [], 0
        for p in params:
            offsets.append(col)
            col += p.shard_numel
        for p in self.params:
            p.rs_index = -1
        for i, p in enumerate(params + scalars):
            p.rs_index = i
        flags = len(params) + len(scalars)
        padding = [
            (off + p.layout.local_numel, off + p.shard_numel)
            for p, off in zip(params, offsets)
            if p.layout.padded
        ]
        self._layout = ReduceLayout(params, scalars, offsets, col, col + flags + len(scalars), padding)
        self._layout_key = key
        self._deposited = [False] * flags
        return self._layout

    def has_reduced_params(self) -> bool:
        layout = self.reduce_layout()
        return bool(layout.params or layout.scalars)

    def _reduce_input2d(self) -> torch.Tensor:
        layout = self.reduce_layout()
        if self._reduce_input is None:
            self._reduce_input = self.comm.pool.acquire(
                self._comm_numel(), self.reduce_dtype, self.sharded_flat.device
            )
        return self._reduce_input[: self.comm.shard_size * layout.numel].view(self.comm.shard_size, layout.numel)

    def _comm_numel(self) -> int:
        """One size for this bucket's all-gather output and reduce input: the pool serves
        both from the same buffer."""
        return self.comm.shard_size * max(self.shard_numel, self.reduce_layout().numel)

    def lend_storage_for_reduce(self) -> None:
        """Called once nothing reads the unsharded parameters any more (before the
        gradients are deposited, and again before the reduce is issued): when the
        bucket is in place, every parameter is reduced and the reduce dtype is the compute
        dtype, the gradients go into the parameters' own places in the unsharded storage
        and are summed there (gradients already in a pooled buffer are moved over);
        ``finish_reduce`` frees the storage. Idempotent."""
        if self._reduce_in_storage:
            return
        layout = self.reduce_layout()
        # Only conditions every rank agrees on: which gradients a rank deposited so far
        # depends on its data, and all ranks must issue the same reduce.
        if not (
            self.in_place
            and not self.comm.is_hsdp
            and self.reduce_dtype == self.compute_dtype
            and len(layout.params) + len(layout.scalars) == len(self.params)
            and self._pending_reduce is None
        ):
            return
        self._alloc_unsharded()  # a group freed early (the root) gets it back here
        self._reduce_in_storage = True
        if self._reduce_input is not None:  # gradients accumulated in a pooled buffer: move them
            buf = self._reduce_input2d()
            for p, off, rows in zip(layout.params, layout.offsets, self._regions):
                if self._deposited[p.rs_index]:
                    rows.copy_(buf[:, off : off + p.shard_numel])
            base = layout.grad_numel + len(layout.params) + len(layout.scalars)
            for i, p in enumerate(layout.scalars):
                if self._deposited[p.rs_index]:
                    self._write_views[p.bucket_index].copy_(buf[0, base + i])
            self._release_reduce_buffers()

    @property
    def reduces_in_storage(self) -> bool:
        return self._reduce_in_storage

    def reduce_in_flight(self) -> torch.futures.Future | None:
        """The future of a reduce in storage still running (done once its storage is free)."""
        staged = self._staged
        return staged if staged is not None and not staged.done() else None

    def has_unsharded_grads(self) -> bool:
        """Some unsharded leaf holds a gradient not yet moved into the reduce input."""
        return any(p.unsharded is not None and p.unsharded.grad is not None for p in self.params)

    def deposit_unsharded_grads(self) -> None:
        """Move the leaves' gradients into the reduce input (adding to earlier ones)."""
        with torch.no_grad():
            for p in self.params:
                grad = p.take_unsharded_grad()
                if grad is not None:
                    self.deposit(p, grad)

    def deposit(self, p: FSDPParam, grad: torch.Tensor) -> None:
        """Add (or copy, if first) ``p``'s unsharded gradient into the reduce input."""
        layout = self.reduce_layout()
        if p.rs_index < 0:
            raise AssertionError(f"fsdp2 internal error: gradient for frozen parameter {p.fqn}")
        first = not self._deposited[p.rs_index]
        self._deposited[p.rs_index] = True
        if self._reduce_in_storage:
            _write(self._write_views[p.bucket_index], grad, first)
            return
        buf = self._reduce_input2d()
        if p.is_replicated:
            col = layout.grad_numel + len(layout.params) + len(layout.scalars) + layout.scalars.index(p)
            _write(buf[:, col], grad, first)
            return
        region = buf[:, layout.offsets[p.rs_index] : layout.offsets[p.rs_index] + p.shard_numel]
        p.layout.write_blocks(region, grad, accumulate=not first)

    def start_reduce(self, divide_factor: float, all_reduce: bool = True) -> None:
        """Issue the reduce-scatter of everything deposited; undeposited gradients count as
        zero and carry a zero "used" flag. The gradients are divided by ``divide_factor``.
        HSDP: the result is then all-reduced over the replicas, or with ``all_reduce``
        False kept and added to the next one (``_sum_replicas``)."""
        self._divide_factor = divide_factor
        self._all_reduce = all_reduce
        if self._reduce_in_storage:
            self._start_reduce_in_storage()
            return
        layout = self.reduce_layout()
        buf = self._reduce_input2d()
        with traced("fsdp2::reduce_prepare"):
            for p, off in zip(layout.params, layout.offsets):
                if not self._deposited[p.rs_index]:
                    buf[:, off : off + p.shard_numel].zero_()
            scalar_base = layout.grad_numel + len(layout.params) + len(layout.scalars)
            for i, p in enumerate(layout.scalars):
                if not self._deposited[p.rs_index]:
                    buf[:, scalar_base + i].zero_()
            flags = torch.tensor(self._deposited, dtype=buf.dtype).to(buf.device)
            buf[:, layout.grad_numel : scalar_base].copy_(flags)
        comm = self.comm
        if comm.on_gloo and comm.shard_size > 1:
            method = "all_to_all"
            self._reduce_scratch = comm.pool.acquire(buf.numel(), buf.dtype, buf.device)
        else:
            # Replicated scalars need bitwise-equal sums on every rank, but a
            # reduce-scatter may sum each rank's row in a different order: reduce them
            # with an all-reduce and read them from row 0 on every rank.
            method = "all_reduce" if layout.scalars else "reduce_scatter"
        self._pending_reduce = reduce_scatter_flat(
            buf,
            comm.shard_group,
            comm.shard_rank,
            method,
            None if self._reduce_scratch is None else self._reduce_scratch.view(buf.shape),
            label=f"reduce-scatter of {self.name}",
        )

    def _start_reduce_in_storage(self) -> None:
        """The storage holds each gradient where its parameter was (every rank's rows),
        then the replicated scalars' gradients, then one flag per parameter: one in-place
        all-reduce sums it all, and each rank reads its own rows."""
        world_numel = self.comm.shard_size * self.shard_numel
        with traced("fsdp2::reduce_prepare"):
            for p, rows in zip(self.sharded_params, self._regions):
                if not self._deposited[p.rs_index]:
                    rows.zero_()
            for p in self.scalars:
                if not self._deposited[p.rs_index]:
                    self._write_views[p.bucket_index].zero_()
            flags_at = world_numel + len(self.scalars)
            flags = self._unsharded_write[flags_at : flags_at + len(self._deposited)]
            flags.copy_(torch.tensor(self._deposited, dtype=flags.dtype))
        self._pending_reduce = all_reduce_in_place(
            self._unsharded_write[: flags_at + len(self._deposited)],
            self.comm.shard_group,
            label=f"reduce-scatter of {self.name}",
        )
        # Take this rank's rows out and free the storage the moment the sum is done,
        # not when the next group's gradients need room: by then they are all resident.
        stage = functools.partial(self._stage_from_storage, self.reduce_layout(), self._divide_factor)
        self._staged = then(self._pending_reduce, stage)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter and stage the sharded gradients for ``commit_grads``."""
        assert self._pending_reduce is not None, "fsdp2 internal error: no reduce-scatter issued"
        if self._staged is not None:  # reduced in storage: staged on gloo's thread
            staged = wait_future(self._staged, self._pending_reduce.label)
            self._staged = None
        else:
            staged = self._stage_from_pool(wait_pending(self._pending_reduce))
        self._pending_reduce = None
        self._deposited = [False] * len(self._deposited)
        if staged is not None:
            self._ready_grads.append(staged)

    def _stage_from_pool(self, result: torch.Tensor) -> tuple | None:
        """The pooled reduce completed: copy out this rank's row, then release the buffer."""
        layout = self.reduce_layout()
        if self.comm.is_hsdp:
            summed = self._sum_replicas(result, layout)
            if summed is None:
                self._release_reduce_buffers()
                return None
            result = summed
        with traced("fsdp2::grad_copy"):
            grads = result[: layout.grad_numel].to(self.dtype, copy=True)
            flag_end = layout.grad_numel + len(layout.params) + len(layout.scalars)
            # Kept as a tensor: reading it (a device sync on GPUs) waits for commit_grads.
            used = result[layout.grad_numel : flag_end].clone()
            # Replicated scalars: bitwise equal on every rank in row 0 after an all-reduce,
            # and in every rank's own row after an all-to-all (summed alike everywhere).
            row = result if self.comm.on_gloo or self.comm.is_hsdp else self._reduce_input2d()[0]
            scalar_vals = row[flag_end : layout.numel].to(self.dtype, copy=True)
            staged = _staged(layout, grads, used, scalar_vals, self._divide_factor)
        self._release_reduce_buffers()
        return staged

    def _sum_replicas(self, result: torch.Tensor, layout: ReduceLayout) -> torch.Tensor | None:
        """HSDP: sum this rank's reduced row over the replicas (adding what earlier
        backwards without all-reduce kept), or keep it for later: None then."""
        row = result[: layout.numel]
        if not self.comm.on_gloo and layout.scalars:
            # Replicated scalars are bitwise equal across the shard ranks in row 0 only.
            start = layout.grad_numel + len(layout.params) + len(layout.scalars)
            row[start:].copy_(self._reduce_input2d()[0, start : layout.numel])
        if self._unreplicated is not None:
            row.add_(self._unreplicated)
            self._unreplicated = None
        if not self._all_reduce:
            self._unreplicated = row.clone()
            return None
        assert self.comm.replicate_group is not None
        wait_pending(all_reduce_in_place(row, self.comm.replicate_group, label=f"all-reduce of {self.name}"))
        return row

    def _stage_from_storage(self, layout: ReduceLayout, divide_factor: float) -> tuple:
        """The reduce in storage completed: copy out this rank's rows of every parameter
        (laid out like its shards), the flags and the scalars, then free the storage.
        Runs on gloo's thread; nothing else touches this bucket's storage meanwhile
        (an unshard first waits for it: ``ParamGroup.unshard``)."""
        world_numel = self.comm.shard_size * self.shard_numel
        flags_at = world_numel + len(self.scalars)
        with traced("fsdp2::grad_copy"):
            grads = torch.cat(self._own_rows) if self._own_rows else self._unsharded_write[:0].clone()
            n_flags = len(layout.params) + len(layout.scalars)
            used = self._unsharded_write[flags_at : flags_at + n_flags].clone()
            scalar_vals = self._unsharded_write[world_numel:flags_at].to(self.dtype, copy=True)
            staged = _staged(layout, grads.to(self.dtype), used, scalar_vals, divide_factor)
        self.unsharded_flat.untyped_storage().resize_(0)
        self._reduce_in_storage = False  # only now: an unshard may take the storage again
        return staged

    def _release_reduce_buffers(self) -> None:
        """The reduce input and the all-to-all's receive buffer go back to the pool."""
        for buf in (self._reduce_input, self._reduce_scratch):
            if buf is not None:
                self.comm.pool.release(buf)
        self._reduce_input = self._reduce_scratch = None

    def commit_grads(self) -> None:
        """Accumulate the staged gradients into ``.grad``. Runs at the end of a backward
        that completed, so a backward that raised leaves ``.grad`` as it was."""
        flat = None
        if len(self._ready_grads) == 1 and self._all_grads_none():
            layout, grads = self._ready_grads[0][:2]
            if len(layout.params) == len(self.params):  # every parameter, at its shard offset
                flat = grads
        for layout, grads, used_flags, scalar_vals in self._ready_grads:
            used = used_flags.tolist()  # flags follow layout.params, then layout.scalars
            for flag, p, off in zip(used, layout.params, layout.offsets):
                if flag > 0:
                    local = grads[off : off + p.layout.local_numel].view(p.local_shape)
                    _accumulate_grad(p, local)
            for flag, p, value in zip(used[len(layout.params) :], layout.scalars, scalar_vals):
                if flag > 0:
                    _accumulate_grad(p, value.view(()))
        self._ready_grads.clear()
        if flat is not None:
            self._remember_flat_grad(flat)

    def _all_grads_none(self) -> bool:
        return all(p.sharded.grad is None for p in self.params)  # type: ignore[union-attr]

    def _remember_flat_grad(self, flat: torch.Tensor) -> None:
        grads = [p.sharded.grad for p in self.params]  # type: ignore[union-attr]
        self._committed = None
        if all(g is not None for g in grads):
            self._committed = (weakref.ref(flat), [weakref.ref(g) for g in grads])  # type: ignore[arg-type]

    def flat_grad(self) -> torch.Tensor | None:
        """The flat gradient of the last fresh commit while every parameter's ``.grad`` is
        still the DTensor made over it (accumulating into them keeps it valid)."""
        committed = self._committed
        if committed is None:
            return None
        for p, ref in zip(self.params, committed[1]):
            if p.sharded.grad is not ref() or ref() is None:  # type: ignore[union-attr]
                return None
        return committed[0]()

    def commit_direct(self, divide_factor: float) -> None:
        """Direct mode: move the leaves' accumulated gradients into ``.grad``. When every
        parameter got one and none had one yet, they go into one flat tensor laid out like
        the shards, so the optimizer can step the bucket as one tensor (``fsdp2._optim``)."""
        grads = [p.unsharded.grad for p in self.params]  # type: ignore[union-attr]
        if (
            len(grads) > 1
            and not self.scalars
            and all(g is not None for g in grads)
            and self._all_grads_none()
        ):
            flat = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
            if divide_factor != 1:
                flat.div_(divide_factor)
            for p in self.params:
                p.take_unsharded_grad()
                local = flat[p.offset : p.offset + p.shard_numel].view(p.local_shape)
                p.sharded.grad = p.grad_dtensor(local)  # type: ignore[union-attr]
            self._remember_flat_grad(flat)
            return
        for p in self.params:
            grad = p.take_unsharded_grad()
            if grad is not None:
                if divide_factor != 1:
                    grad.div_(divide_factor)
                _accumulate_grad(p, grad)

    def drop_reduce_state(self) -> None:
        """Forget deposited gradients and any reduce-scatter (after an exception)."""
        self._ready_grads.clear()
        for p in self.params:
            p.take_unsharded_grad()
        if self._pending_reduce is not None:
            try:
                if self._staged is not None:
                    wait_future(self._staged, self._pending_reduce.label)
                else:
                    wait_pending(self._pending_reduce)
            finally:
                self._pending_reduce = None
                self._staged = None
                if self._reduce_in_storage:  # the sum is over (or failed): the storage is ours
                    self._reduce_in_storage = False
                    self._free_unsharded()
        self._release_reduce_buffers()
        self._unreplicated = None
        self._deposited = [False] * len(self._deposited)
        if self._gather_issue is not None:
            try:
                wait_future(self._gather_issue, f"all-gather of {self.name}")
            finally:
                self._gather_issue = None
        if self._pending_gather is not None:
            try:
                wait_pending(self._pending_gather)
            finally:
                if self._gather_buf is not None:
                    self.comm.pool.release(self._gather_buf)
                self._gather_buf = None
                self._pending_gather = None
                self._gather_input = None


def _storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) share ``t``'s storage; None if this build of
    torch cannot tell (the private counter torch's CUDA-graph trees also use)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    storage = t.untyped_storage()
    if sys.getrefcount(storage) > 2:  # a storage handle someone keeps: count it as a user
        return use_count(storage._cdata) + 1
    return use_count(storage._cdata) - 1  # minus the handle just created


def _staged(
    layout: ReduceLayout, grads: torch.Tensor, used: torch.Tensor, scalar_vals: torch.Tensor, divide_factor: float
) -> tuple[ReduceLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's reduced gradients as ``commit_grads`` takes them: the padding rows
    zeroed (a flat optimizer step keeps them at zero) and everything divided."""
    for start, end in layout.padding:
        grads[start:end].zero_()
    if divide_factor != 1:
        grads.div_(divide_factor)
        scalar_vals.div_(divide_factor)
    return layout, grads, used, scalar_vals


def _write(dst: torch.Tensor, src: torch.Tensor, first: bool) -> None:
    if first:
        dst.copy_(src)
    else:
        dst.add_(src)


def _accumulate_grad(p: FSDPParam, local: torch.Tensor) -> None:
    param = p.sharded
    assert param is not None
    if param.grad is None:
        param.grad = p.grad_dtensor(local)
    else:
        existing = param.grad
        (existing.to_local() if isinstance(existing, torch.distributed.tensor.DTensor) else existing).add_(
            local
        )
