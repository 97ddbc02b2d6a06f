"""The all-gather extension of tensor subclasses (torch's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` protocol, used e.g. by torchao's float8 weights).

A parameter whose local tensor defines both methods keeps its class when sharded, in one
of three ways. A subclass wrapping one tensor with the standard ``__tensor_unflatten__``
(``SubclassWrapper``) is rebuilt around its rows of the bucket's sharded flat buffer, so
the bucket owns the storage as for plain parameters (``params/subclass.py``). A plain tensor
whose hooks were bound to the object after ``fully_shard`` (instance methods, as torch's
tests do; noticed at lazy init, when the group re-buckets it) stays that object, its data
re-pointed at the flat buffer (``KeepObject``). Any other subclass (several inner tensors,
an unflatten of its own) is sharded through its own ops, as torch shards it
(``FSDPParam.dispatch_shard``): its shard owns its storage, and the bucket, which holds
only such parameters, has an empty flat buffer. Either way the (plain) gradients are
reduced as usual.

Its gather is the subclass's, called on the parameter's own local tensor
(``param._local_tensor``, the object the user and libraries see and mutate: torchao keeps
its precomputed float8 scale there): ``fsdp_pre_all_gather`` gives the tensors to send
(any dtypes, e.g. float8 data; inputs short of the padded shard's rows, as the
one-argument signature cannot know them, are padded here); ``fsdp_post_all_gather``
builds the unsharded tensor from the gathered outputs (once, then refills it with
``out=``). The hooks run on the thread that runs the forward (or backward), with the
shard dim's 1-D mesh. Such parameters sit in buckets of their own, shard on dim 0 and
are gathered whole (an integer ``reshard_after_forward`` frees them like ``True``).

One all-gather per group and mesh, as torch sends it: the first extension bucket of a
mesh carries its group's other buckets on that mesh (``riders``): their inputs (a
plain bucket's shards in its compute dtype, an extension bucket's hook inputs) travel in
the same collective, as bytes, and their rows are copied out to them when it completes.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, cast

import torch

from ..comm.collectives import Pending, all_gather_flat, traced, wait_pending

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..api import MixedPrecisionPolicy
    from ..params.param import FSDPParam
    from .user_comm import AllGatherComm
    from .view import BucketView


class ExtensionGather:
    """The gather of one bucket of extension parameters, and of its riders."""

    def __init__(self, bucket: BucketView) -> None:
        self.bucket = bucket
        self.outputs: list[list[torch.Tensor]] = [[] for _ in bucket.params]  # per parameter, kept
        self.inners: list[tuple[torch.Tensor, ...]] = [() for _ in bucket.params]  # post's, to free
        self.built = [False for _ in bucket.params]  # post_all_gather ran: refill with out=
        # The subclass's ``fsdp_should_release_all_gather_outputs_after_post_all_gather()``
        # (torch 2.15's hook): its unsharded tensor does not alias the gathered outputs, so
        # they are freed right after ``fsdp_post_all_gather`` instead of at reshard.
        self.release = [_releases_outputs(p) for p in bucket.params]
        self._pending: Pending | None = None
        self._sent: list[tuple[list[torch.Tensor], object]] = []  # inputs, metadata
        self._riding: list[BucketView] = []  # the riders in the gather in flight
        self._buffers: tuple[torch.Tensor, torch.Tensor | None] | None = None  # pooled (send, recv)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def start(self, group: dist.ProcessGroup, mp_policy: MixedPrecisionPolicy | None,
              custom: AllGatherComm | None = None) -> None:
        """Issue the gather of this bucket and its riders; through ``custom``
        (``set_custom_all_gather``) if given."""
        b = self.bucket
        # Riders with rows to gather (``BucketGather.start``'s own test).
        self._riding = [r for r in b.riders if r.shard_numel and not r.gather_is_identity]
        inputs = self.collect(mp_policy)
        for r in self._riding:
            ext = r.extension_gather
            inputs += ext.collect(r.mp_policy) if ext is not None else [r.gather.carried_input()]
        flat_inputs = [t.reshape(-1).view(torch.uint8) for t in inputs]
        numel = sum(t.numel() for t in flat_inputs)
        world, device = b.comm.shard_size, b.device
        send = b.comm.pool.acquire(numel, torch.uint8, device)
        if flat_inputs:
            with traced("fsdp2::copy_in"):
                torch.cat(flat_inputs, out=send)
        label = f"all-gather of {b.name}"
        if custom is not None and world > 1:
            recv = custom.allocate((world * numel,), dtype=torch.uint8, device=device)
            self._buffers = (send, None)
            self._pending = Pending(custom(recv, send, group, async_op=True), recv, label)
            return
        recv = b.comm.pool.acquire(world * numel, torch.uint8, device)
        self._buffers = (send, recv)
        self._pending = all_gather_flat(send, recv, group, label=label)

    def collect(self, mp_policy: MixedPrecisionPolicy | None) -> list[torch.Tensor]:
        """Phase 1: every parameter's all-gather inputs, from its hook (kept for ``take``)."""
        self._sent = [self._pre(p, mp_policy) for p in self.bucket.params]
        return [t for inputs, _ in self._sent for t in inputs]

    def _pre(self, p: FSDPParam, mp_policy: MixedPrecisionPolicy | None) -> tuple[list[torch.Tensor], object]:
        b = self.bucket
        # Its own local tensor, never a rebuilt one: state kept there (torchao's
        # precomputed scale) and hooks bound to it are what the hook must see.
        local = _hooked_local(p)
        hook = local.fsdp_pre_all_gather
        n_args = len(inspect.signature(hook).parameters)
        if n_args == 1:
            inputs, meta = hook(b.comm.shard_mesh)
        elif n_args == 5:
            inputs, meta = hook(b.comm.shard_mesh, p.shape, p.stride, p.owners[0][0], mp_policy)
        else:
            raise TypeError(
                f"{type(local).__name__}.fsdp_pre_all_gather{inspect.signature(hook)}: expected (mesh) or "
                "(mesh, outer_size, outer_stride, module, mp_policy)"
            )
        inputs = [_padded(t, p.layout.chunk, type(local).__name__, p.fqn) for t in inputs]
        return inputs, meta

    def finish(self) -> None:
        """Wait, lay each input's gathered rows out per parameter (and per rider), and
        (re)build the unsharded tensors through ``fsdp_post_all_gather``."""
        if self._pending is None or self._buffers is None:
            raise AssertionError("fsdp2 internal error: no gather")
        b = self.bucket
        gathered = wait_pending(self._pending).view(b.comm.shard_size, -1)
        with traced("fsdp2::copy_out"):
            col = self.take(gathered, 0)
            for r in self._riding:
                ext = r.extension_gather
                col = ext.take(gathered, col) if ext is not None else r.gather.take_carried(gathered, col)
        for buf in self._buffers:
            if buf is not None:
                b.comm.pool.release(buf)
        self._buffers, self._pending = None, None
        self.build()
        for r in self._riding:
            if r.extension_gather is not None:
                r.extension_gather.build()
        self._riding = []

    def take(self, gathered: torch.Tensor, col: int) -> int:
        """Phase 2: copy this bucket's inputs' gathered bytes (``W x bytes``, from column
        ``col``) into each parameter's outputs; returns the next column."""
        world = self.bucket.comm.shard_size
        for i, (inputs, _) in enumerate(self._sent):
            if not self.outputs[i]:
                self.outputs[i] = [t.new_empty((world * t.shape[0], *t.shape[1:])) for t in inputs]
            for t, out in zip(inputs, self.outputs[i]):
                nbytes = t.numel() * t.element_size()
                _realloc(out)
                out.view(world, -1).view(torch.uint8).copy_(gathered[:, col : col + nbytes])
                col += nbytes
        return col

    def build(self) -> None:
        """Phase 3: the unsharded tensors, from ``fsdp_post_all_gather``."""
        b = self.bucket
        for i, (p, (_, meta)) in enumerate(zip(b.params, self._sent)):
            self._post(i, p, meta, b.compute_dtype)
            if self.release[i]:
                for t in self.outputs[i]:
                    t.untyped_storage().resize_(0)
        self._sent = []

    def _post(self, i: int, p: FSDPParam, meta: object, dtype: torch.dtype) -> None:
        local = _hooked_local(p)
        outputs = tuple(self.outputs[i])
        if self.built[i]:
            for t in self.inners[i]:
                _realloc(t)
            with torch.no_grad():
                local.fsdp_post_all_gather(outputs, meta, dtype, out=p.unsharded)
            return
        value, inners = local.fsdp_post_all_gather(outputs, meta, dtype)
        self.inners[i] = tuple(inners)
        p.set_unsharded(torch.as_strided(value, p.shape, p.stride, 0))
        self.built[i] = True

    def free(self) -> None:
        """Reshard: the gathered outputs and the unsharded tensors' storage go."""
        for outs, inners in zip(self.outputs, self.inners):
            for t in (*outs, *inners):
                t.untyped_storage().resize_(0)

    def drop(self) -> None:
        """After an exception: wait for a gather in flight and give its buffers back."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                wait_pending(pending)
        finally:
            for buf in self._buffers or ():
                if buf is not None:
                    self.bucket.comm.pool.release(buf)
            for r in self._riding:  # riders' hook inputs (e.g. float8 data) go too
                if r.extension_gather is not None:
                    r.extension_gather._sent = []
            self._buffers, self._sent, self._riding = None, [], []


def _hooked_local(p: FSDPParam) -> Any:
    """The local tensor of ``p``'s shard: it (or its class) has the all-gather hooks."""
    if p.sharded is None:
        raise AssertionError(f"fsdp2 internal error: {p.fqn} gathers before it is sharded")
    return p.sharded._local_tensor


def _releases_outputs(p: FSDPParam) -> bool:
    """The subclass's answer to ``fsdp_should_release_all_gather_outputs_after_post_all_gather``
    (``False`` without the method), checked as torch 2.15 checks it."""
    local = p.sharded._local_tensor if p.sharded is not None else None
    ask = getattr(local, "fsdp_should_release_all_gather_outputs_after_post_all_gather", None)
    if ask is None:
        return False
    answer = ask()
    if not isinstance(answer, bool):
        raise TypeError(
            f"{type(local).__name__}.fsdp_should_release_all_gather_outputs_after_post_all_gather for "
            f"{p.fqn} must return a bool, got {type(answer).__name__}"
        )
    return answer


def _padded(t: torch.Tensor, rows: int, cls: str, fqn: str) -> torch.Tensor:
    """An all-gather input with the padded shard's ``rows`` on dim 0: one the hook left
    short (a rank whose shard is shorter, e.g. under the one-argument signature, which
    cannot know the padded size) is padded with zeros here, so every rank sends alike
    (raising on the short ranks alone would leave the others waiting in the gather)."""
    if t.dim() == 0 or t.shape[0] > rows:
        raise ValueError(
            f"{cls}.fsdp_pre_all_gather for {fqn} returned an input of shape {tuple(t.shape)}; each input "
            f"must have the padded shard's {rows} rows on dim 0 (or fewer, padded with zeros by fsdp2)"
        )
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _realloc(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() < nbytes + t.storage_offset() * t.element_size():
        storage.resize_(cast(int, nbytes + t.storage_offset() * t.element_size()))
