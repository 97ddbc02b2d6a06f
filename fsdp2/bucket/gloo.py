"""gloo's own strategies for one bucket, chosen once, in one place.

On gloo (CPU) fsdp2 departs from the collectives an accelerator takes (reduce-scatter,
all-gather into a pooled buffer) where gloo is slow or memory-hungry:

* the reduce runs as one all-to-all plus a local sum of the received rows in rank order
  (``reduce_by_all_to_all``): the bytes of a reduce-scatter, faster than gloo's own, and
  every rank sums alike;
* large buckets from 3 ranks gather and reduce in place, in the unsharded storage
  (``in_place``, ``in_place.InPlace``), possibly deferring a gather behind the reduce
  still using that storage.

A bucket on any other backend has no ``GlooStrategy`` (``bucket.gloo is None``): the
accelerator path reads straight through. Tests switch gloo's strategies off by making
``MeshInfo.on_gloo`` False (``tests/test_accelerator_path.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .in_place import InPlace

if TYPE_CHECKING:
    from .view import BucketView


class GlooStrategy:
    def __init__(self, bucket: BucketView) -> None:
        self.reduce_by_all_to_all = bucket.comm.shard_size > 1
        self.in_place: InPlace | None = InPlace(bucket) if InPlace.applies(bucket) else None

    @classmethod
    def for_bucket(cls, bucket: BucketView) -> GlooStrategy | None:
        """gloo's strategies for ``bucket``, or None off gloo."""
        return cls(bucket) if bucket.comm.on_gloo else None
