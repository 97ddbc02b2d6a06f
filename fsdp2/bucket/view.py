"""What a bucket's helpers read of it.

``bucket.FlatBucket`` owns its all-gather (``gather.BucketGather``), its reduce
(``reduce.BucketReduce``), its commit (``commit.GradCommit``), its gloo in-place
strategy (``in_place.InPlace``) and its subclass gather (``extension.ExtensionGather``),
and hands itself to each. They read it through this protocol rather than importing
``bucket.py``: the folder then reads bottom-up (see CONTRIBUTING.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..api import MixedPrecisionPolicy
from ..comm.mesh import MeshInfo
from ..params.param import FSDPParam
from .offload import HostOffload
from .quant.spec import QuantizedComm
from .user_comm import UserComm


class BucketView(Protocol):
    params: list[FSDPParam]  # the bucket's parameters, in flat order
    sharded_params: list[FSDPParam]  # those that shard (the rest: replicated scalars)
    scalars: list[FSDPParam]
    comm: MeshInfo
    name: str  # for messages
    dtype: torch.dtype  # the parameters'
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    grad_dtype: torch.dtype  # the sharded gradients' (the parameters' ``grad_dtype``)
    device: torch.device  # where gathers and reduces run
    offload: HostOffload | None
    shard_numel: int  # S: the sum of the padded shard sizes
    blocks_are_the_values: bool  # every parameter shards on dim 0
    extension: bool  # subclasses with an all-gather extension
    sharded_flat: torch.Tensor
    unsharded_flat: torch.Tensor
    unsharded_write: torch.Tensor  # ``unsharded_flat.data``
    regions: list[torch.Tensor]  # each sharded parameter's W x shard_numel region
    write_views: list[torch.Tensor]
    reduce: Any  # its ``BucketReduce``
    commit: Any  # its ``GradCommit``
    in_place: Any  # its ``InPlace`` strategy, or None
    gloo: Any  # its ``GlooStrategy``, or None off gloo
    gather_is_identity: bool  # one rank, one dtype: the shards are the unsharded values
    extension_gather: Any  # its ``ExtensionGather``, or None
    user: UserComm  # the group's ``set_*`` choices
    mp_policy: MixedPrecisionPolicy | None  # the group's ``MixedPrecisionPolicy`` (for ``fsdp_pre_all_gather``)
    gather: Any  # its ``BucketGather``
    quant: QuantizedComm  # its ``quant.spec.QuantizedComm``: what the policy asks to quantize

    @property
    def storage_lent(self) -> bool: ...  # ``in_place`` holds the unsharded storage for a reduce
    @property
    def riders(self) -> Sequence[BucketView]: ...  # buckets whose rows its extension gather carries

    def comm_numel(self) -> int: ...
    def alloc_unsharded(self) -> None: ...
    def free_unsharded(self, even_kept: bool = False) -> None: ...
