"""Communication buffers that are allocated once and reused.

A ``BufferPool`` hands out flat views of pooled tensors. A buffer is owned from
``acquire`` until ``release``; the owner releases it only after the collective that
wrote or read it has been waited on, so a buffer is never overwritten while a group
still reads it. In the steady state every acquire is served from the free list.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Free lists of flat tensors keyed by (dtype, device)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._in_use: dict[int, torch.Tensor] = {}  # id(view) -> backing tensor
        self.allocations = 0  # how many backing tensors were ever created
        self.capacity_hint: dict[torch.dtype, int] = {}  # largest request per dtype

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements; contents are undefined."""
        hint = max(numel, self.capacity_hint.get(dtype, 0))
        self.capacity_hint[dtype] = hint
        free = self._free.setdefault((dtype, device), [])
        backing = None
        for i, t in enumerate(free):
            if t.numel() >= numel:
                backing = free.pop(i)
                break
        if backing is None:
            free.clear()  # all too small for the largest request seen: let them go
            backing = torch.empty(hint, dtype=dtype, device=device)
            self.allocations += 1
        view = backing[:numel]
        self._in_use[id(view)] = backing
        return view

    def release(self, view: torch.Tensor) -> None:
        """Give back a tensor from ``acquire``: the caller no longer reads or writes it."""
        backing = self._in_use.pop(id(view), None)
        if backing is None:
            raise AssertionError("fsdp2 internal error: released a buffer the pool did not hand out")
        self._free.setdefault((backing.dtype, backing.device), []).append(backing)

    def clear(self) -> None:
        """Drop the free buffers (those in use stay with their owners)."""
        self._free.clear()

    def bytes_reserved(self) -> int:
        free = sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
        used = sum(t.numel() * t.element_size() for t in self._in_use.values())
        return free + used
