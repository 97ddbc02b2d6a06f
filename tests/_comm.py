"""Count the c10d collectives a step issues, and their logical bytes."""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

COLLECTIVES = (
    "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce",
    "all_to_all_single",
)


class CommCounter:
    """Wraps the ``torch.distributed`` collectives both fsdp2 and torch's fully_shard call.

    Only outermost calls count (a deprecated alias calling its replacement is one call).
    Bytes are the logical payload: the gathered output, the reduced input. An
    ``all_reduce`` issued by fsdp2's ``all_gather_in_place`` (gloo) counts as an all-gather.
    """

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.log: list[tuple[str, int]] = []
        # Per thread: deferred in-place gathers are issued from gloo's thread while the
        # main thread may be inside another collective.
        self._local = threading.local()
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, fn: Any) -> Any:
        signature = inspect.signature(fn)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                caller = sys._getframe(1).f_code.co_name
                kind = "all_gather" if "gather" in name or caller == "all_gather_in_place" else "reduce"
                bound = list(signature.bind(*args, **kwargs).arguments.values())
                tensor = bound[0 if "gather" in name or name == "all_reduce" else 1]
                nbytes = tensor.numel() * tensor.element_size()
                with self._lock:
                    self.calls[kind] += 1
                    self.bytes[kind] += nbytes
                    self.log.append((kind, nbytes))
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapped

    @contextlib.contextmanager
    def active(self) -> Iterator[CommCounter]:
        for name in COLLECTIVES:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        try:
            yield self
        finally:
            for name, fn in self._saved.items():
                setattr(dist, name, fn)
