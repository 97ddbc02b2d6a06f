"""What a group adopts after ``fully_shard`` built it: the data ``module._apply``
(``to_empty``, ``to``, ``double``...) put into its parameters, and, at lazy init,
parameters reassigned since or given all-gather hooks since."""

from __future__ import annotations

from typing import cast

import torch

from ..bucket.bucket import comm_pools
from ..optim.local_step import forget_plans_of
from .group import ParamGroup
from .group_setup import adoptable_replacements, join_reduces, rebucket


def rebind(group: ParamGroup) -> None:
    """After ``module._apply``: adopt the new parameter data, once every module of the
    group has been converted (``to_empty`` reaches the modules of a list one by one)."""
    group.reshard()
    group.checks.forget()
    current = [[cast(torch.Tensor, p.owners[0][0]._parameters[p.owners[0][1]]) for p in b.params] for b in group.buckets]
    if len({t.device for ts in current for t in ts}) > 1 or any(len({t.dtype for t in ts}) > 1 for ts in current):
        return  # another module's _apply will finish the conversion
    before = {b.device for b in group.buckets}
    for b in group.buckets:
        b.rebind()
    join_reduces(group.buckets)  # which buckets reduce alike follows their dtypes
    forget_plans_of(group.buckets)  # they hold the old storage's optimizer state
    if before != {b.device for b in group.buckets}:  # moved (off the mesh's device): hold nothing there
        for pool in comm_pools(group.buckets):
            pool.drop_idle()


def adopt_reassigned(group: ParamGroup) -> None:
    """At lazy init: parameters reassigned since ``fully_shard`` (``module.weight =
    nn.Parameter(dtensor)``, e.g. by a custom initializer) become the sharded
    parameters, their values copied into the group's storage; parameters whose local
    tensors gained all-gather hooks since (bound to the object, as torch's tests do)
    move to the extension path, the group's buckets built anew (torch too looks for
    the hooks at lazy init)."""
    if adoptable_replacements(group.params):
        rebind(group)
    # Every parameter checked before any moves (a refused one leaves the group as it was).
    gained = [(p, wrapper) for p in group.params for found, wrapper in [p.gained_extension()] if found]
    for p, wrapper in gained:
        p.take_extension(wrapper)
    if gained:
        group.reshard()
        group.checks.forget()
        group.replace_buckets(rebucket(group.params, group.buckets, group.comm, group.mp_policy, group.offload_policy))
