"""The parameters of one group that share a dtype: one all-gather, one reduce.

Layouts (``W`` shard ranks, ``S`` = sum of the padded shard sizes):

* sharded flat (``S + R`` elements, the parameters' dtype): each parameter's block (its
  shard, contiguous in its own shape, then padding) at its ``offset``, then the ``R``
  replicated scalars. The sharded DTensors' local tensors are slices of its storage
  (``own_storage_view``), so the optimizer updates it in place and the all-gather reads
  it directly (a single cast when ``param_dtype`` differs).
* all-gather output (``W x S``, rank-major): rank ``r``'s sharded flat in row ``r``.
* unsharded flat (``W*S + R``, compute dtype): parameter-major, each parameter's
  ``W`` blocks in a region of its own; a parameter sharded on dim 0 is that region read
  from its start (a plain view), one sharded on another dim is copied out of the blocks
  (``ShardLayout.copy_blocks_out``). Its storage is resized to 0 on reshard and back on
  unshard, so tensors autograd saved in forward see the re-gathered values in backward.

The all-gather is ``BucketGather`` (``gather.py``); gradients go through
``BucketReduce`` (``reduce.py``) and into ``.grad`` through ``GradCommit``
(``commit.py``). Large buckets on gloo gather and reduce in place
(``InPlace``, ``in_place.py``): gloo's strategies are chosen once per bucket
(``GlooStrategy``, ``gloo.py``); elsewhere ``gloo`` and ``in_place`` are None.
With ``CPUOffloadPolicy`` on an accelerator the sharded flat lives on the host and the
rest on the device (``HostOffload``, ``offload.py``); elsewhere ``offload`` is None.
"""

from __future__ import annotations

import sys
from typing import cast

import torch

from ..api import MixedPrecisionPolicy
from ..comm.buffers import BufferPool
from ..comm.mesh import MeshInfo
from ..params.dtensor import own_storage_view
from ..params.param import FSDPParam
from .commit import GradCommit
from .extension import ExtensionGather
from .gather import BucketGather
from .gloo import GlooStrategy
from .in_place import InPlace
from .offload import HostOffload
from .quant.gather import QuantizedGather
from .quant.spec import NO_QUANTIZATION, QuantizedComm
from .reduce import BucketReduce
from .user_comm import UserComm


class FlatBucket:
    """Storage and all-gather of the same-dtype parameters of one group; its gradients'
    reduce (``reduce``) and commit (``commit``)."""

    def __init__(
        self,
        params: list[FSDPParam],
        originals: list[torch.Tensor],
        comm: MeshInfo,
        device: torch.device,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        offload: HostOffload | None = None,
        quant: QuantizedComm = NO_QUANTIZATION,
        user: UserComm | None = None,
    ) -> None:
        self.params = params
        self.quant = quant  # what ``MixedPrecisionPolicy`` asks to quantize (``fsdp2.bucket.quant``)
        for i, p in enumerate(params):
            p.bucket_index = i
            p.bucket = self
        self.comm = comm
        self.dtype = params[0].dtype
        self.grad_dtype = params[0].grad_dtype  # its own, or an explicit ``grad_dtype``
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
        # Every parameter shards on dim 0 (or one rank): the gathered blocks, rank-major,
        # are the unsharded parameters, so gathers write straight into them.
        self.blocks_are_the_values = all(p.layout.blocks_are_the_value for p in self.sharded_params)
        # Subclasses with an all-gather extension (in buckets of their own): their gather.
        self.extension = any(p.extension for p in params)
        self.mp_policy: MixedPrecisionPolicy | None = None  # the group's, passed to ``fsdp_pre_all_gather``
        # A ``RidingGather`` when another carries it.
        self.gather: BucketGather = BucketGather(self) if quant.gather is None else QuantizedGather(self, quant.gather)
        # The group's other buckets on this mesh, whose rows this extension bucket's
        # all-gather carries (``ExtensionGather``; ``join_gathers`` sets them).
        self.riders: list[FlatBucket] = []
        self._flat_alias: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kept = KeptCopy(self)
        self.user = user if user is not None else UserComm()  # the group's ``set_*`` choices
        self.follows_dtype = (True, True)  # (compute, reduce) follow ``dtype`` on ``rebind``
        self.reduce = BucketReduce(self)
        self.commit = GradCommit(self)
        self.gloo: GlooStrategy | None = None  # gloo's own strategies (``gloo.py``); None elsewhere
        self.in_place: InPlace | None = None  # ``gloo.in_place``, where it applies
        self.offload = offload
        self.device = device  # where gathers and reduces run (the shards' too, without offload)
        self._allocate_sharded(originals, device)

    # ------------------------------------------------------------------ storage
    def _allocate_sharded(self, originals: list[torch.Tensor], device: torch.device) -> None:
        """Each parameter's shard from ``originals``: its full value, or (re-bucketing)
        its current sharded parameter."""
        device = self.shard_home(device)
        self.sharded_flat = self._new_sharded_flat(self.dtype, device)
        with torch.no_grad():
            for p, orig in zip(self.params, originals):
                own = orig is p.sharded  # already this rank's rows
                value = orig._local_tensor if own else orig  # type: ignore[attr-defined]
                if p.dispatched:
                    local = p.dispatch_shard(value.detach(), device)
                else:
                    local = self.local_view(p)
                    if device.type == "meta" or orig.device.type == "meta":
                        pass
                    elif own:
                        rows = p.wrapper.inner(value) if p.wrapper is not None else value
                        local.copy_(rows.reshape(local.shape))
                    else:
                        local.copy_(p.local_chunk(orig.detach()))
                p.set_sharded(p.new_sharded(local, orig.requires_grad))
        self._allocate_unsharded()

    def _new_sharded_flat(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Room for every shard, or none when the shards hold their own storage (a bucket
        of subclasses sharded through their own ops: ``FSDPParam.dispatched``)."""
        own = all(p.dispatched for p in self.params)
        numel = 0 if own else self.shard_numel + len(self.scalars)
        if self.offload is not None and device.type != "meta":
            return self.offload.zeros(numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=device)

    def shard_home(self, device: torch.device) -> torch.device:
        """Where the shards live when gathers run on ``device``: the host when offloaded."""
        return device if self.offload is None else self.offload.home(device)

    def _allocate_unsharded(self) -> None:
        world = self.comm.shard_size
        numel = world * self.shard_numel + len(self.scalars)
        # On one rank without a dtype change both layouts coincide: the unsharded
        # parameters are the shards themselves, and unshard/reshard do nothing.
        self.gather_is_identity = (
            world == 1 and self.compute_dtype == self.dtype and not self.extension and self.offload is None
        )
        self.extension_gather = ExtensionGather(self) if self.extension else None
        # On gloo, large buckets gather and reduce in place, in the unsharded storage:
        # no pooled buffer, no copy-out, no temporary inside gloo's all-gather.
        self.gloo = GlooStrategy.for_bucket(self)
        self.in_place = self.gloo.in_place if self.gloo is not None else None
        # Room after the parameters for the reduce's "used" flags, one per parameter.
        extra = len(self.params) if self.in_place is not None else 0
        if self.gather_is_identity:
            flat = self.sharded_flat
        else:
            flat = torch.empty(numel + extra, dtype=self.compute_dtype, device=self.device)
        self._unsharded_numel = numel + extra
        self.unsharded_flat = flat
        # Writes go through ``.data``, which has its own version counter: re-gathering
        # in backward must not look like an in-place change to the views autograd saved.
        self.unsharded_write = flat.data
        # Each sharded parameter's ``W x shard_numel`` region of the unsharded storage:
        # where the gathered blocks land, and in place where each rank's shard goes.
        self.regions = [
            self.unsharded_write[world * p.offset : world * (p.offset + p.shard_numel)].view(
                world, p.shard_numel
            )
            for p in self.sharded_params
        ]
        self.unsharded_views = [self._unsharded_view(flat, p) for p in self.params]
        # The same views written through ``.data``: gathers copy other dims' blocks out
        # into them, and in place the gradients go there for the reduce.
        self.write_views = [self._unsharded_view(self.unsharded_write, p) for p in self.params]
        # The unsharded parameters: leaves over these views, whose ``.grad`` autograd
        # accumulates by whatever path the module's computation took.
        for p, view in zip(self.params, self.unsharded_views):
            p.set_unsharded(view)
        self.update_direct()
        # How many references to the unsharded storage are our own (the tensors above);
        # any more means some tensor outside, e.g. one autograd saved, can still read it.
        self._own_storage_refs = _storage_refs(flat)
        self.free_unsharded()

    def update_direct(self) -> None:
        """One rank, no dtype change on the way in or out, no user hook or collective: the
        leaves alias the shards and ``commit_direct`` hands their gradients to the sharded
        parameters, as in local training: nothing to gather or reduce."""
        self.direct = (
            self.gather_is_identity
            and self.reduce_dtype == self.grad_dtype == self.dtype
            and not self.comm.is_hsdp
            and self.reduce.is_plain
        )

    def _unsharded_view(self, flat: torch.Tensor, p: FSDPParam) -> torch.Tensor:
        if p.is_replicated:
            return flat[self.comm.shard_size * self.shard_numel + (p.offset - self.shard_numel)].view(())
        start = self.comm.shard_size * p.offset
        return flat[start : start + p.layout.shape.numel()].view(p.layout.shape)

    def optimizer_flat_alias(self) -> torch.Tensor:
        """A plain tensor sharing the sharded flat buffer, stepped by the optimizer in
        place of all of this bucket's parameters (``fsdp2.optim.local_step``)."""
        if self._flat_alias is None or self._flat_alias[0] is not self.sharded_flat:
            self._flat_alias = (self.sharded_flat, self.sharded_flat.detach())
        return self._flat_alias[1]

    def local_view(self, p: FSDPParam) -> torch.Tensor:
        """``p``'s real rows inside the sharded flat buffer, over a storage of their own
        (``own_storage_view``)."""
        if p.is_replicated:
            return own_storage_view(self.sharded_flat, p.offset, ())
        return own_storage_view(self.sharded_flat, p.offset, tuple(p.local_shape))

    @property
    def storage_lent(self) -> bool:
        """The unsharded storage holds gradients being reduced in place (gloo)."""
        return self.in_place is not None and self.in_place.lent

    def lend_storage(self) -> None:
        """Nothing reads the gathered parameters any more: gloo's in-place strategy may
        sum the gradients in their storage. A no-op elsewhere or with a user's reduce."""
        if self.in_place is not None and self.reduce.is_plain:
            self.in_place.lend(self.reduce)

    def free_unsharded(self, even_kept: bool = False) -> None:
        """Release the unsharded storage, unless the user asked to keep it
        (``set_keep_unsharded_storage``: its data pointers then stay the same until the
        keep is turned off or ``module._apply`` makes new storage) and ``even_kept`` is
        False (``fsdp2.release_memory``: the next gather allocates it anew)."""
        if self.extension_gather is not None:
            self.extension_gather.free()
        if self.user.keep_unsharded_storage and not even_kept:
            return
        if not self.gather_is_identity and not self.storage_lent:
            self.unsharded_flat.untyped_storage().resize_(0)

    def alloc_unsharded(self) -> None:
        if self.gather_is_identity or self.extension:
            return  # an extension's unsharded tensors are its fsdp_post_all_gather's
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
        device and dtype, and point the parameters back at it. Nothing of ours keeps the
        old storage (the optimizer's aliases of it go)."""
        self._flat_alias = None
        for p in self.params:
            p.forget_alias()
        # What the first owner registers: our sharded parameter, as ``_apply`` left it.
        current = [cast(torch.Tensor, p.owners[0][0]._parameters[p.owners[0][1]]) for p in self.params]
        locals_ = [c.to_local() if isinstance(c, torch.distributed.tensor.DTensor) else c for c in current]
        device, dtype = locals_[0].device, locals_[0].dtype
        # Offloaded, gathers stay on the mesh's device wherever ``_apply`` put the shards.
        self.device = device if self.offload is None or device.type == "meta" else self.offload.compute
        device = self.shard_home(device)
        follow_compute, follow_reduce = self.follows_dtype
        if follow_compute:
            self.compute_dtype = dtype
        if follow_reduce:
            self.reduce_dtype = dtype
        if not self.params[0].explicit_grad_dtype:  # the gradients follow the parameters
            self.grad_dtype = dtype
        self.dtype = dtype
        for p in self.params:  # before ``new_sharded``, which reads them
            p.dtype = dtype
            p.grad_dtype = self.grad_dtype
        self.sharded_flat = self._new_sharded_flat(dtype, device)
        with torch.no_grad():
            for p, param, local in zip(self.params, current, locals_):
                if p.dispatched:
                    view = p.dispatch_shard(local, device)
                else:
                    view = self.local_view(p)
                    if device.type != "meta":
                        if p.wrapper is not None:
                            local = p.wrapper.inner(local)
                        view.copy_(local.reshape(view.shape))
                grad = param.grad
                fresh = p.new_sharded(view, param.requires_grad)
                # Swap rather than ``.data =``: a DTensor keeps its local tensor in a Python
                # attribute that ``.data`` would not update; the object stays the same.
                torch.utils.swap_tensors(param, fresh)
                if grad is not None:
                    param.grad = grad
                p.set_sharded(param)  # type: ignore[arg-type]
                p.register_sharded()
        self._allocate_unsharded()

    # --------------------------------------------------------------- all-gather
    def start_all_gather(self, from_partial: bool, after: torch.futures.Future | None = None) -> None:
        """Phase 1 of unshard (``BucketGather.start``), from the rows kept after forward
        when ``from_partial``."""
        self.gather.start(from_partial, after)

    def finish_all_gather(self) -> None:
        """Phase 2 of unshard (``BucketGather.finish``)."""
        self.gather.finish()

    def reshard(self) -> None:
        # Never free memory a collective still writes (or a deferred one will).
        if self.gather.in_flight():
            self.gather.finish()
        self.gather.partial = None
        self.kept.clear()
        self.free_unsharded()

    def reshard_partial(self, factor: int) -> None:
        """Keep only the ranks ``[index*W/factor, (index+1)*W/factor)`` of the gathered
        rows, so the backward all-gather runs over ``factor`` ranks only. (All-gather
        extensions gather whole, and so do the buckets their gather carries; a factor of
        the whole shard group means all: those buckets reshard fully.)"""
        target = None if self.extension or self.gather.rides else self.gather.partial_target(factor)
        if target is None:
            self.reshard()
            return
        keep = self.gather.kept_rows(target)
        self.free_unsharded()
        self.gather.partial, self.gather.target = keep, target

    def comm_numel(self) -> int:
        """One size for this bucket's all-gather output and reduce input: the pool serves
        both from the same buffer."""
        return self.comm.shard_size * max(self.shard_numel, self.reduce.layout().numel)

    def drop_state(self) -> None:
        """Forget deposited gradients and any collective in flight (after an exception)."""
        try:
            self.reduce.drop()
        finally:
            self.gather.drop()


class KeptCopy:
    """Whether the parameters a forward left gathered (the root, the kept last block,
    ``reshard_after_forward=False`` or an int) still match the shards: an optimizer step
    or a load in between makes them stale, and the next forward gathers afresh."""

    def __init__(self, bucket: FlatBucket) -> None:
        self.bucket = bucket
        self.version: int | None = None  # the shards' version when the copy was kept

    def remember_shards_version(self) -> None:
        """A forward ends with the gathered (or partially kept) parameters left in place."""
        self.version = None if self.bucket.gather_is_identity else self._shards_version()

    def clear(self) -> None:
        self.version = None

    def is_stale(self) -> bool:
        return self.version is not None and self._shards_version() != self.version

    def _shards_version(self) -> int:
        """Grows with every write to the shards: through the flat buffer (a flat optimizer
        step), a local shard (``to_local()``, a per-parameter step) or the DTensor itself
        (an in-place DTensor op, ``load_state_dict``). DTensor ops run below autograd, so
        these are three separate version counters."""
        b = self.bucket
        version = b.sharded_flat._version
        for p in b.params:
            version += p.sharded._version + p.sharded._local_tensor._version  # type: ignore[union-attr]
        return version


def comm_pools(buckets: list[FlatBucket]) -> list[BufferPool]:
    """The pools ``buckets`` take their communication buffers from, each once."""
    return list({id(b.comm.pool): b.comm.pool for b in buckets}.values())


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


