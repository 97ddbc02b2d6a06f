"""Find and replace the tensors inside forward arguments and outputs.

Handles tuples, lists, dicts, namedtuples and dataclasses, nested; anything else is
left alone. Used to cast inputs/outputs and to route tensors through autograd nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def map_tensors(obj: Any, fn: TensorFn) -> Any:
    """Return ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        out = {k: map_tensors(v, fn) for k, v in obj.items()}
        return out if type(obj) is dict else type(obj)(out)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_tensors(getattr(obj, f.name), fn)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def collect_tensors(obj: Any, pred: Callable[[torch.Tensor], bool]) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` for which ``pred`` holds, in traversal order."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        if pred(t):
            found.append(t)
        return t

    map_tensors(obj, visit)
    return found


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors inside ``obj`` to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(obj, cast)
