"""Stateless collectives on flat buffers.

Every function takes its tensors and process group explicitly, labels itself for the
profiler, and returns a NamedTuple; none of them keeps state or reads a caller's fields.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import record_function


class Pending(NamedTuple):
    """An issued collective: ``work`` is None when it completed synchronously.

    ``result`` may be read only after ``wait_pending`` returned.
    """

    work: dist.Work | None
    result: torch.Tensor


def wait_pending(pending: Pending) -> torch.Tensor:
    """Block until the collective finished; then its result may be read."""
    if pending.work is not None:
        with record_function("fsdp2::wait"):
            pending.work.wait()
    return pending.result


def all_gather_flat(
    shard: torch.Tensor, output: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> Pending:
    """All-gather equal flat shards into ``output`` (``world * shard.numel()``), rank-major."""
    with record_function("fsdp2::all_gather"):
        if output.numel() == shard.numel():  # a group of one rank: nothing to exchange
            output.copy_(shard)
            return Pending(None, output)
        work = dist.all_gather_single(output, shard, group=group, async_op=async_op)
    return Pending(work if async_op else None, output)


def reduce_scatter_flat(
    input2d: torch.Tensor,
    group: dist.ProcessGroup,
    rank: int,
    use_all_reduce: bool,
    async_op: bool,
) -> Pending:
    """Sum ``input2d`` (``world x n``) over ranks; the result is this rank's row.

    With ``use_all_reduce`` the sum runs as an in-place all-reduce and the result is
    a view of ``input2d``: on gloo this is about twice as fast as its reduce-scatter
    (measured by tools/bench_collectives.py), though it moves more bytes.
    """
    with record_function("fsdp2::reduce_scatter"):
        if input2d.shape[0] == 1:  # a group of one rank: the sum is the input
            return Pending(None, input2d[0])
        if use_all_reduce:
            work = dist.all_reduce(input2d, group=group, async_op=async_op)
            return Pending(work if async_op else None, input2d[rank])
        output = torch.empty(input2d.shape[1], dtype=input2d.dtype, device=input2d.device)
        work = dist.reduce_scatter_single(output, input2d, group=group, async_op=async_op)
        return Pending(work if async_op else None, output)
