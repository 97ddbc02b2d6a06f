"""What the user set on a group's communication through ``FSDPModule``'s ``set_*``
methods: one object per group, shared by its buckets (buckets built anew at lazy init
share it too, so nothing is copied over)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class UserComm:
    all_gather: Any = None  # ``set_custom_all_gather``'s collective, if any
    reduce_scatter: Any = None  # ``set_custom_reduce_scatter``'s collective, if any
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None  # ``set_all_reduce_hook``'s
    # ``set_reduce_scatter_unused_params(True)``: parameters no rank computed a gradient
    # for get zeros (reduced like the others) instead of None.
    zero_unused: bool = False
    # ``set_keep_unsharded_storage(True)``: resharding keeps the unsharded storage (its
    # data pointers stay the same across steps, for CUDA graph capture).
    keep_unsharded_storage: bool = False
