"""A small multi-process test helper: start W gloo ranks on CPU, collect results.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` spawned processes joined in one gloo process group, and returns the list
of per-rank return values. ``run_scenarios(world_size, {name: (fn, args)})`` runs several
such functions one after the other in one set of ranks (spawning costs more than most
of them) and returns ``{name: per-rank values}``. An exception on any rank is re-raised in pytest with that
rank's traceback; a rank that dies or hangs fails the call after ``timeout`` seconds.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 240.0


class RankError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(env: dict[str, str], call: bytes, rank: int, world: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist

    # The caller's environment as it is now (the fork server's is from when it started),
    # set before the function and its module are unpickled.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        fn, args = pickle.loads(call)
        # The caller holds the store (bound before any rank started: no other process
        # can take its port in between); every rank joins it as a client.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        # Every rank's connections are up before any rank goes on: one that finished a
        # short function and closed its group could cut a peer's still in its handshake.
        dist.barrier()
        value = fn(rank, world, *args)
        # Pickled here, by value: a tensor put on the queue as is would travel as shared
        # memory that vanishes when this process exits before pytest reads it.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to pytest
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What the fork server imports once, so that no rank imports it again: torch and the
# pieces of it every test uses, pytest (every test module imports it) and fsdp2, which
# reads no environment variable at import (those it reads, it reads when called).
# Together ~0.75 s of CPU per rank otherwise, on hundreds of ranks a suite. Inductor's
# compiler too (~1.4 s a rank that compiles, a dozen a suite; it starts no thread at import).
PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch.distributed.checkpoint",
    "torch.distributed.pipelining", "torch._inductor.compile_fx", "pytest", "fsdp2",
]


def _context() -> Any:
    """Ranks start from a fork server that imported ``PRELOAD`` once (a fresh interpreter
    per rank would import torch again: seconds of CPU per rank, most of a small test).
    What torch reads at import (``TORCH_LOGS``, ...) is fixed when the server starts:
    pass ``fresh=True`` to a run that sets such variables."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT, fresh: bool = False
) -> list[Any]:
    """``fresh``: each rank a new interpreter (spawn), for measurements of a process's
    own memory (the fork server's allocator and pages would be counted otherwise)."""
    ctx = mp.get_context("spawn") if fresh else _context()
    call = pickle.dumps((fn, args))
    results = ctx.Queue()
    # The rendezvous store, on a port the OS picks as it binds it (a port found free and
    # bound later by a rank may be taken in between by another suite's processes).
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(target=_entry, args=(dict(os.environ), call, r, world_size, port, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        for _ in range(world_size):
            while True:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead:
                        raise RankError(f"ranks {dead} died without reporting") from None
                    if time.monotonic() > deadline:
                        raise RankError(f"ranks did not report within {timeout}s") from None
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # the other ranks may be blocked in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def _scenarios(rank: int, world: int, scenarios: dict[str, tuple[Callable, tuple]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (fn, args) in scenarios.items():
        try:
            out[name] = fn(rank, world, *args)
        except Exception as e:
            raise RuntimeError(f"scenario {name!r} failed on rank {rank} (the later ones did not run)") from e
    return out


def run_scenarios(
    world_size: int, scenarios: dict[str, tuple[Callable, tuple]], timeout: float = DEFAULT_TIMEOUT
) -> dict[str, list[Any]]:
    """Each scenario's per-rank values, the scenarios run in order in the same ranks."""
    per_rank = run_ranks(_scenarios, world_size, scenarios, timeout=timeout)
    return {name: [values[name] for values in per_rank] for name in scenarios}


def cached_outcome(fn: Callable) -> Callable:
    """``functools.cache`` that also keeps a raised exception: the tests sharing one run
    of scenarios re-raise its failure instead of running (and maybe hanging) again."""
    outcomes: dict[tuple, tuple[bool, Any]] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        if args not in outcomes:
            try:
                outcomes[args] = (True, fn(*args))
            except Exception as e:  # noqa: BLE001 - re-raised to every caller
                outcomes[args] = (False, e)
        ok, value = outcomes[args]
        if not ok:
            raise value
        return value

    return wrapper
