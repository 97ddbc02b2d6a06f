"""Stateless collectives on flat buffers.

Every function takes its tensors and process group explicitly, labels itself for the
profiler, and returns a NamedTuple; none of them keeps state or reads a caller's fields.

Debug mode (``FSDP2_DEBUG_COLLECTIVES=1``): before each collective, the ranks exchange
what they are about to issue (operation, group name, element count) and every rank
raises a ``RuntimeError`` showing the difference if they disagree, instead of hanging
or silently mixing up data (e.g. when a data-dependent branch runs different groups).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.profiler import record_function

if TYPE_CHECKING:
    from typing import TypeVar

    T = TypeVar("T")

_profiler_enabled = torch._C._autograd._profiler_enabled
_UNLABELED = contextlib.nullcontext()


def traced(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a profiler records, else nothing: entering one
    costs ~7 us even with no profiler, and a step enters hundreds."""
    return record_function(name) if _profiler_enabled() else _UNLABELED


def debug_enabled() -> bool:
    return os.environ.get("FSDP2_DEBUG_COLLECTIVES", "0") not in ("", "0")


class Pending(NamedTuple):
    """An issued collective: ``work`` is None when it completed synchronously.

    ``result`` may be read only after ``wait_pending`` returned. ``rows``: for a reduce
    run as an all-to-all, the received rows that ``wait_pending`` sums into ``result``
    (with ``combine(rows, result)`` when given: a quantized reduce dequantizes them).
    """

    work: dist.Work | None
    result: torch.Tensor
    label: str
    rows: torch.Tensor | None = None
    combine: Callable[[torch.Tensor, torch.Tensor], object] | None = None


class GatherQueue:
    """The order of one rank's in-place all-gathers.

    In-place all-gathers can be deferred behind a reduce still in flight and then issued
    from the thread that completes it (``issue_after``). They run on a process group of
    their own (``gather_group``), so no other collective, fsdp2's or the user's, shares
    their order; among themselves they keep program order on every rank: a deferred
    gather waits for the previous deferred one, and one issued directly waits for all.
    """

    def __init__(self) -> None:
        self._deferred: list[torch.futures.Future] = []
        self._issuer = threading.local()  # which thread is issuing a deferred gather

    def issue_after(self, future: torch.futures.Future, issue: Callable[[], object]) -> torch.futures.Future:
        """Run ``issue()``, which issues an in-place all-gather, once ``future`` and every
        earlier deferred issue completed (on the thread that completes the last of them).
        The returned future completes when it has been issued."""
        prev = self._deferred[-1] if self._deferred else None
        ready = torch.futures.collect_all([future, prev]) if prev is not None else future
        issuer = self._issuer

        def run(done: torch.futures.Future) -> object:
            for upstream in done.value() if prev is not None else [done]:
                upstream.value()  # an error upstream: this issue is abandoned and reports it
            if getattr(issuer, "registering", False):  # ran inline: everything before it is issued
                return issue()
            issuer.deferred = True
            try:
                return issue()
            finally:
                issuer.deferred = False

        issuer.registering = True
        try:
            issued = ready.then(run)
        finally:
            issuer.registering = False
        self._deferred.append(issued)
        return issued

    def in_order(self) -> None:
        """Before issuing an in-place all-gather: the deferred ones go first."""
        if getattr(self._issuer, "deferred", False):
            return  # a deferred issue: the ones before it are issued already
        while self._deferred:
            head = self._deferred.pop(0)
            _wait(head.wait, "a deferred all-gather")

    def drain(self) -> None:
        """Wait for every deferred issue, reporting nothing (the process is exiting: an
        error was reported where it happened)."""
        while self._deferred:
            head = self._deferred.pop(0)
            try:
                head.wait()
            except Exception:  # noqa: BLE001
                pass


def wait_pending(pending: Pending) -> torch.Tensor:
    """Block until the collective finished; then its result may be read."""
    if pending.work is not None:
        _wait(pending.work.wait, pending.label)
    if pending.rows is not None:
        (pending.combine or sum_rows)(pending.rows, pending.result)
    return pending.result


def then(pending: Pending, fn: Callable[[], T]) -> torch.futures.Future[T]:
    """Run ``fn()`` once the collective completed: on the backend's own thread when it
    completes there (gloo on CPU), so memory ``fn`` frees is freed while the caller
    computes. The future holds ``fn``'s result."""
    if pending.work is None:
        done: torch.futures.Future[T] = torch.futures.Future()
        done.set_result(fn())
        return done

    def run(done: torch.futures.Future) -> T:
        done.value()  # re-raises if the collective failed; fn then does not run
        return fn()

    return pending.work.get_future().then(run)


def wait_future(future: torch.futures.Future[T], label: str) -> T:
    """``wait_pending`` for a future from ``then``: its value, or its error explained."""
    return _wait(future.wait, label)


def _wait(wait: Callable[[], T], label: str) -> T:
    with traced("fsdp2::wait"):
        try:
            return wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"fsdp2: {label} did not complete: {e}. If it timed out, the ranks "
                "probably ran different groups (e.g. a data-dependent branch); rerun with "
                "FSDP2_DEBUG_COLLECTIVES=1 to see where they diverge"
            ) from e


def check_same_collective(group: dist.ProcessGroup, label: str, numel: int) -> None:
    """Debug mode: raise on every rank if the ranks are about to issue different collectives."""
    mine = (label, numel)
    everyone: list[tuple[str, int] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != mine for other in everyone):
        lines = "\n".join(f"  rank {r}: {lbl} ({n} elements)" for r, (lbl, n) in enumerate(everyone))  # type: ignore[misc]
        raise RuntimeError(
            "fsdp2: ranks disagree on the next collective:\n" + lines + "\nEvery rank must run the "
            "same fully_shard modules in the same order each step (check data-dependent branches)"
        )


# Collectives are issued on the process group itself, asynchronously, with options made
# once: ``torch.distributed``'s wrappers add ~18 us of Python a call (argument checks,
# exception logging, coalescing bookkeeping) that tensors fsdp2 laid out itself do not
# need; on the 32-block benchmark that was ~3% of a step (98 collectives).
_ALL_GATHER = c10d.AllgatherOptions()
_ALL_GATHER.asyncOp = True
_ALL_REDUCE = c10d.AllreduceOptions()
_ALL_REDUCE.asyncOp = True
_ALL_TO_ALL = c10d.AllToAllOptions()
_ALL_TO_ALL.asyncOp = True
_REDUCE_SCATTER = c10d.ReduceScatterOptions()
_REDUCE_SCATTER.asyncOp = True
# The process group's flat collectives by their torch 2.13 names or, on earlier releases
# (the GPU machines' torch 2.11), by their older ones, which take the same arguments.
# Names, looked up on each call: what patches the class (a test's counter) is seen.
_ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist.ProcessGroup, "all_gather_single") else "_allgather_base"
_REDUCE_SCATTER_SINGLE = (
    "reduce_scatter_single" if hasattr(dist.ProcessGroup, "reduce_scatter_single") else "_reduce_scatter_base"
)
_ALL_TO_ALL_SINGLE = "all_to_all_single" if hasattr(dist.ProcessGroup, "all_to_all_single") else "alltoall_base"


def _real(t: torch.Tensor) -> torch.Tensor:
    """Backends exchange complex tensors as their real view (as ``torch.distributed`` does)."""
    return torch.view_as_real(t) if t.is_complex() else t


def all_gather_flat(shard: torch.Tensor, output: torch.Tensor, group: dist.ProcessGroup, label: str) -> Pending:
    """All-gather equal flat shards into ``output`` (``world * shard.numel()``), rank-major."""
    with traced("fsdp2::all_gather"):
        if output.numel() == shard.numel():  # a group of one rank: nothing to exchange
            output.copy_(shard)
            return Pending(None, output, label)
        if debug_enabled():
            check_same_collective(group, label, output.numel())
        work = getattr(group, _ALL_GATHER_SINGLE)(_real(output), _real(shard), _ALL_GATHER)
    return Pending(work, output, label)


def all_gather_in_place(flat: torch.Tensor, group: dist.ProcessGroup, queue: GatherQueue, label: str) -> Pending:
    """All-gather as an in-place sum: every rank wrote its own rows of ``flat`` and
    filled the rest with -0.0, the one value that leaves any float unchanged when
    added to it (``x + -0.0 == x`` bit for bit, +0.0 included; a NaN stays a NaN), so
    the sum is exactly the gathered tensor. Used on gloo, whose all-gather stages the whole output
    in a temporary and copies it; this writes straight into the caller's layout. ``queue``
    orders it after the rank's deferred in-place gathers."""
    queue.in_order()
    with traced("fsdp2::all_gather"):
        if debug_enabled():
            check_same_collective(group, label, flat.numel())
        work = group.allreduce([_real(flat)], _ALL_REDUCE)
    return Pending(work, flat, label)


def all_reduce_in_place(flat: torch.Tensor, group: dist.ProcessGroup, label: str) -> Pending:
    """Sum ``flat`` over ranks in place (gradients laid out however the caller likes)."""
    with traced("fsdp2::reduce_scatter"):
        if debug_enabled():
            check_same_collective(group, label, flat.numel())
        work = group.allreduce([_real(flat)], _ALL_REDUCE)
    return Pending(work, flat, label)


def reduce_scatter_flat(
    input2d: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    method: str,
    scratch: torch.Tensor | None,
    label: str,
) -> Pending:
    """Sum ``input2d`` (``world x n``) over ranks, asynchronously; the result is this
    rank's row (a view of ``input2d`` except for ``"reduce_scatter"``). ``method``:

    * ``"reduce_scatter"``: ``reduce_scatter_single`` (NCCL).
    * ``"all_reduce"``: in place; every rank holds every row afterwards (NCCL, when
      replicated values must be bitwise equal on every rank: the caller reads row 0).
    * ``"all_to_all"`` (gloo): row ``r`` goes to rank ``r`` into ``scratch`` (``world x
      n``), which ``wait_pending`` sums row by row, in rank order, into this rank's row
      of ``input2d`` (on the caller's thread: a Python callback on gloo's thread would
      contend for the GIL, which made the 32-block benchmark ~4% slower). Same
      bytes on the wire as a reduce-scatter; on gloo, for 25k-1.5M elements per rank,
      1.3-2x faster than its all-reduce at 2 ranks and 2-4x at 4, with less CPU
      (tools/bench_collectives.py). Every rank adds the same values in the same order,
      so columns every rank wrote alike (flags, replicated scalars) come out bitwise
      equal everywhere.
    """
    with traced("fsdp2::reduce_scatter"):
        if input2d.shape[0] == 1:  # a group of one rank: the sum is the input
            return Pending(None, input2d[0], label)
        if debug_enabled():
            check_same_collective(group, label, input2d.numel())
        if method == "all_to_all":
            if scratch is None:
                raise AssertionError("fsdp2 internal error: all-to-all reduce without scratch")
            work = getattr(group, _ALL_TO_ALL_SINGLE)(_real(scratch), _real(input2d), [], [], _ALL_TO_ALL)
            return Pending(work, input2d[rank], label, rows=scratch)
        if method == "all_reduce":
            work = group.allreduce([_real(input2d)], _ALL_REDUCE)
            return Pending(work, input2d[rank], label)
        output = torch.empty(input2d.shape[1], dtype=input2d.dtype, device=input2d.device)
        work = getattr(group, _REDUCE_SCATTER_SINGLE)(_real(output), _real(input2d.view(-1)), _REDUCE_SCATTER)
        return Pending(work, output, label)


def all_to_all_rows(
    send: torch.Tensor,
    recv: torch.Tensor,
    group: dist.ProcessGroup,
    result: torch.Tensor,
    combine: Callable[[torch.Tensor, torch.Tensor], object],
    label: str,
) -> Pending:
    """Row ``r`` of ``send`` (``world x n``) goes to rank ``r``, into ``recv``; then
    ``wait_pending`` runs ``combine(recv, result)`` on the caller's thread (a reduce of
    encoded rows: ``fsdp2.bucket.quant``)."""
    with traced("fsdp2::reduce_scatter"):
        if debug_enabled():
            check_same_collective(group, label, send.numel())
        work = getattr(group, _ALL_TO_ALL_SINGLE)(recv, send, [], [], _ALL_TO_ALL)
    return Pending(work, result, label, rows=recv, combine=combine)


def sum_rows(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = rows[0] + rows[1] + ...``, in this order on every rank."""
    with traced("fsdp2::sum_rows"):
        torch.add(rows[0], rows[1], out=out)
        for row in rows[2:]:
            out.add_(row)
    return out
