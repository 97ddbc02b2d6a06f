"""What a bucket's helpers read of it.

``bucket.FlatBucket`` owns its all-gather (``gather.BucketGather``), its reduce
(``reduce.BucketReduce``), its commit (``commit.GradCommit``), its gloo in-place
strategy (``in_place.InPlace``) and its subclass gather (``extension.ExtensionGather``),
and hands itself to each. They read it through this protocol rather than importing
``bucket.py``: the folder then reads bottom-up (see CONTRIBUTING.md). Each helper is
read through a protocol here too (with the members the others read of it), since each
imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..api import MixedPrecisionPolicy
from ..comm.collectives import Pending
from ..comm.mesh import MeshInfo
from ..params.param import FSDPParam
from .offload import HostOffload
from .quant.spec import QuantizedComm
from .reduce_layout import ReduceLayout
from .user_comm import AllGatherComm, UserComm

# ``reduce.Staged``: a completed reduce's layout, gradients, "used" flags and scalars.
Staged = tuple[ReduceLayout, torch.Tensor, torch.Tensor, torch.Tensor]


class ReduceView(Protocol):
    """What the other helpers read of a bucket's ``reduce.BucketReduce``."""

    @property
    def bucket(self) -> BucketView: ...
    @property
    def ready(self) -> list[Staged]: ...  # reduced, not yet in ``.grad``
    @property
    def riders(self) -> Sequence[ReduceView]: ...
    @property
    def deposited(self) -> list[bool]: ...
    @property
    def divide_factor(self) -> float: ...

    def layout(self) -> ReduceLayout: ...
    def used_flags(self) -> list[bool]: ...


class CommitView(Protocol):
    """What the other helpers read of a bucket's ``commit.GradCommit``."""

    def remember(self, flat: torch.Tensor, span: tuple[int, int] | None = None) -> None: ...
    def all_grads_none(self) -> bool: ...


class InPlaceView(Protocol):
    """What the other helpers read of a bucket's ``in_place.InPlace``."""

    @property
    def gathers(self) -> bool: ...
    @property
    def staged(self) -> torch.futures.Future | None: ...

    def start_gather(self, shard: torch.Tensor) -> Pending: ...
    def deposit(self, p: FSDPParam, grad: torch.Tensor, first: bool) -> None: ...
    def start_reduce(self, reduce: ReduceView) -> Pending: ...
    def finish_reduce(self, label: str, discard: bool = False) -> Staged | None: ...


class GlooView(Protocol):
    """What the other helpers read of a bucket's ``gloo.GlooStrategy``."""

    @property
    def reduce_by_all_to_all(self) -> bool: ...


class ExtensionGatherView(Protocol):
    """What the other helpers read of a bucket's ``extension.ExtensionGather``."""

    _sent: list[tuple[list[torch.Tensor], object]]  # emptied for a rider after an exception

    @property
    def in_flight(self) -> bool: ...

    def start(self, group: dist.ProcessGroup, mp_policy: MixedPrecisionPolicy | None,
              custom: AllGatherComm | None = None) -> None: ...
    def collect(self, mp_policy: MixedPrecisionPolicy | None) -> list[torch.Tensor]: ...
    def take(self, gathered: torch.Tensor, col: int) -> int: ...
    def build(self) -> None: ...
    def finish(self) -> None: ...
    def drop(self) -> None: ...


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
    @property
    def reduce(self) -> ReduceView: ...  # its ``BucketReduce``
    @property
    def commit(self) -> CommitView: ...  # its ``GradCommit``
    @property
    def in_place(self) -> InPlaceView | None: ...  # its ``InPlace`` strategy, or None
    @property
    def gloo(self) -> GlooView | None: ...  # its ``GlooStrategy``, or None off gloo
    gather_is_identity: bool  # one rank, one dtype: the shards are the unsharded values
    @property
    def extension_gather(self) -> ExtensionGatherView | None: ...  # its ``ExtensionGather``, or None
    user: UserComm  # the group's ``set_*`` choices
    mp_policy: MixedPrecisionPolicy | None  # the group's ``MixedPrecisionPolicy`` (for ``fsdp_pre_all_gather``)
    # Its ``BucketGather``; a rider's is a ``RidingGather``, whose ``carried_input`` and
    # ``take_carried`` the carrier's extension gather reads (FlatBucket types it BucketGather).
    gather: Any
    quant: QuantizedComm  # its ``quant.spec.QuantizedComm``: what the policy asks to quantize

    @property
    def storage_lent(self) -> bool: ...  # ``in_place`` holds the unsharded storage for a reduce
    @property
    def riders(self) -> Sequence[BucketView]: ...  # buckets whose rows its extension gather carries

    def comm_numel(self) -> int: ...
    def alloc_unsharded(self) -> None: ...
    def free_unsharded(self, even_kept: bool = False) -> None: ...


class CarrierView(BucketView, Protocol):
    """A bucket that carries others' rows in its all-gather (``gather.RidingGather``'s
    ``carrier``): an extension bucket, which has an ``ExtensionGather``."""

    @property
    def extension_gather(self) -> ExtensionGatherView: ...
