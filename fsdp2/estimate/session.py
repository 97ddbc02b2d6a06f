"""How much memory one rank of a large job needs, measured on this CPU.

    python -m fsdp2.estimate --nproc-per-node 8 --nnodes 128 -- examples/train.py --tp 8 --meta-init
    python -m fsdp2.estimate --nproc-per-node 8 --nnodes 128 --compare "--ac full" --compare "--bf16" \\
        -- examples/train.py --tp 8 --meta-init

runs a torchrun script as rank ``--rank`` (default 0) of a job of ``nproc-per-node x
nnodes`` ranks, in this process: ``init_process_group`` starts torch's fake process group
(collectives cost nothing and move no data), so the script builds only this rank's
shards, gathers one group at a time and computes on its real local batch, and the
tensors it allocates are the ones that rank of the real job allocates (fsdp2 takes the
accelerator's path, as under NCCL). It stops after ``--steps`` training steps (steps of
the first optimizer; default 2, so the optimizer state exists) and reports the peak of
live tensor bytes on the rank, split by category at that moment (``fsdp2.memory.tracker``),
with the phase and module of the peak, per step. ``--json`` prints the report as JSON;
``--compare ARGS`` (repeatable) runs the script again with ``ARGS`` appended and prints
the peaks side by side.

Scripts need no change beyond what torchrun scripts do: the torchrun environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...) is set, and the script's
``init_process_group`` (any backend) gets the fake one. It runs on the CPU, so a script
must fall back to the CPU when CUDA is absent. An all-to-all (Mixture-of-Experts token
dispatch) delivers from every peer what this rank sends to itself: routing as balanced
as this rank's own. What cannot work this way (object collectives such as a
checkpoint's, other data from other ranks) stops the run with the script's error and a
note.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..memory.symmetric import symmetric_collectives
from ..memory.tracker import CATEGORIES, MemoryTracker


class _Done(BaseException):
    """The requested steps ran (a BaseException: scripts' ``except Exception`` let it by)."""


class _ScriptExit(BaseException):
    """The script called ``os._exit`` (which would end this process before the report)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Session:
    """One estimated run: the tracker, where the step is, and the per-step peaks."""

    def __init__(self, steps: int, progress: bool) -> None:
        self.steps, self.progress = steps, progress
        self.tracker = MemoryTracker(self.phase, self.where)
        self._stack: list[torch.nn.Module] = []
        self._names: dict[int, str] = {}
        self._order: dict[int, int] = {}
        self._in_optimizer = 0
        self._first_optimizer: Any = None
        self.done_steps = 0
        self._ops_at_end = 0  # the tracker's op count when the last step ended
        self.per_step: list[dict[str, Any]] = []
        self._start = time.perf_counter()

    # -------------------------------------------------------------------- where
    def phase(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self._stack else "other"

    def where(self) -> str:
        if self._stack:
            return self._names.get(id(self._stack[-1]), type(self._stack[-1]).__name__)
        if self.phase() == "backward":
            node = torch._C._current_autograd_node()
            op = f"autograd {node.name()}" if node is not None else ""
            return ", ".join(w for w in (self._backward_group(), op) if w)
        return ""

    def _backward_group(self) -> str:
        """The fsdp2 group computing gradients now: of those gathered for backward, the
        latest in forward order (earlier ones are prefetched)."""
        from ..runtime.group import TrainingState

        best, where = -1, ""
        for m in self.tracker._fsdp_modules():
            order = self._order.get(id(m), -1)
            if m._fsdp2_state.group.training_state is TrainingState.PRE_BACKWARD and order > best:
                best, where = order, self._names.get(id(m), type(m).__name__)
        return where

    # -------------------------------------------------------------------- hooks
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self._stack and id(module) not in self._names:
            for i, (name, m) in enumerate(module.named_modules()):
                self._names.setdefault(id(m), name or "<root>")
                self._order.setdefault(id(m), i)
            self.tracker.note_module(module)
        self._stack.append(module)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Steps are counted by the first optimizer that steps: step ``k`` runs up to its
        ``k``-th step (step 1: setup, forward and backward; step 2: the first optimizer
        step, which makes the optimizer's state, forward and backward)."""
        self.tracker.note_optimizer(optimizer)
        if self._first_optimizer is None:
            self._first_optimizer = optimizer
        if optimizer is self._first_optimizer:
            self._in_optimizer = 0  # a step that raised (and was caught) ran no post-hook
            self._end_step()
        self._in_optimizer += 1

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_optimizer -= 1

    def _end_step(self) -> None:
        """The previous training step is complete: note its peak, start the next."""
        t = self.tracker
        self._ops_at_end = t.ops
        self.per_step.append({"step": self.done_steps + 1, "peak": t.peak, "split": dict(t.peak_split),
                              "phase": t.peak_at[0], "module": t.peak_at[1], "device": dict(t.peak_device)})
        self.done_steps += 1
        self._note(f"step {self.done_steps}: peak {_mib(t.peak)} ({t.peak_at[0]}, {t.peak_at[1] or '-'})")
        t.reset_peak()
        if self.done_steps >= self.steps:
            raise _Done

    def report(self, script: str, args: list[str], world: int, rank: int, note: str | None) -> dict[str, Any]:
        """The run's report: every step's peak and split, and the worst step (``peak``)."""
        worst = max(self.per_step, key=lambda s: s["peak"]) if self.per_step else None
        return {"script": [script, *args], "world_size": world, "rank": rank, "steps": self.per_step,
                "peak": worst, "note": note}

    def _note(self, text: str) -> None:
        if self.progress:
            print(f"[fsdp2.estimate {time.perf_counter() - self._start:6.1f}s] {text}", file=sys.stderr, flush=True)

    def run(self, script: str, args: list[str]) -> None:
        from torch.nn.modules import module as module_hooks
        from torch.optim import optimizer as optimizer_hooks

        handles = [
            module_hooks.register_module_forward_pre_hook(self._pre_forward),
            module_hooks.register_module_forward_hook(self._post_forward, always_call=True),
            optimizer_hooks.register_optimizer_step_pre_hook(self._pre_step),
            optimizer_hooks.register_optimizer_step_post_hook(self._post_step),
        ]
        import fsdp2

        shard = fsdp2.fully_shard

        def fully_shard(module: Any, *a: Any, **k: Any) -> Any:
            out = shard(module, *a, **k)
            for m in module if isinstance(module, (list, tuple)) else [module]:
                self.tracker.note_module(m)  # its shards count as parameters from now on
            return out

        fsdp2.fully_shard = fully_shard  # type: ignore[assignment]
        argv, path, exit_ = sys.argv, list(sys.path), os._exit
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as ``python script.py`` does

        def script_exit(code: int) -> None:
            raise _ScriptExit(code)

        os._exit = script_exit  # type: ignore[assignment]
        try:
            try:
                with self.tracker:
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
            except _ScriptExit as e:
                if e.code != 0:
                    raise SystemExit(e.code) from None
            if self.tracker.ops > self._ops_at_end:  # the script ended mid-step: that step too
                self._end_step()
        except _Done:
            pass
        finally:
            sys.argv, sys.path, os._exit = argv, path, exit_  # type: ignore[assignment]
            fsdp2.fully_shard = shard  # type: ignore[assignment]
            for h in handles:
                h.remove()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def fake_distributed(rank: int, world: int, local_world: int) -> Callable[[], None]:
    """The torchrun environment of ``rank`` (no GPU: the run is on this CPU), and
    ``init_process_group`` starting the fake process group whatever backend or store the
    script asks for. Returns what undoes all that."""
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved_env = dict(os.environ)
    saved = (dist.init_process_group, getattr(PipelineStage, "_warmup_backward_result", None),
             torch.cuda.is_available, torch.cuda.device_count)
    # Hidden twice: the variable for what starts CUDA later, the functions for a process
    # whose CUDA runtime already counted its devices (it reads the variable only once).
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]
    os.environ.update({
        "CUDA_VISIBLE_DEVICES": "",
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local_world),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world),
        "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
    })
    os.environ.pop("TORCHELASTIC_RESTART_COUNT", None)
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        original("fake", store=FakeStore(), rank=rank, world_size=world)

    def undo() -> None:
        """Every patch restored first, whatever tearing the process group down raises."""
        try:
            undo_collectives()
            os.environ.clear()
            os.environ.update(saved_env)
            dist.init_process_group = distributed_c10d.init_process_group = saved[0]  # type: ignore[assignment]
            torch.cuda.is_available, torch.cuda.device_count = saved[2], saved[3]  # type: ignore[assignment]
            if saved[1] is not None:
                PipelineStage._warmup_backward_result = saved[1]  # type: ignore[method-assign]
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    dist.init_process_group = distributed_c10d.init_process_group = init_process_group  # type: ignore[assignment]
    undo_collectives = symmetric_collectives()
    try:
        _static_pipeline_stages()
    except BaseException:
        undo()
        raise
    return undo


def _static_pipeline_stages() -> None:
    """Pipeline stages agree on their shapes by a vote and, unless every stage was given
    them (``input_args``/``output_args``), by exchanging them as objects, which the fake
    process group cannot deliver. Here each stage takes its own vote as the result (a
    script gives its stages alike) and one without shapes stops with the reason. (Torch
    before 2.13 has no such vote: nothing to replace.)"""
    from torch.distributed.pipelining import PipelineStage

    if not hasattr(PipelineStage, "_warmup_backward_result"):
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(self: Any, received_result: Any = None) -> torch.Tensor:
        if InferenceMode.needs_dynamic(self._user_meta, True):
            raise RuntimeError(
                f"pipeline stage {self.stage_index} was built without its shapes; under fsdp2.estimate "
                "give PipelineStage input_args= and output_args= (meta tensors of one micro-batch), "
                "since stages otherwise exchange them as objects, which the fake process group cannot deliver"
            )
        return torch.ones(1, dtype=torch.int32, device=self.device)

    PipelineStage._warmup_backward_result = vote  # type: ignore[method-assign]


def estimate(script: str, args: list[str], world: int, rank: int, local_world: int, steps: int,
             progress: bool = True) -> dict[str, Any]:
    """Run ``script`` as ``rank`` of ``world`` and return the report (see ``main``)."""
    if not 0 <= rank < world:
        raise ValueError(f"fsdp2.estimate: --rank must be in [0, {world}), got {rank}")
    if steps < 1:
        raise ValueError(f"fsdp2.estimate: --steps must be at least 1, got {steps}")
    session = Session(steps, progress)
    undo = fake_distributed(rank, world, local_world)
    session._note(f"running {script} as rank {rank} of {world} on the fake process group")
    error = None
    try:
        session.run(script, args)
    except SystemExit as e:
        error = f"the script exited with {e.code}"
    except Exception as e:  # noqa: BLE001 (reported, with why it may not run here)
        error = f"{type(e).__name__}: {e}"
    finally:
        undo()
    if error is not None and not session.per_step:
        raise RuntimeError(
            f"fsdp2.estimate: {script} stopped before completing a training step ({error}). Under the "
            "estimate the script runs on the CPU, on a fake process group whose collectives move no data; "
            "scripts that need CUDA, object collectives (checkpoint save/load, all_gather_object) or data "
            "from other ranks cannot run this way: switch those parts off with the script's flags"
        )
    return session.report(script, args, world, rank, error)


def format_report(report: dict[str, Any]) -> str:
    peak = report["peak"]
    lines = [f"rank {report['rank']} of {report['world_size']}: {' '.join(report['script'])}"]
    if peak is None:
        return lines[0] + "\n  (no training step completed)"
    lines.append(f"peak live tensors: {_mib(peak['peak'])} in step {peak['step']}, "
                 f"{peak['phase']}{', ' + peak['module'] if peak['module'] else ''}")
    for c in CATEGORIES:
        share = peak["split"][c] / peak["peak"] if peak["peak"] else 0.0
        lines.append(f"  {c:22s} {_mib(peak['split'][c]):>14s}  {share:6.1%}")
    if peak.get("device"):
        dev = peak["device"]
        lines.append(f"  CUDA allocator then: allocated {_mib(dev['allocated'])}, reserved {_mib(dev['reserved'])} "
                     f"(the caching allocator holds {_mib(dev['reserved'] - dev['allocated'])} more)")
    lines.append("per step: " + ", ".join(f"{s['step']}: {_mib(s['peak'])} ({s['phase']})" for s in report["steps"]))
    if report.get("note"):
        lines.append(f"note: the script stopped early: {report['note']}")
    return "\n".join(lines)


def _compare(ns: argparse.Namespace, script: str, args: list[str]) -> int:
    variants = [("(as given)", [])] + [(v, shlex.split(v)) for v in ns.compare]
    reports = []
    for label, extra in variants:
        cmd = [sys.executable, "-m", "fsdp2.estimate", "--nproc-per-node", str(ns.nproc_per_node),
               "--nnodes", str(ns.nnodes), "--rank", str(ns.rank), "--steps", str(ns.steps), "--json",
               "--", script, *args, *extra]
        print(f"[fsdp2.estimate] {label}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"fsdp2.estimate: the variant {label!r} failed (its error is above)", file=sys.stderr)
            return done.returncode
        reports.append((label, json.loads(done.stdout.strip().splitlines()[-1])))
    if ns.json:
        print(json.dumps({label: r for label, r in reports}))
        return 0
    width = max(len(label) for label, _ in reports)
    short = ("sharded", "gathered", "grads", "optimizer", "comm", "activations", "other")
    print(f"{'variant':{width}s}  {'peak':>14s}  " + "  ".join(f"{c:>11s}" for c in short))
    for label, r in reports:
        p = r["peak"]
        cells = "  ".join(f"{p['split'][c] / 2**20:11,.1f}" for c in CATEGORIES)
        print(f"{label:{width}s}  {_mib(p['peak']):>14s}  {cells}")
    print("(MiB, at each variant's peak: sharded and gathered parameters, gradients, optimizer state, "
          "communication buffers, activations, other)")
    return 0


def _measure(ns: argparse.Namespace, script: str, args: list[str]) -> int:
    """The same tracking in a real run (each rank tracks; ``--rank`` reports)."""
    rank = int(os.environ.get("RANK", "0"))
    session = Session(ns.steps, progress=rank == ns.rank)
    baseline = _rss()
    session.run(script, args)
    if rank == ns.rank:
        report = session.report(script, args, int(os.environ.get("WORLD_SIZE", "1")), rank, None)
        # The process's peak resident memory above what it held before the script (Linux).
        report["rss"] = {"baseline": baseline, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        print(json.dumps(report) if ns.json else format_report(report), flush=True)
    return 0


def _rss() -> int:
    """Resident bytes of this process now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def parse_command(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """The estimator's options, the script and its arguments (argparse errors exit 2)."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m fsdp2.estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="the rank to run (default 0)")
    p.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as one line of JSON")
    p.add_argument("--compare", action="append", default=[], metavar="ARGS",
                   help="also run with these script arguments appended (repeatable)")
    p.add_argument("--measure", action="store_true",
                   help="no fake process group: track a real run (under torchrun: "
                        "torchrun ... -m fsdp2.estimate --measure -- script.py); rank --rank reports")
    head = argv[:split]
    # ``--compare "--ac full"``: a value that starts with "-", which argparse takes for a flag.
    head = [f"--compare={head[i + 1]}" if a == "--compare" and i + 1 < len(head) else a
            for i, a in enumerate(head) if i == 0 or head[i - 1] != "--compare"]
    ns = p.parse_args(head)
    if ns.steps < 1:
        p.error(f"--steps must be at least 1, got {ns.steps}")
    rest = argv[split + 1 :]
    if not rest:
        p.error("name the script after --: python -m fsdp2.estimate [options] -- script.py [script args]")
    return ns, rest[0], rest[1:]


def main(argv: list[str] | None = None) -> int:
    ns, script, args = parse_command(sys.argv[1:] if argv is None else argv)
    if ns.measure:
        return _measure(ns, script, args)
    if ns.compare:
        return _compare(ns, script, args)
    report = estimate(script, args, ns.nproc_per_node * ns.nnodes, ns.rank, ns.nproc_per_node, ns.steps,
                      progress=True)
    sys.stdout.flush()
    print(json.dumps(report) if ns.json else format_report(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
