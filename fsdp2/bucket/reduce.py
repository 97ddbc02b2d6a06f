"""The gradients of one bucket: deposit, reduce, stage.

Reduce input (``W x N``, reduce dtype, pooled): the gradients that require grad laid out
like the shards (each rank's block in its row), then the gradients of replicated
scalars, then one "used" flag per reduced parameter. Summed over the shard ranks, row
``r`` is rank ``r``'s result; a flag above zero means some rank produced a gradient, so
unused parameters keep ``grad=None`` exactly as in local training, and every rank
reduces the same bytes. With HSDP the row is then all-reduced over the replicas.

Deposit: a gradient goes into its parameter's columns of the pooled input (each rank's
block in its row, ``ShardLayout.write_blocks``), or, when gloo's in-place strategy holds
the unsharded storage (``storage_lent``), into that storage. The usual backward (a
gradient for every reduced parameter, all sharded on dim 0) writes them all with one
``torch._chunk_cat``.

Lifecycle (``ReduceState``): IDLE -> ACCUMULATING (gradients deposited) -> IN_FLIGHT
(reduce issued) -> IDLE (staged for ``commit``). Large gloo buckets may deposit into
the unsharded storage instead and reduce there (``InPlace``, the strategy that owns
that trick).

A group with all-gather extensions holds several buckets on one mesh (the extension
parameters in buckets of their own); those that reduce alike go out as one reduce, as
torch sends a group's gradients together: the first one's ``BucketReduce`` carries the
others' parameters (``carry``: its ``params`` and layout span them, its ``GradCommit``
writes their ``.grad``) and theirs reduce nothing.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._compat import TORCH
from ..comm.collectives import Pending, all_reduce_in_place, reduce_scatter_flat, traced, wait_pending
from ..params.param import FSDPParam
from .quant.reduce import QuantizedReduce
from .quant.spec import quantizes
from .reduce_layout import ReduceLayout

if TYPE_CHECKING:
    from .view import BucketView


class ReduceState(Enum):
    IDLE = auto()  # nothing deposited since the last reduce
    ACCUMULATING = auto()  # gradients deposited, in the pooled input or the lent storage
    IN_FLIGHT = auto()  # the reduce is issued, not waited for


# This rank's reduced gradients, ready for ``commit``: (layout, gradients, used flags,
# replicated scalars' values).
Staged = tuple[ReduceLayout, torch.Tensor, torch.Tensor, torch.Tensor]


class BucketReduce:
    """Deposits the gradients of one bucket and reduces them over the mesh."""

    def __init__(self, bucket: BucketView) -> None:
        self.bucket = bucket
        # The parameters it reduces: its bucket's, then those of the buckets it carries
        # (``riders``); none when another bucket's reduce carries its bucket.
        self.params: list[FSDPParam] = bucket.params
        self.riders: list[BucketReduce] = []
        self.state = ReduceState.IDLE
        self.deposited: list[bool] = []
        self.ready: list[Staged] = []  # reduced, not yet in ``.grad``
        self.divide_factor = 1.0
        self._all_reduce = True
        self._pending: Pending | None = None
        self._input: torch.Tensor | None = None  # pooled, owned until reduced
        self._scratch: torch.Tensor | None = None  # pooled, the all-to-all's receive buffer
        self._layout: ReduceLayout | None = None
        self._layout_key: tuple[bool, ...] = ()
        # HSDP with ``set_requires_all_reduce(False)``: this rank's reduced row, summed over
        # the shard ranks only, waiting for the next backward that all-reduces.
        self._unreplicated: torch.Tensor | None = None
        self._leaf_grad_mode: tuple[torch.dtype | None, torch.Tensor | None] = (None, None)
        self.user = bucket.user  # the group's ``set_*`` choices (hook, collective, zeros)
        # ``MixedPrecisionPolicy(quantize_reduce=...)``: the reduce's encoding, if any.
        spec = bucket.quant.reduce
        self.quant = QuantizedReduce(spec) if spec is not None else None

    def holds_partial(self) -> bool:
        """HSDP with ``set_requires_all_reduce(False)``: a reduced row waits for the
        replicas' all-reduce of a later backward (or is on its way there)."""
        return self._unreplicated is not None or (self.state is ReduceState.IN_FLIGHT and not self._all_reduce)

    @property
    def is_plain(self) -> bool:
        """No user hook or collective: the in-place strategy may take the reduce."""
        return self.user.all_reduce_hook is None and self.user.reduce_scatter is None

    def used_flags(self) -> list[bool]:
        """The "used" flag of each reduced parameter, summed over ranks by the reduce: a
        parameter whose sum is 0 keeps ``grad=None``. Every parameter counts as used with
        a user hook (it may combine gradients over ranks the flags know nothing of, and
        torch gives zeros then) or ``zero_unused``."""
        if self.user.all_reduce_hook is not None or self.user.zero_unused:
            return [True] * len(self.deposited)
        return self.deposited

    def carry(self, riders: list[BucketReduce]) -> None:
        """Reduce the parameters of ``riders``' buckets with this bucket's, in one reduce
        (buckets of one group on the same mesh, with the same parameter and reduce dtypes
        and no host offload: ``runtime.group_setup.join_reduces``); each rider then reduces
        nothing. ``[]``: back to this bucket's own parameters. Set while nothing is being
        reduced (at build, and after ``module._apply`` changed dtypes)."""
        if riders == self.riders and (riders or self.params is self.bucket.params):
            return
        for r in [self, *riders]:
            if r.state is not ReduceState.IDLE or any(r.deposited) or r.ready or r._unreplicated is not None:
                raise RuntimeError(
                    f"fsdp2: {r.bucket.name}: the parameters' dtypes changed while gradients were being "
                    "accumulated without synchronization; change them only between optimizer steps"
                )
        self.riders = riders
        carried = [p for r in riders for p in r.bucket.params]
        self.params = [*self.bucket.params, *carried] if riders else self.bucket.params
        self._layout = None
        for r in riders:
            r.riders, r.params, r._layout = [], [], None

    def _advance(self, to: ReduceState, *allowed: ReduceState) -> None:
        if self.state not in allowed:
            raise AssertionError(f"fsdp2 internal error: {self.bucket.name} reduce {self.state.name} -> {to.name}")
        self.state = to

    # ------------------------------------------------------------------ layout
    def layout(self) -> ReduceLayout:
        """The reduce layout built by the last ``refresh_layout``."""
        return self._layout if self._layout is not None else self.refresh_layout()

    def refresh_layout(self) -> ReduceLayout:
        """Rebuild the layout if ``requires_grad`` flags changed (checked each forward)."""
        params = self.params
        key = tuple(bool(p.sharded is not None and p.sharded.requires_grad) for p in params)
        if self._layout is not None and key == self._layout_key:
            return self._layout
        if any(self.deposited) or self.has_unsharded_grads() or self._unreplicated is not None:
            raise RuntimeError(
                "requires_grad of a parameter changed while gradients were being accumulated "
                "without synchronization; change requires_grad only between optimizer steps"
            )
        self._layout = layout = ReduceLayout.of(params, key)
        self._layout_key = key
        self.deposited = [False] * (len(layout.params) + len(layout.scalars))
        return layout

    def has_reduced_params(self) -> bool:
        layout = self.layout()
        return bool(layout.params or layout.scalars)

    def is_complete(self) -> bool:
        """It reduces every parameter of its bucket (none frozen) and no other's: the
        in-place strategy, which reduces in the bucket's own storage, may take it."""
        layout = self.layout()
        return not self.riders and len(layout.params) + len(layout.scalars) == len(self.bucket.params)

    def input2d(self) -> torch.Tensor:
        """The pooled reduce input, ``W x N``, acquired on first use."""
        b, layout = self.bucket, self.layout()
        world = b.comm.shard_size
        if self._input is None:
            self._input = b.comm.pool.acquire(b.comm_numel(), b.reduce_dtype, b.device)
            if self._quantized():
                # Deposits leave the padding past an uneven shard's values as the pool
                # left it; a plain reduce adds it elementwise and ``stage`` zeroes it, but
                # a quantized block spans it: garbage there (a NaN) would spoil the block.
                self._input[: world * layout.numel].zero_()
        return self._input[: world * layout.numel].view(world, layout.numel)

    def has_pooled_input(self) -> bool:
        return self._input is not None

    def is_pending(self) -> bool:
        """Gradients deposited, reduced rows not yet committed, or a reduce in flight, or
        (HSDP) a row waiting for the replicas' all-reduce."""
        return self.state is not ReduceState.IDLE or bool(self.ready) or self._unreplicated is not None

    # ----------------------------------------------------------------- deposit
    def set_leaf_grad_dtypes(self, reduces: bool) -> None:
        """At each backward: the dtype the unsharded leaves take their gradients in, as
        the installed torch's ``fully_shard`` does (``_compat.TORCH``).

        - torch 2.15, a reduce dtype wider than the compute dtype (bf16 parameters,
          float32 reduce): in the first of several backwards accumulating without
          synchronization, the reduce dtype (the leaves' ``grad_dtype``: autograd casts
          each contribution, a tied weight's two, before summing them); in the others
          (the one that reduces, later accumulating ones) each op's own dtype
          (``grad_dtype=None``: autograd sums a leaf's contributions in the dtype they
          come in, and an op that computes a wider gradient keeps it, e.g. CPU's
          ``rms_norm`` for a bf16 weight: float32, summed over the batch in float32);
        - torch 2.15, any other reduce dtype: that dtype (a narrower one casts each
          contribution, as torch's leaf whose ``grad_dtype`` is the reduce dtype);
        - before 2.15: the compute dtype, cast to the reduce dtype once at the deposit.
        Leaves are left as built until some backward changes them."""
        b = self.bucket
        wider = b.reduce_dtype.itemsize > b.compute_dtype.itemsize
        first_accumulating = not reduces and not self.is_accumulating()
        mode: torch.dtype | None = b.compute_dtype  # the leaves' own: as built
        if TORCH.accumulates_in_reduce_dtype and (not wider or first_accumulating):
            mode = b.reduce_dtype
        elif wider and TORCH.reduce_keeps_computed_grad_dtype:
            mode = None
        if self._leaf_grad_mode[1] is not b.unsharded_flat:  # new leaves (new storage): as built
            self._leaf_grad_mode = (b.compute_dtype, b.unsharded_flat)
        if self._leaf_grad_mode[0] == mode:
            return
        self._leaf_grad_mode = (mode, b.unsharded_flat)
        for p in self.params:
            leaf = p.unsharded
            if p.has_plain_leaf and leaf is not None and leaf.requires_grad and p.bucket is b:
                if mode is not None and leaf.grad is not None and leaf.grad.dtype != mode:
                    leaf.grad = leaf.grad.to(mode)  # e.g. computed after an ``unshard()``
                leaf.grad_dtype = mode

    def is_accumulating(self) -> bool:
        """Gradients of an earlier backward wait in the reduce input."""
        return self.state is ReduceState.ACCUMULATING

    def has_unsharded_grads(self) -> bool:
        """Some unsharded leaf holds a gradient not yet moved into the reduce input."""
        return any(p.has_unsharded_grad for p in self.params)

    def deposit_unsharded_grads(self, sync: bool = True) -> None:
        """Move the leaves' gradients into the reduce input (adding to earlier ones).
        Without ``sync`` (accumulating), TP gradients still to be reduced over TP wait
        in the reduce dtype, to be reduced over TP once, with the synchronizing step's."""
        defer = None if sync else self.bucket.reduce_dtype
        with torch.no_grad():
            taken = []
            for p in self.params:
                grad = p.take_unsharded_grad(defer)
                if grad is not None:
                    taken.append((p, grad))
            if self._deposit_all_at_once(taken):
                return
            for p, grad in taken:
                self.deposit(p, grad)

    def _deposit_all_at_once(self, taken: list[tuple[FSDPParam, torch.Tensor]]) -> bool:
        """The usual backward: nothing deposited yet, a gradient for every reduced
        parameter, all sharded on dim 0 and of the reduce dtype. Then one
        ``torch._chunk_cat`` writes them all (each cut into ``W`` zero-padded chunks,
        rank-major: the reduce input's layout) instead of one deposit per parameter.
        False (nothing done) otherwise."""
        layout = self.layout()
        if (
            self.state is not ReduceState.IDLE
            or not layout.dim0
            or len(taken) != len(layout.params) + len(layout.scalars)
            or self.bucket.storage_lent
        ):
            return False
        sharded = [(p, g) for p, g in taken if not p.is_replicated]
        dtype = self.bucket.reduce_dtype
        if len(sharded) != len(layout.params) or any(
            g.dtype != dtype or not g.is_contiguous() or p is not q for (p, g), q in zip(sharded, layout.params)
        ):
            return False
        self._advance(ReduceState.ACCUMULATING, ReduceState.IDLE)
        buf = self.input2d()
        with traced("fsdp2::deposit_grads"):
            torch._chunk_cat([g for _, g in sharded], 0, buf.shape[0], out=buf[:, : layout.grad_numel])
        for p in layout.params:
            self.deposited[p.rs_index] = True
        for p, grad in taken:
            if p.is_replicated:
                self.deposit(p, grad)
        return True

    def deposit(self, p: FSDPParam, grad: torch.Tensor) -> None:
        """Add (or copy, if first) ``p``'s unsharded gradient into the reduce input."""
        layout = self.layout()
        if p.rs_index < 0:
            raise AssertionError(f"fsdp2 internal error: gradient for frozen parameter {p.fqn}")
        self._advance(ReduceState.ACCUMULATING, ReduceState.IDLE, ReduceState.ACCUMULATING)
        first = not self.deposited[p.rs_index]
        self.deposited[p.rs_index] = True
        if self.bucket.storage_lent:
            self.bucket.in_place.deposit(p, grad, first)  # type: ignore[union-attr]  # lent: in_place is set
            return
        buf = self.input2d()
        if p.is_replicated:
            write(buf[:, layout.scalar_base + layout.scalars.index(p)], grad, first)
            return
        region = buf[:, layout.offsets[p.rs_index] : layout.offsets[p.rs_index] + p.shard_numel]
        p.layout.write_blocks(region, grad, accumulate=not first)

    # ------------------------------------------------------------------ reduce
    def start(self, divide_factor: float, all_reduce: bool = True) -> None:
        """Issue the reduce of everything deposited; undeposited gradients count as zero
        and carry a zero "used" flag. The gradients are divided by ``divide_factor``.
        HSDP: the result is then all-reduced over the replicas, or with ``all_reduce``
        False kept and added to the next one (``_sum_replicas``)."""
        self._advance(ReduceState.IN_FLIGHT, ReduceState.IDLE, ReduceState.ACCUMULATING)
        self.divide_factor = divide_factor
        self._all_reduce = all_reduce
        if self.bucket.storage_lent:
            self._pending = self.bucket.in_place.start_reduce(self)  # type: ignore[union-attr]  # lent: in_place is set
            return
        layout, buf, comm = self.layout(), self.input2d(), self.bucket.comm
        with traced("fsdp2::reduce_prepare"):
            for p, off in zip(layout.params, layout.offsets):
                if not self.deposited[p.rs_index]:
                    buf[:, off : off + p.shard_numel].zero_()
            for i, p in enumerate(layout.scalars):
                if not self.deposited[p.rs_index]:
                    buf[:, layout.scalar_base + i].zero_()
            flags = torch.tensor(self.used_flags(), dtype=buf.dtype).to(buf.device)
            buf[:, layout.flags_base : layout.numel].copy_(flags)
        label = f"reduce-scatter of {self.bucket.name}"
        if self._quantized():
            if self.quant is None:
                raise AssertionError("fsdp2 internal error: expected self.quant is not None")
            self._pending = self.quant.start(buf, layout, comm, label)
            return
        custom = self.user.reduce_scatter
        if custom is not None and comm.shard_size > 1:
            out = custom.allocate((layout.numel,), dtype=buf.dtype, device=buf.device)
            work = custom(out, buf.reshape(-1), comm.shard_group, dist.ReduceOp.SUM, async_op=True)
            self._pending = Pending(work, out, label)
            return
        gloo = self.bucket.gloo
        if gloo is not None and gloo.reduce_by_all_to_all:
            method = "all_to_all"
            self._scratch = comm.pool.acquire(buf.numel(), buf.dtype, buf.device)
        else:
            # Replicated scalars need bitwise-equal sums on every rank, but a
            # reduce-scatter may sum each rank's row in a different order: reduce them
            # with an all-reduce and read them from row 0 on every rank.
            method = "all_reduce" if layout.scalars else "reduce_scatter"
        self._pending = reduce_scatter_flat(
            buf,
            comm.shard_group,
            comm.shard_rank,
            method,
            None if self._scratch is None else self._scratch.view(buf.shape),
            label=label,
        )

    def finish(self) -> None:
        """Wait for the reduce and stage this rank's gradients for ``commit``."""
        if self._pending is None:
            raise AssertionError("fsdp2 internal error: no reduce-scatter issued")
        in_place = self.bucket.in_place
        if in_place is not None and in_place.staged is not None:  # staged on gloo's thread
            staged = in_place.finish_reduce(self._pending.label)
        else:
            staged = self._stage_from_pool(wait_pending(self._pending))
        self._pending = None
        self.deposited = [False] * len(self.deposited)
        self._advance(ReduceState.IDLE, ReduceState.IN_FLIGHT)
        if staged is not None:
            self.ready.append(staged)

    def _stage_from_pool(self, result: torch.Tensor) -> Staged | None:
        """The pooled reduce completed: copy out this rank's row, then release the buffer."""
        layout, b = self.layout(), self.bucket
        if layout.scalars and self._scalars_in_row_0():
            # Replicated scalars are bitwise equal on every rank in row 0 only (after an
            # all-reduce; after an all-to-all every rank's own row has them, summed alike).
            result[layout.scalar_base : layout.flags_base].copy_(self.input2d()[0, layout.scalar_base : layout.flags_base])
        if b.comm.is_hsdp:
            summed = self._sum_replicas(result, layout)
            if summed is None:
                self.release_buffers()
                return None
            result = summed
        hook = self.user.all_reduce_hook
        if hook is not None:
            hook(result[: layout.flags_base])
        with traced("fsdp2::grad_copy"):
            grads = result[: layout.grad_numel].to(b.grad_dtype, copy=True)
            # Kept as a tensor: reading it (a device sync on GPUs) waits for commit_grads.
            used = result[layout.flags_base : layout.numel].clone()
            scalar_vals = result[layout.scalar_base : layout.flags_base].to(b.grad_dtype, copy=True)
            staged = stage(layout, grads, used, scalar_vals, self.divide_factor)
            if b.offload is not None:  # to the host, where the shards and the optimizer are
                staged = (layout, b.offload.to_host(grads), used, b.offload.to_host(scalar_vals))
        self.release_buffers()
        return staged

    def _sum_replicas(self, result: torch.Tensor, layout: ReduceLayout) -> torch.Tensor | None:
        """HSDP: sum this rank's reduced row over the replicas (adding what earlier
        backwards without all-reduce kept), or keep it for later: None then."""
        comm = self.bucket.comm
        row = result[: layout.numel]
        if self._unreplicated is not None:
            row.add_(self._unreplicated)
            self._unreplicated = None
        if not self._all_reduce:
            self._unreplicated = row.clone()
            return None
        if comm.replicate_group is None:
            raise AssertionError("fsdp2 internal error: expected comm.replicate_group is not None")
        wait_pending(all_reduce_in_place(row, comm.replicate_group, label=f"all-reduce of {self.bucket.name}"))
        return row

    def _scalars_in_row_0(self) -> bool:
        """The reduce ran as an all-reduce over the whole input (see ``start``)."""
        comm = self.bucket.comm
        gloo = self.bucket.gloo
        by_rows = (gloo is not None and gloo.reduce_by_all_to_all) or self._quantized()
        return self.user.reduce_scatter is None and not by_rows and comm.shard_size > 1

    def _quantized(self) -> bool:
        """This bucket's reduce is quantized (``fsdp2.bucket.quant.reduce``): asked, no custom
        collective, and every bucket it carries may be (none with an all-gather extension)."""
        return (
            self.quant is not None and self.user.reduce_scatter is None and all(quantizes(r.bucket) for r in [self, *self.riders])
        )

    def release_buffers(self) -> None:
        """The reduce input and the all-to-all's receive buffer go back to the pool."""
        for buf in (self._input, self._scratch):
            if buf is not None:
                self.bucket.comm.pool.release(buf)
        self._input = self._scratch = None
        if self.quant is not None:
            self.quant.release(self.bucket.comm.pool)

    def drop(self) -> None:
        """Forget deposited gradients and any reduce (after an exception)."""
        self.ready.clear()
        pending, self._pending = self._pending, None
        in_place = self.bucket.in_place
        try:
            for p in self.params:
                p.discard_unsharded_grad()
            if pending is not None:
                if in_place is not None and in_place.staged is not None:
                    in_place.finish_reduce(pending.label, discard=True)
                else:
                    wait_pending(pending)
        finally:
            self.release_buffers()
            self._unreplicated = None
            self.deposited = [False] * len(self.deposited)
            self.state = ReduceState.IDLE


def stage(
    layout: ReduceLayout, grads: torch.Tensor, used: torch.Tensor, scalar_vals: torch.Tensor, divide_factor: float
) -> Staged:
    """This rank's reduced gradients as ``commit`` takes them: the padding zeroed (a flat
    optimizer step keeps it at zero) and everything divided."""
    for start, end in layout.padding:
        grads[start:end].zero_()
    if divide_factor != 1:
        grads.div_(divide_factor)
        scalar_vals.div_(divide_factor)
    return layout, grads, used, scalar_vals


def write(dst: torch.Tensor, src: torch.Tensor, first: bool) -> None:
    if first:
        dst.copy_(src)
    else:
        dst.add_(src)
