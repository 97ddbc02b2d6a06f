"""One run of a script as one rank, tracked: forward and optimizer hooks note the
modules, phases and steps; the tracker (``fsdp2.memory.tracker``) counts live tensor
bytes by category; the run stops after the requested training steps."""

from __future__ import annotations

import os
import runpy
import sys
import time
from typing import Any

import torch

from ..memory.tracker import MemoryTracker


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
        self._first_optimizer: torch.optim.Optimizer | None = None
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
    def _pre_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if not self._stack and id(module) not in self._names:
            for i, (name, m) in enumerate(module.named_modules()):
                self._names.setdefault(id(m), name or "<root>")
                self._order.setdefault(id(m), i)
            self.tracker.note_module(module)
        self._stack.append(module)

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
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

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._in_optimizer -= 1

    def _end_step(self) -> None:
        """The previous training step is complete: note its peak, start the next."""
        t = self.tracker
        self._ops_at_end = t.ops
        self.per_step.append({"step": self.done_steps + 1, "peak": t.peak, "split": dict(t.peak_split),
                              "phase": t.peak_at[0], "module": t.peak_at[1], "device": dict(t.peak_device)})
        self.done_steps += 1
        self._note(f"step {self.done_steps}: peak {mib(t.peak)} ({t.peak_at[0]}, {t.peak_at[1] or '-'})")
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

        fsdp2.fully_shard = fully_shard
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
            sys.argv, sys.path, os._exit = argv, path, exit_
            fsdp2.fully_shard = shard
            for h in handles:
                h.remove()


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
