"""Muon on fsdp2-sharded matrices: each matrix orthogonalized once, by its owner rank.

``fsdp2.optim.Muon`` is ``torch.optim.Muon`` (same constructor, options, ``param_groups``
and state_dict, so checkpoints move between the two) with its own ``step``:

  Phase 1  momentum and Nesterov on each rank's local shards (elementwise, as torch);
  Phase 2  Newton-Schulz of each matrix on one owner rank (``MatrixOwners``): one
           all-to-all to the owners, one back, per exchange group;
  Phase 3  decoupled weight decay and the update on the local shards.

On DTensors ``torch.optim.Muon`` orthogonalizes every matrix on every rank, through
DTensor's matmul collectives. The result here equals torch's local step fed the same
gradients: the same ops on the same whole matrices. Parameters fsdp2 does not manage
(plain tensors, DTensors of plain tensor parallel), subclasses with an all-gather
extension and gradients laid out unlike their parameter take torch's path, with a
warning once per optimizer naming the first such parameter and why.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..params.param import sharded_owner
from ._owners import MatrixOwners


def newton_schulz(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration towards the nearest orthogonal
    matrix, in bfloat16, step for step as ``torch.optim.Muon`` runs it."""
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.dim() != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    a, b, c = ns_coefficients
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate: ``sqrt(max(1, A/B))`` ("original", the default)
    or ``0.2 * sqrt(max(A, B))`` ("match_rms_adamw") for an ``A x B`` matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Muon):
    __doc__ = (
        "``torch.optim.Muon`` whose Newton-Schulz orthogonalization of fsdp2-sharded matrices runs\n"
        "once per matrix, spread over the ranks (see ``fsdp2.optim.muon``). Same arguments:\n\n"
        + (torch.optim.Muon.__doc__ or "")
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owners = MatrixOwners()  # each parameter's exchange plan, kept between steps
        self._warned = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        with_grad = [p for p in group["params"] if p.grad is not None]
        for p in with_grad:  # checked before anything changes, as torch does
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
        owned: list[tuple[DTensor, torch.Tensor]] = []  # (parameter, local update)
        for p in with_grad:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            reason = _not_owned(p, buf)
            if reason is not None:
                self._warn_once(p, reason)
                # torch's path, on whatever tensors it has (DTensors: through DTensor)
                _apply(p, newton_schulz(_momentum(p.grad, buf, group), *ns), lr, group)
                continue
            # Phase 1: momentum on the local shards.
            owned.append((p, _momentum(p.grad._local_tensor, buf._local_tensor, group)))
        if not owned:
            return
        # Phase 2: each matrix orthogonalized once, on its owner.
        params = [p for p, _ in owned]
        updates = self.owners.map(
            params, [u for _, u in owned], lambda m, i: newton_schulz(m, *ns), out_dtype=torch.bfloat16
        )
        # Phase 3: weight decay and the update, on the local shards.
        for p, update in zip(params, updates):
            _apply(p, update, lr, group, local=p._local_tensor)

    def _warn_once(self, p: torch.Tensor, reason: str) -> None:
        if self._warned or reason == "":
            return
        self._warned = True
        warnings.warn(
            f"fsdp2.optim.Muon: a parameter of shape {tuple(p.shape)} {reason}; it (and any other such "
            "parameter of this optimizer) is orthogonalized through DTensor on every rank, as "
            "torch.optim.Muon does",
            stacklevel=3,
        )


def _not_owned(p: torch.Tensor, buf: torch.Tensor) -> str | None:
    """Why ``p`` cannot take the owner path (``""``: a plain tensor, nothing to say)."""
    if not isinstance(p, DTensor):
        return ""
    fp = sharded_owner(p)
    if fp is None:
        return "is a DTensor fsdp2 does not manage (e.g. plain tensor parallel)"
    if fp.extension:
        return "is a tensor subclass with an all-gather extension"
    for t in (p.grad, buf):
        if not isinstance(t, DTensor) or t.placements != p.placements or t._local_tensor.shape != p._local_tensor.shape:
            return "has a gradient or momentum laid out unlike the parameter"
    return None


def _momentum(grad: torch.Tensor, buf: torch.Tensor, group: dict) -> torch.Tensor:
    """Update the momentum ``buf`` with ``grad``; the tensor to orthogonalize (Nesterov's
    or the momentum itself), as torch.optim.Muon computes it."""
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _apply(p: torch.Tensor, update: torch.Tensor, lr: float, group: dict, local: torch.Tensor | None = None) -> None:
    """Decoupled weight decay, then the orthogonalized update at Muon's per-matrix rate
    (of ``p``'s global shape), on ``local`` (``p`` itself unless given its local shard)."""
    target = p if local is None else local
    target.mul_(1 - lr * group["weight_decay"])
    target.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
