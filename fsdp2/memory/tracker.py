"""Live tensor bytes on this rank, their peak, and what they were at the peak.

``MemoryTracker`` is a dispatch mode: every tensor an op returns has its storage
counted once, from the op that made it until the storage dies (a weak reference to the
storage object, which torch keeps alive as long as the storage). fsdp2 frees and
re-allocates the gathered parameters by resizing their storage in place (no op sees
that), so the resident gathered buffers are re-read after every op. The count is what
the allocator was asked for, on every device together; in a real run on a GPU the
CUDA caching allocator's allocated and reserved bytes at the peak are noted beside it
(``peak_device``: the allocator's overhead).

At the peak the live storages are split by what holds them, found by identity from the
models and optimizers seen so far (``note_module``, ``note_optimizer``):

* sharded parameters: the parameters' local shards (fsdp2's flat sharded buffers);
* unsharded parameters: fsdp2's gathered buffers (and an integer reshard's kept rows);
* gradients: ``.grad`` of the sharded and the gathered parameters, reduced gradients
  not yet committed;
* optimizer state: every tensor in an optimizer's ``state``;
* communication buffers: fsdp2's pooled all-gather / reduce-scatter buffers;
* activations: other storages made during a forward and still alive (what autograd
  saved for backward, mostly);
* other: the rest (temporaries of backward, the batch, buffers, RNG state).

The peak bytes are exact; the split is taken whenever the live bytes rise 0.2% above
the last split's (a split walks the models' tensors), so it describes a moment within
0.2% of the peak and may sum to slightly less than it. A storage over memory another
live storage already holds (a slice of it: fsdp2's shards over their flat buffer) is
not counted again. Storages resized without an op
other than fsdp2's gathered buffers and those freed by ``free_storage`` (an all-gather
extension's outputs) keep the size they had when last seen, and frees on another thread (gloo's, in a ``--measure`` run on
3+ ranks) are counted without a lock.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from .._module import FSDPModule
    from ..bucket.bucket import FlatBucket
    from ..runtime.group import ParamGroup

CATEGORIES = (
    "sharded parameters", "unsharded parameters", "gradients", "optimizer state",
    "communication buffers", "activations", "other",
)
SPLIT_EVERY = 1.002  # a new split when the live bytes pass the last split's by 0.2%


def storage_key(t: torch.Tensor, meta: bool = False) -> tuple[int, torch.UntypedStorage] | None:
    """(an id of ``t``'s storage while it lives, the storage); a DTensor's is its local
    tensor's; None for subclasses without storage, and for meta tensors unless ``meta``."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.device.type == "meta" and not meta:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage._cdata, storage


def storage_data_ptr(storage: torch.UntypedStorage) -> int:
    """Where ``storage``'s bytes start; 0 for a wrapper subclass's storage, which has none."""
    try:
        return storage.data_ptr()
    except RuntimeError:
        return 0


def free_storage(t: torch.Tensor) -> None:
    """Give ``t``'s memory back now, whatever else still references its storage (a
    backend's worker thread drops a finished collective's tensors a moment after
    ``wait()`` returns); a running ``MemoryTracker`` sees the free."""
    storage = t.untyped_storage()
    storage.resize_(0)
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, MemoryTracker):
            mode.resized(storage)


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor bytes; ``phase()`` and ``where()`` (callables) say where the
    step is, for the peak's report."""

    def __init__(self, phase: Callable[[], str], where: Callable[[], str], meta: bool = False,
                 split_every: float = SPLIT_EVERY) -> None:
        super().__init__()
        self.phase, self.where = phase, where
        self.meta = meta  # count meta tensors too (the planner's dry run has no others)
        self.split_every = split_every
        self.live: dict[int, tuple[int, str]] = {}  # storage key -> (bytes, phase made in)
        self._refs: dict[int, weakref.ref] = {}
        self._spans: list[tuple[int, int, int]] = []  # (first byte, end, key) of counted storages, sorted
        self._span_of: dict[int, tuple[int, int, int]] = {}
        self._slices: dict[int, weakref.ref] = {}  # storages over a counted one's memory: not counted
        self.now = 0
        self.peak = 0
        self.ops = 0  # ops seen
        self.peak_split: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_at = ("", "")  # (phase, module) at the peak
        self.peak_device: dict[str, int] = {}  # the CUDA caching allocator's view at the peak
        self._split_at = 0  # live bytes of the last split
        self.modules: weakref.WeakSet = weakref.WeakSet()
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self._gathered: list[FlatBucket] = []  # fsdp2 buckets, for their resized storage
        self._groups: list[ParamGroup] = []  # the fsdp2 groups under the noted modules

    # ------------------------------------------------------------------ counting
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        phase = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                found = storage_key(t, self.meta)
                if found is not None:
                    key, storage = found
                    if key in self._slices:
                        continue
                    if key not in self.live or self.live[key][0] != storage.nbytes():
                        phase = phase or self.phase()
                        self._count(key, storage, phase)
        self._recheck_gathered()
        if self.now > self.peak:
            self._new_peak()
        return out

    def _count(self, key: int, storage: torch.UntypedStorage, phase: str) -> None:
        nbytes = storage.nbytes()
        old = self.live.get(key)
        if old is None:
            if self._within_counted(storage):

                def forget(_: object, key: int = key) -> None:
                    self._slices.pop(key, None)

                self._slices[key] = weakref.ref(storage, forget)
                return
            self._absorb_slices_of(storage)

            def died(_: object, key: int = key) -> None:
                self._died(key)

            self._refs[key] = weakref.ref(storage, died)
            self.live[key] = (nbytes, phase)
            self.now += nbytes
        else:
            self.live[key] = (nbytes, old[1])
            self.now += nbytes - old[0]
            self._forget_span(key)
        start = storage_data_ptr(storage)
        if nbytes and start:
            span = (start, start + nbytes, key)
            self._span_of[key] = span
            bisect.insort(self._spans, span)

    def _within_counted(self, storage: torch.UntypedStorage) -> bool:
        """``storage``'s bytes lie inside a counted storage's (a slice of it), which
        still holds them (not one resized since, without an op)."""
        start, nbytes = storage_data_ptr(storage), storage.nbytes()
        if not start or not nbytes:
            return False
        i = bisect.bisect_right(self._spans, (start, float("inf"), 0)) - 1
        if i < 0 or self._spans[i][1] < start + nbytes:
            return False
        base_start, base_end, key = self._spans[i]
        base = self._refs[key]()
        return base is not None and storage_data_ptr(base) == base_start and base.nbytes() >= base_end - base_start

    def _absorb_slices_of(self, storage: torch.UntypedStorage) -> None:
        """Storages counted before ``storage`` (seen first) that lie inside its memory: its
        slices, counted from now on as part of it."""
        start, nbytes = storage_data_ptr(storage), storage.nbytes()
        if not start or not nbytes:
            return
        i = j = bisect.bisect_left(self._spans, (start, 0, 0))
        while j < len(self._spans) and self._spans[j][0] < start + nbytes:
            j += 1
        for first, end, key in self._spans[i:j]:
            if end > start + nbytes:
                continue
            slice_ = self._refs[key]()
            if slice_ is None or storage_data_ptr(slice_) != first or slice_.nbytes() != end - first:
                self._forget_span(key)  # resized without an op since (fsdp2's gathered buffers): stale
                continue
            self._died(key)

            def forget(_: object, key: int = key) -> None:
                self._slices.pop(key, None)

            self._slices[key] = weakref.ref(slice_, forget)

    def _forget_span(self, key: int) -> None:
        span = self._span_of.pop(key, None)
        if span is not None:
            i = bisect.bisect_left(self._spans, span)
            if i < len(self._spans) and self._spans[i] == span:
                del self._spans[i]

    def _died(self, key: int) -> None:
        entry = self.live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.now -= entry[0]
            self._forget_span(key)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` was resized without an op: count its new size."""
        entry = self.live.get(storage._cdata)
        if entry is not None and entry[0] != storage.nbytes():
            self._count(storage._cdata, storage, entry[1])

    def _recheck_gathered(self) -> None:
        """fsdp2 resizes its gathered buffers' storage without an op: re-read them."""
        for b in self._gathered:
            storage = b.unsharded_flat.untyped_storage()
            key = storage._cdata
            entry = self.live.get(key)
            if entry is not None and entry[0] != storage.nbytes():
                self._count(key, storage, entry[1])

    def _new_peak(self) -> None:
        self.peak = self.now
        if self.now >= self._split_at * self.split_every or self.peak_at[0] != self.phase():
            self._split_at = self.now
            self._note_peak()

    def _note_peak(self) -> None:
        self.peak_split = self.split()
        self.peak_at = (self.phase(), self.where())
        if torch.cuda.is_initialized():  # what the allocator holds beyond live tensors
            self.peak_device = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}

    def reset_peak(self) -> None:
        """Start a new peak (a new step) from what is live now."""
        self.peak = self._split_at = self.now
        self._note_peak()

    # ------------------------------------------------------------------- models
    def note_module(self, module: torch.nn.Module) -> None:
        """A root module whose parameters (and fsdp2 groups under it) to classify."""
        if module in self.modules:
            return
        self.modules.add(module)
        # Found once per module noted (fsdp2.estimate notes each module fully_shard gets).
        self._groups = list({id(g): g for g in (m._fsdp2_state.group for m in self._fsdp_modules())}.values())
        self._gathered = [b for g in self._groups for b in g.buckets]

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizers.add(optimizer)

    def _fsdp_modules(self) -> list[FSDPModule]:
        from .._module import FSDPModule

        found = {id(m): m for root in self.modules for m in root.modules() if isinstance(m, FSDPModule)}
        return list(found.values())

    # ---------------------------------------------------------------- the split
    def split(self) -> dict[str, int]:
        """Live bytes by category (see the module docstring)."""
        owner: dict[int, str] = {}

        def claim(t: object, category: str) -> None:
            if isinstance(t, torch.Tensor):
                found = storage_key(t, self.meta)
                if found is not None:
                    owner.setdefault(found[0], category)

        for g in self._groups:
            claim_group(g, claim)
        for root in self.modules:
            for p in root.parameters():
                claim(p, "sharded parameters")
                claim(p.grad, "gradients")
        for opt in self.optimizers:
            for st in opt.state.values():
                for v in st.values():
                    claim(v, "optimizer state")
        from ..comm.rank import this_rank

        for pool in this_rank().pools():
            for raw in pool.idle_buffers() + pool.buffers_in_use():
                claim(raw, "communication buffers")
        out = dict.fromkeys(CATEGORIES, 0)
        for key, (nbytes, phase) in list(self.live.items()):  # a storage may die meanwhile
            category = owner.get(key) or ("activations" if phase == "forward" else "other")
            out[category] += nbytes
        return out


def claim_group(group: ParamGroup, claim: Callable[[object, str], None]) -> None:
    """One fsdp2 group's tensors, by what they hold."""
    for b in group.buckets:
        claim(b.sharded_flat, "sharded parameters")
        for p in b.params:
            claim(p.sharded, "sharded parameters")
            if p.unsharded is not None:
                claim(p.unsharded.grad, "gradients")
        claim(b.unsharded_flat, "unsharded parameters")
        claim(b.gather.partial, "unsharded parameters")
        claim(b.gather.input, "communication buffers")
        claim(b.gather.buf, "communication buffers")
        claim(b.reduce._unreplicated, "gradients")
        for staged in b.reduce.ready:
            claim(staged[1], "gradients")
            claim(staged[3], "gradients")
