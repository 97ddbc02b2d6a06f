"""Communication buffers that are allocated once and reused.

A ``BufferPool`` hands out flat tensors. A buffer is owned from ``acquire`` until
``release``; the owner releases it only after the collective that wrote or read it has
been waited on, so a buffer is never overwritten while a group still reads it.

Buffers are raw bytes shared by every group and dtype on a device: a request takes the
smallest idle buffer that is large enough (a prefix of it, viewed as the requested
dtype), so the root's large buffer also serves the blocks, and a bf16 all-gather and an
fp32 reduce can use the same memory. Only when no idle buffer fits is a new one
allocated; in a steady state the same few buffers come back every step and nothing is
allocated.

What this costs per rank: the pool keeps what the busiest moment of a step held at once,
at most ``max_free`` idle buffers per device (the smallest goes back to the allocator
first). For a model of identical blocks plus a larger root that is one root-sized buffer
(it serves the root and, in between, a block) and one block-sized buffer: the current
group's buffer and the prefetched or still-reducing one; on gloo one more block-sized
buffer, the receive buffer of the all-to-all that reduces the gradients.
"""

from __future__ import annotations

import bisect
import weakref

import torch


class BufferPool:
    """Idle byte buffers per device, ascending by size, and the buffers handed out."""

    def __init__(self, max_free: int = 3) -> None:
        self.max_free = max_free
        self._free: dict[torch.device, list[torch.Tensor]] = {}
        # id(handed-out view) -> its byte buffer, and the finalizer that forgets the entry
        # if the holder is collected without releasing it (e.g. a model dropped mid-step).
        self._in_use: dict[int, tuple[torch.Tensor, weakref.finalize]] = {}
        self.allocations = 0  # how many buffers were ever created

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``dtype``; contents are undefined."""
        nbytes = numel * dtype.itemsize
        free = self._free.setdefault(device, [])
        i = bisect.bisect_left(free, nbytes, key=torch.Tensor.numel)  # the best fit
        if i < len(free):
            raw = free.pop(i)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.allocations += 1
        buf = raw[:nbytes].view(dtype)
        self._in_use[id(buf)] = (raw, weakref.finalize(buf, self._in_use.pop, id(buf), None))
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a tensor from ``acquire``: the caller no longer reads or writes it."""
        entry = self._in_use.pop(id(buf), None)
        if entry is None:
            raise AssertionError("fsdp2 internal error: released a buffer the pool did not hand out")
        raw, forget = entry
        forget.detach()
        free = self._free.setdefault(raw.device, [])
        bisect.insort(free, raw, key=torch.Tensor.numel)
        if len(free) > self.max_free:
            del free[0]  # the least useful one goes back to the allocator

    def idle_bytes(self) -> int:
        """Bytes held by idle buffers (what the pool costs between steps)."""
        return sum(raw.numel() for raw in self.idle_buffers())

    def idle_buffers(self) -> list[torch.Tensor]:
        """The idle byte buffers, every device."""
        return [raw for free in self._free.values() for raw in free]

    def buffers_in_use(self) -> list[torch.Tensor]:
        return [raw for raw, _ in self._in_use.values()]

    def drop_idle(self) -> None:
        """Give every idle buffer back to the allocator (``fsdp2.release_memory``, a model
        moved off the device); buffers in use stay with their holders."""
        self._free.clear()
