"""What collectives deliver under ``fsdp2.estimate``: as if every rank held what this one does.

The fake process group moves no data, so a gathered parameter would hold whatever the
memory held and an all-to-all's output nothing at all. Dense models compute the same
either way; a Mixture-of-Experts does not: its router reading such weights sends every
token to the same experts, and its token dispatch sizes the next exchange from counts
it received. Here every rank is taken to hold this rank's data:

* fsdp2's all-gather fills rank ``r``'s rows with this rank's shard rotated by ``r``
  (rows such as a router's then differ) and its reduce-scatter returns ``W`` times this
  rank's own row (gradients of the real scale, finite);
* an all-to-all (``dist.all_to_all_single`` and the functional ones) delivers from each
  peer the chunk this rank sends itself: routing as balanced as this rank's own.

None of this allocates a tensor the real collective would not (the estimate's tracker
counts every one). Only the estimate switches these on, for its run, and switches them
off again (``symmetric_collectives`` returns the undo). Code that bound the functional
all-to-alls by name before the estimate started keeps the originals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh

from ..bucket import gather as _gather
from ..bucket import reduce as _reduce


def symmetric_collectives() -> Callable[[], None]:
    """Switch the collectives above to their symmetric stand-ins; returns the undo."""
    saved = (_gather.all_gather_flat, _reduce.reduce_scatter_flat, dist.all_to_all_single,
             funcol.all_to_all_single, funcol.all_to_all_single_autograd)
    gather, reduce, all_to_all = saved[:3]

    def all_gather_flat(shard: torch.Tensor, output: torch.Tensor, group: Any, label: str) -> Any:
        pending = gather(shard, output, group, label)
        n = shard.numel()
        if n and output.numel() > n:
            flat = shard.reshape(-1)
            with torch.no_grad():  # two slice copies per row: no temporary
                for r, row in enumerate(output.view(-1, n)):
                    k = r * 7919 % n
                    row[: n - k].copy_(flat[k:])
                    row[n - k :].copy_(flat[:k])
        return pending

    def reduce_scatter_flat(input2d: torch.Tensor, group: Any, rank: int, method: str, scratch: Any, label: str) -> Any:
        pending = reduce(input2d, group, rank, method, scratch, label)
        if input2d.shape[0] > 1:
            with torch.no_grad():
                pending.result.copy_(input2d[rank]).mul_(input2d.shape[0])
        return pending

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
        work = all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        with torch.no_grad():
            _fill_symmetric(output, input, output_split_sizes, input_split_sizes, group)
        return work

    def functional_all_to_all(input: torch.Tensor, output_split_sizes: Any, input_split_sizes: Any, group: Any,
                              tag: str = "") -> torch.Tensor:
        """Differentiable: the real op's output, built from this rank's own chunk."""
        return _Symmetric.apply(input, output_split_sizes, input_split_sizes, group)

    _gather.all_gather_flat, _reduce.reduce_scatter_flat = all_gather_flat, reduce_scatter_flat
    dist.all_to_all_single = distributed_c10d.all_to_all_single = all_to_all_single
    funcol.all_to_all_single = funcol.all_to_all_single_autograd = functional_all_to_all  # type: ignore[assignment]

    def undo() -> None:
        _gather.all_gather_flat, _reduce.reduce_scatter_flat = saved[0], saved[1]
        dist.all_to_all_single = distributed_c10d.all_to_all_single = saved[2]
        funcol.all_to_all_single, funcol.all_to_all_single_autograd = saved[3], saved[4]

    return undo


def _group_of(group: Any) -> Any:
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise NotImplementedError(
            f"fsdp2.estimate: an all-to-all over {group!r}; the estimate knows process groups and "
            "device meshes (pass one of those to the functional collective)"
        )
    return group


def _chunks(t: torch.Tensor, sizes: Any, n: int) -> list[torch.Tensor]:
    return list(t.split(list(sizes) if sizes else t.shape[0] // n))


def _fill_symmetric(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any, input_split_sizes: Any,
                    group: Any) -> None:
    """From each peer, the chunk this rank sends itself (its first rows, zeros after)."""
    group = _group_of(group)
    n, me = dist.get_world_size(group), dist.get_rank(group)
    own = _chunks(input, input_split_sizes, n)[me]
    for chunk in _chunks(output, output_split_sizes, n):
        rows = min(chunk.shape[0], own.shape[0])
        chunk[:rows].copy_(own[:rows])
        chunk[rows:].zero_()


class _Symmetric(torch.autograd.Function):
    """The functional all-to-all's stand-in: forward fills the output symmetrically;
    backward sends each gradient chunk's rows back into this rank's own chunk."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, output_split_sizes: Any, input_split_sizes: Any, group: Any) -> torch.Tensor:
        n = dist.get_world_size(_group_of(group))
        rows = sum(output_split_sizes) if output_split_sizes else input.shape[0]
        output = input.new_empty(rows, *input.shape[1:])
        _fill_symmetric(output, input, output_split_sizes, input_split_sizes, group)
        ctx.sizes, ctx.n, ctx.group = (output_split_sizes, input_split_sizes), n, group
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        output_split_sizes, input_split_sizes = ctx.sizes
        rows = sum(input_split_sizes) if input_split_sizes else grad.shape[0]
        grad_input = grad.new_empty(rows, *grad.shape[1:])
        _fill_symmetric(grad_input, grad, input_split_sizes, output_split_sizes, ctx.group)
        return grad_input, None, None, None
