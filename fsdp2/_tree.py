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
    """Every tensor inside ``obj`` for which ``pred`` holds, in ``map_tensors`` order
    (without rebuilding containers: this runs on every forward's inputs and outputs)."""
    found: list[torch.Tensor] = []
    _collect(obj, pred, found)
    return found


def _collect(obj: Any, pred: Callable[[torch.Tensor], bool], found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if pred(obj):
            found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _collect(x, pred, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, pred, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.init:
                _collect(getattr(obj, f.name), pred, found)


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors inside ``obj`` to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(obj, cast)
