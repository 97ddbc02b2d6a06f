"""Count the c10d collectives a step issues, and their logical bytes."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# ProcessGroup methods -> (kind, index of the argument whose bytes count). Counted where
# every caller ends up: torch's ``dist.*`` functions and fsdp2 (which calls the process
# group directly on its hot path) alike.
METHODS = {
    "all_gather_single": ("all_gather", 0),  # output
    "_allgather_base": ("all_gather", 0),
    "reduce_scatter_single": ("reduce", 1),  # input
    "_reduce_scatter_base": ("reduce", 1),
    "all_to_all_single": ("reduce", 1),  # fsdp2's reduce on gloo
    "allreduce": ("reduce", 0),
}


class CommCounter:
    """Wraps the collective methods of ``torch.distributed.ProcessGroup``.

    Bytes are the logical payload: the gathered output, the reduced input. An
    ``allreduce`` issued by fsdp2's ``all_gather_in_place`` (gloo) counts as an all-gather.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.log: list[tuple[str, int]] = []
        self.dtypes: Counter[tuple[str, torch.dtype]] = Counter()  # (kind, payload dtype): calls
        # Deferred in-place gathers are issued from gloo's thread.
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, fn: Any) -> Any:
        kind, index = METHODS[name]

        def wrapped(pg: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
            tensor = args[index]
            if isinstance(tensor, (list, tuple)):
                tensor = tensor[0]
            assert isinstance(tensor, torch.Tensor), (name, args)
            counted = "all_gather" if name == "allreduce" and _called_from("all_gather_in_place") else kind
            nbytes = tensor.numel() * tensor.element_size()
            with self._lock:
                self.calls[counted] += 1
                self.bytes[counted] += nbytes
                self.log.append((counted, nbytes))
                self.dtypes[(counted, tensor.dtype)] += 1
            return fn(pg, *args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def active(self) -> Iterator[CommCounter]:
        for name in METHODS:
            # The class attribute itself (pybind's method descriptor): what getattr returns
            # would not bind ``self`` once put back.
            self._saved[name] = vars(dist.ProcessGroup)[name]
            setattr(dist.ProcessGroup, name, self._wrap(name, getattr(dist.ProcessGroup, name)))
        try:
            yield self
        finally:
            for name, fn in self._saved.items():
                setattr(dist.ProcessGroup, name, fn)


def _called_from(function: str, depth: int = 6) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False
