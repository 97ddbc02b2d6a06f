"""What depends on the installed torch, decided here once and read from here only.

fsdp2 follows the installed torch's ``fully_shard`` where torch changed behaviour between
releases (the table in docs/differences.md). Where the change shows as a feature of a
public torch module fsdp2 uses anyway, it is detected by that feature. Where it lives
inside torch's FSDP only (which fsdp2 never imports), it is keyed by the torch release
that changed it, here and nowhere else.
"""

from __future__ import annotations

import functools
import sys
import types
from dataclasses import dataclass

import torch


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


@dataclass(frozen=True)
class TorchBehaviour:
    """The installed torch's ``fully_shard`` behaviours that changed between releases.

    Attributes:
        reduce_follows_grad_dtype: with ``reduce_dtype=None``, gradients reduce in the
            parameter's gradient dtype (its ``grad_dtype``, else its own dtype), not in
            ``param_dtype`` (torch 2.15; 2.13 and 2.14 reduce in ``param_dtype``).
        policy_shows_override_fn: torch's ``MixedPrecisionPolicy`` has the field
            ``param_dtype_override_fn`` and its repr shows it (torch 2.15).
        accumulates_in_reduce_dtype: the unsharded leaves take their gradients in the
            reduce dtype, each contribution cast before it is summed (a tied weight's two
            as well; torch 2.15), not summed in the compute dtype and cast once.
        reduce_keeps_computed_grad_dtype: a parameter whose reduce dtype is wider than
            its compute dtype takes each op's gradient in the dtype the op computes
            (``grad_dtype=None`` on the unsharded leaf) in a backward that reduces and in
            later accumulating ones, not cast to the compute dtype first (torch 2.15).
        reset_clears_grads: ``reset_iter_state()`` drops the sharded parameters' and the
            leaves' gradients too (torch 2.15).
        grad_dtype_override_known: tensors say whether ``grad_dtype`` was set explicitly
            (``_has_grad_dtype_override``); without it an explicit ``grad_dtype`` shows
            only where it differs from the parameter's dtype.
    """

    reduce_follows_grad_dtype: bool
    policy_shows_override_fn: bool
    accumulates_in_reduce_dtype: bool
    reduce_keeps_computed_grad_dtype: bool
    reset_clears_grads: bool
    grad_dtype_override_known: bool

    @staticmethod
    def detect() -> TorchBehaviour:
        release = _release(torch.__version__)
        return TorchBehaviour(
            reduce_follows_grad_dtype=release >= (2, 15),
            policy_shows_override_fn=release >= (2, 15),
            accumulates_in_reduce_dtype=release >= (2, 15),
            reduce_keeps_computed_grad_dtype=release >= (2, 15),
            reset_clears_grads=release >= (2, 15),
            grad_dtype_override_known=hasattr(torch.Tensor, "_has_grad_dtype_override"),
        )


TORCH = TorchBehaviour.detect()


def has_explicit_grad_dtype(param: torch.Tensor) -> bool:
    """``param.grad_dtype`` was set by the user (to a dtype or to ``None``)."""
    if TORCH.grad_dtype_override_known:
        return bool(param._has_grad_dtype_override)  # type: ignore[attr-defined, unused-ignore]  # torch 2.13 and 2.15 differ here
    return getattr(param, "grad_dtype", param.dtype) != param.dtype


@functools.cache
def stage_drives_fsdp_publicly() -> bool:
    """torch's pipeline stages drive FSDP modules through public methods only
    (``set_manual_backward_finalization``, ``finalize_backward(async_op=True)``; torch
    2.15), detected on the stage class, which has ``start_gradient_reduction`` then.
    Imported on first use: pipelining is not part of ``import fsdp2``."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return hasattr(_PipelineStageBase, "start_gradient_reduction")


def spmd_types_package() -> types.ModuleType | None:
    """The optional ``spmd_types`` package (torchtitan's SPMD type annotations) if this
    process imported it, else None. A tensor can carry an ``spmd_types`` type only once
    the package is imported, so fsdp2 never imports it itself (~0.8 s) and reads it here
    at each use: typed parameters are taken on every supported torch (torch's own
    ``fully_shard`` takes them from 2.14)."""
    return sys.modules.get("spmd_types")
