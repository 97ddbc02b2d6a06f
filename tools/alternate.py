"""The benchmarks' runner: several builds stepped alternately in one process, so machine
noise hits them alike (``tools/bench.py``, ``bench_moe.py``, ``bench_quant.py``).

``alternate(built, step, batch, steps, warmup)`` steps every entry of ``built`` on the
same batches, forwards then backwards (A B, B A, ...), and returns each entry's step
times after ``warmup`` steps and its losses; with ``count`` it then steps each once more
under a ``CommCounter``. ``in_fresh_process(worker, *args)`` runs a worker that starts
a process group of its own (the fake one, for host time) in a spawned process and
returns what it put on its queue.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist
from _comm import CommCounter


class Alternated(NamedTuple):
    times: dict[str, list[float]]  # seconds per step after the warm-up ones
    losses: dict[str, list[Any]]  # what each step returned
    comms: dict[str, tuple[dict[str, int], dict[str, int]]]  # (calls, bytes) per collective kind


def alternate(
    built: dict[str, Any],
    step: Callable[[Any, Any], Any],
    batch: Callable[[], Any],
    steps: int,
    warmup: int,
    count: bool = False,
) -> Alternated:
    """``step(built[name], batch())`` for every name, ``warmup + steps`` times; a barrier
    before each step when several ranks run it."""
    names = list(built)
    barrier = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[Any]] = {n: [] for n in names}
    for i in range(warmup + steps):
        inputs = batch()
        for name in names if i % 2 == 0 else names[::-1]:
            if barrier:
                dist.barrier()
            start = time.perf_counter()
            losses[name].append(step(built[name], inputs))
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    comms = {}
    for name in names if count else []:
        inputs = batch()
        with CommCounter().active() as counter:
            step(built[name], inputs)
        comms[name] = (dict(counter.calls), dict(counter.bytes))
    return Alternated(times, losses, comms)


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def in_fresh_process(worker: Callable[..., None], *args: Any) -> Any:
    """``worker(*args, queue)`` in a spawned process; what it put on ``queue``."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=worker, args=(*args, queue))
    proc.start()
    proc.join()
    if queue.empty():
        raise RuntimeError(f"{worker.__name__}{args} failed (its traceback is above)")
    return queue.get()
