"""What fsdp2 keeps per rank: buffer pools and the process groups it derives.

A process usually is one rank. Under torch's threaded process group every rank is a
thread of one process with a default group of its own (``dist.group.WORLD`` is read per
thread there), so this state is keyed by the calling rank's default group: each rank
gets its own pools, groups and gather queue, and derives its groups itself, in its own
order, as a collective group creation needs. The key is weak: after
``destroy_process_group()`` and a new ``init_process_group()`` a rank starts afresh.

Two models of one rank share its pools (a buffer is owned from ``acquire`` to
``release``, so they never hand each other a buffer in use) and its derived groups
(made once per set of member ranks, the same for every model).
"""

from __future__ import annotations

import atexit
import weakref

import torch
import torch.distributed as dist

from .buffers import BufferPool
from .collectives import GatherQueue


class RankLocal:
    """One rank's pools (per device), derived process groups and in-place gather queue."""

    def __init__(self) -> None:
        self._pools: dict[torch.device, BufferPool] = {}
        self._groups: dict[tuple[str, tuple[int, ...], str], dist.ProcessGroup] = {}  # (kind, ranks, backend)
        self.gather_queue = GatherQueue()

    def pool(self, device: torch.device) -> BufferPool:
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = BufferPool()
        return pool

    def pools(self) -> list[BufferPool]:
        return list(self._pools.values())

    def subgroup(self, kind: str, ranks: tuple[int, ...], backend: str) -> dist.ProcessGroup:
        """The process group of ``kind`` over ``ranks``, made the first time this rank asks
        (by the member ranks only, ``use_local_synchronization``: each makes its groups in
        the same order), the same group after."""
        key = (kind, ranks, backend)
        group = self._groups.get(key)
        if group is None:
            made = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
            if not isinstance(made, dist.ProcessGroup):  # torch 2.15 types a non-member's -100
                raise AssertionError("fsdp2 internal error: a derived group was made by a rank outside it")
            group = self._groups[key] = made
        return group

    def gather_group(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """The gloo group over ``group``'s ranks that in-place all-gathers use."""
        return self.subgroup("gather", tuple(dist.get_process_group_ranks(group)), "gloo")

    def release(self) -> None:
        """Wait for deferred gathers and drop the groups (see ``release_at_exit``)."""
        self.gather_queue.drain()
        self._groups.clear()


# The default process group of a rank -> its state (weak: see the module docstring).
# process-wide: one entry per rank (a thread under the threaded process group), each
# rank reading only its own.
_BY_WORLD: weakref.WeakKeyDictionary[dist.ProcessGroup, RankLocal] = weakref.WeakKeyDictionary()
_UNINITIALIZED = RankLocal()  # before init_process_group (fully_shard on a mesh still needs one)


def this_rank() -> RankLocal:
    """The calling rank's state."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None:
        return _UNINITIALIZED
    state = _BY_WORLD.get(world)
    if state is None:
        state = _BY_WORLD[world] = RankLocal()
    return state


def release_at_exit() -> None:
    """Before the interpreter tears down (``atexit``): wait for deferred all-gathers
    still to be issued from gloo's threads, and drop the process groups fsdp2 made, so
    that no gloo group is destroyed, with its threads, while the interpreter is half
    torn down (gloo aborts the process then: "terminate called without an active
    exception")."""
    for state in [*_BY_WORLD.values(), _UNINITIALIZED]:
        state.release()


atexit.register(release_at_exit)
