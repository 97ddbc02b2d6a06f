"""What a user chose for one ``fully_shard`` call, and what the runtime decides over it
for a step: two objects, so that no per-step decision overwrites a user's choice.

``GroupSettings`` holds every choice as the user gave it: ``fully_shard``'s arguments,
then each ``FSDPModule.set_*`` method's value (``_module.py`` is its one writer). Its
``collectives`` are the part the buckets read (``bucket/user_comm.py``), shared with
them. ``StepOverrides`` holds what a driver of the step decides for a while instead (a
pipeline schedule: no gradient sync between micro-batches, then one reduce at the end);
``None`` leaves the user's value in force. ``ParamGroup`` reads the two through its
properties (``requires_gradient_sync``, ``reshard_after_backward``, ...).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..api import MixedPrecisionPolicy, OffloadPolicy
from ..bucket.user_comm import UserComm


class PrefetchTarget(Protocol):
    """What is read of a prefetch target, a ``ParamGroup`` (``group.py`` imports this
    module, so the settings name the group through this protocol)."""

    @property
    def settings(self) -> GroupSettings: ...
    @property
    def training_state(self) -> object: ...  # a ``group.TrainingState``

    def unshard(self, after: torch.futures.Future | None = None) -> None: ...


@dataclass
class GroupSettings:
    """One ``fully_shard`` call's choices, as given (see the ``set_*`` methods)."""

    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy | None
    # As ``check_reshard_after_forward`` returned it: True frees the gathered parameters
    # after forward, False keeps them, an int keeps that many ranks' rows; None (the
    # default) frees them except on the root, whose parameters backward needs first,
    # and on the last group to run forward (the root context keeps it, per step).
    reshard_after_forward: bool | int | None
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    requires_all_reduce: bool = True  # HSDP: all-reduce over the replicas after the reduce-scatter
    unshard_in_backward: bool = True
    gradient_divide_factor: float | None = None  # None: the ranks of each bucket's mesh
    is_last_backward: bool = True  # read on the root
    manual_finalization: bool = False  # read on the root (``runtime/root.py``)
    # Explicit prefetch targets (``ParamGroup``s), overriding the recorded forward order.
    forward_prefetch: Sequence[PrefetchTarget] | None = None
    backward_prefetch: Sequence[PrefetchTarget] | None = None
    collectives: UserComm = field(default_factory=UserComm)


@dataclass
class StepOverrides:
    """What a driver of the step decides instead of the user, while it drives (``None``:
    the user's value holds)."""

    requires_gradient_sync: bool | None = None
    reshard_after_backward: bool | None = None
    is_last_backward: bool | None = None

    def clear(self) -> None:
        self.requires_gradient_sync = self.reshard_after_backward = self.is_last_backward = None


def check_reshard_after_forward(
    value: object, sizes: tuple[int, ...], used: tuple[int, ...] | None = None
) -> bool | int | None:
    """``value`` checked against the shard sizes of the group's meshes (one, or one per
    mesh with per-parameter meshes), an int that means a bool turned into it: 1 (keep
    all of them, reshard to one rank's worth) is ``False`` and the shard size of every
    mesh in ``used`` (default: ``sizes``) is ``True``."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward expects a bool, an int or None, got {type(value).__name__}")
    if not all(1 <= value <= world and world % value == 0 for world in sizes):
        what = f"the shard size {sizes[0]}" if len(sizes) == 1 else f"every shard size of the group's meshes {sizes}"
        raise ValueError(
            f"reshard_after_forward={value} must divide {what} (the data-parallel "
            "dim parameters are sharded over); "
            "use True (free all) or False (keep all) otherwise"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) keeps the whole parameters after forward, as "
            "reshard_after_forward=False does; pass True to free them",
            stacklevel=3,
        )
        return False
    return True if all(value == world for world in (used or sizes)) else value
