"""What the user set on a group's communication through ``FSDPModule``'s ``set_*``
methods: one object per group, shared by its buckets (buckets built anew at lazy init
share it too, so nothing is copied over)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist


class AllGatherComm(Protocol):
    """torch's ``AllGather`` protocol, as fsdp2 calls it (``set_custom_all_gather``)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, /,
                 async_op: bool = False) -> dist.Work | None: ...


class ReduceScatterComm(Protocol):
    """torch's ``ReduceScatter`` protocol, as fsdp2 calls it (``set_custom_reduce_scatter``)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: dist.ReduceOp | dist.ReduceOp.RedOpType, /, async_op: bool = False) -> dist.Work | None: ...


@dataclass
class UserComm:
    all_gather: AllGatherComm | None = None  # ``set_custom_all_gather``'s collective, if any
    reduce_scatter: ReduceScatterComm | None = None  # ``set_custom_reduce_scatter``'s collective, if any
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # ``set_all_reduce_hook``'s
    # ``set_reduce_scatter_unused_params(True)``: parameters no rank computed a gradient
    # for get zeros (reduced like the others) instead of None.
    zero_unused: bool = False
    # ``set_keep_unsharded_storage(True)``: resharding keeps the unsharded storage (its
    # data pointers stay the same across steps, for CUDA graph capture).
    keep_unsharded_storage: bool = False
