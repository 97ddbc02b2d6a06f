"""Communication buffers that are allocated once and reused.

A ``BufferPool`` hands out flat tensors. A buffer is owned from ``acquire`` until
``release``; the owner releases it only after the collective that wrote or read it has
been waited on, so a buffer is never overwritten while a group still reads it.

Reuse is by exact size: in a model of identical blocks every block's all-gather and
reduce buffers are the same few tensors step after step, so the steady state allocates
nothing. At most ``max_free`` idle buffers are kept per size, dtype and device: enough
for the current and the prefetched group. What this costs per rank: idle buffers are
resident memory, at most ``max_free`` x (largest group's unsharded bytes) per distinct
group size and dtype (for a model of identical blocks plus a root: two block-sized
buffers and two root-sized ones).
"""

from __future__ import annotations

import torch


class BufferPool:
    """Free lists of flat tensors keyed by (size, dtype, device)."""

    def __init__(self, max_free: int = 2) -> None:
        self.max_free = max_free
        self._free: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._in_use: set[int] = set()  # id() of the tensors handed out
        self.allocations = 0  # how many tensors were ever created

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements; contents are undefined."""
        free = self._free.get((numel, dtype, device))
        if free:
            buf = free.pop()
        else:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.allocations += 1
        self._in_use.add(id(buf))
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give back a tensor from ``acquire``: the caller no longer reads or writes it."""
        if id(buf) not in self._in_use:
            raise AssertionError("fsdp2 internal error: released a buffer the pool did not hand out")
        self._in_use.discard(id(buf))
        free = self._free.setdefault((buf.numel(), buf.dtype, buf.device), [])
        if len(free) < self.max_free:
            free.append(buf)  # else it goes back to the allocator
