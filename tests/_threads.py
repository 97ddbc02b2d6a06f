"""Run ``fn(rank, world)`` on every rank as threads of this process, over torch's
threaded process group (as PyTorch's own distributed tests and single-process
simulators do), and return the per-rank values; the first rank's exception is re-raised."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def run_threads(fn: Callable, world: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank, world, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            ProcessLocalGroup.exception_handle(e)  # wakes the ranks blocked in a collective
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        ProcessLocalGroup.reset()
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} (of {world} threads) raised") from errors[rank]
    if hung:
        raise RuntimeError(f"ranks {hung} (threads) did not finish within {timeout} s")
    return [results[r] for r in range(world)]
