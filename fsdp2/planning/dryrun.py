"""One training step of a plan, tracked, at the job's world size, on one CPU.

The model is copied to the meta device (no data, no compute: a step of a 1B model takes
about a second) and sharded by the plan over a meta mesh of the job's shape on torch's
fake process group, as rank 0; ``fsdp2.memory.tracker.MemoryTracker`` counts the meta storages
exactly as ``fsdp2.estimate`` counts real ones. The optimizer is the job's, stepped on
stand-ins of the local shards, so its state is what the job's rank holds.

Phases of ``DryRun.measure``:
1. copy the meta template, apply the plan (the tracker sees every shard made);
2. step the optimizer once on empty gradients (its state exists from the job's step 2 on);
3. the tracked step: forward, loss, backward, optimizer step; its peak and split.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..memory.tracker import MemoryTracker
from .groups import local
from .plan import Estimate, Plan


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` with every parameter and buffer on the meta device (shared ones stay shared)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` (Hugging Face models given labels), else the mean of the output
    (its first tensor), in float32."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, dict):
        output = next(iter(output.values()))
    return output.float().mean()


class DryRun:
    """Measures plans of one model at one job shape. A context manager that checks no
    process group is initialized (each ``measure`` starts and ends its own fake one)."""

    def __init__(self, model: nn.Module, shape: tuple[int, ...], names: tuple[str, ...] | None, inputs: Any,
                 loss_fn: Callable[[Any], torch.Tensor] | None, optimizer: Callable[..., Any] | None) -> None:
        self.template = meta_copy(model)
        self.shape, self.names = shape, names
        self.inputs = _to_meta(inputs)
        self.loss_fn = loss_fn or default_loss
        # The default steps all tensors at once (foreach), as it does on accelerators.
        self.optimizer = optimizer or functools.partial(torch.optim.AdamW, foreach=True)
        self.runs = 0
        self._phase = "other"

    def __enter__(self) -> DryRun:
        if dist.is_initialized():
            raise RuntimeError(
                "fsdp2.plan: fitting a plan to a memory budget runs the model on torch's fake process group, "
                "which cannot start while a process group is initialized; plan before init_process_group, "
                "with world_size= (the job's size)"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @contextlib.contextmanager
    def _world(self) -> Iterator[Any]:
        """A fresh fake process group and meta mesh per run: fsdp2's buffer pools belong to
        the process group, so no run reuses buffers another run made (and counted)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(self.shape))
        try:
            yield init_device_mesh("meta", self.shape, mesh_dim_names=self.names)
        finally:
            dist.destroy_process_group()

    def phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return self._phase

    def measure(self, plan: Plan) -> Estimate:
        """One tracked step of ``plan`` (see the module docstring)."""
        self.runs += 1
        try:
            return self._measure(plan)
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            raise DryRunError(
                f"fsdp2.plan: the dry run of one training step on the meta device failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}. The estimate runs the model without data: ops that "
                "read values (nonzero, bincount, .item(), .tolist(): data-dependent routing) and ops whose meta "
                "kernel differs from the device's (torch's meta _grouped_mm takes bfloat16 only) cannot run "
                "there; make the plan without inputs= and measure the job with python -m fsdp2.estimate"
            ) from e

    def _measure(self, plan: Plan) -> Estimate:
        # The peak is exact; its split is taken within 2% of it (fewer walks of the model).
        tracker = MemoryTracker(self.phase, lambda: "", meta=True, split_every=1.02)
        # Copied before the tracker starts: the copy reads the template's tensors through
        # views, which would count the template's storages too.
        model = copy.deepcopy(self.template)
        with self._world() as mesh, tracker, fused_attention():
            # Phase 1: the plan on a fresh copy, over the meta mesh.
            _on_mesh(plan, mesh).apply(model)
            _count_unsharded(model)
            tracker.note_module(model)
            # Phase 2: the optimizer's state, as after the job's first step.
            stand_ins = [torch.empty_like(local(p)).requires_grad_() for p in model.parameters() if p.requires_grad]
            optimizer = self.optimizer(stand_ins)
            tracker.note_optimizer(optimizer)
            for q in stand_ins:
                q.grad = torch.empty_like(q)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tracker.reset_peak()
            # Phase 3: the step.
            self._phase = "forward"
            output = model(**self.inputs) if isinstance(self.inputs, dict) else model(*self.inputs)
            self._phase = "other"
            self.loss_fn(output).backward()
            del output
            trainable = [p for p in model.parameters() if p.requires_grad]
            for q, p in zip(stand_ins, trainable):
                q.grad = None if p.grad is None else local(p.grad)
            self._phase = "optimizer"
            optimizer.step()
            self._phase = "other"
        return Estimate(peak=tracker.peak, split=dict(tracker.peak_split), phase=tracker.peak_at[0],
                        settings=plan.settings())


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Attention as the job's accelerator runs it: on the meta device
    ``scaled_dot_product_attention`` decomposes into the math path, which holds the
    whole score matrix; during the dry run ``F.scaled_dot_product_attention`` calls the
    fused CPU kernel's op instead (it saves the output and one row statistic, as flash
    attention does). A module attribute, not a function mode: activation checkpointing
    recomputes on autograd's thread, where a mode entered here is not active."""
    original = F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]  # its own parameter names
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _count_unsharded(model: nn.Module) -> None:
    """Buffers and the parameters no call sharded (``ignored_params``) were copied before
    the tracker started: remade under it, so that they count as they do in the job."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and not isinstance(p, DTensor):
                    p.data = torch.empty_like(p)
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = torch.empty_like(b)


class DryRunError(RuntimeError):
    """The model's step cannot run on the meta device (the error it raised is the cause)."""


def _on_mesh(plan: Plan, mesh: Any) -> Plan:
    """The same plan (the same groups) over the dry run's mesh."""
    twin = copy.copy(plan)
    twin.mesh = mesh
    return twin


def _to_meta(inputs: Any) -> Any:
    if inputs is None:
        raise ValueError("fsdp2.plan: a memory estimate needs inputs= (one local batch of this rank, real or "
                         "meta tensors: a tensor, a tuple of positional inputs or a dict of keyword inputs)")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, dict):
        return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return tuple(v.to("meta") if isinstance(v, torch.Tensor) else v for v in inputs)
    raise TypeError(f"fsdp2.plan: inputs= must be a tensor, a tuple or a dict, got {type(inputs).__name__}")
