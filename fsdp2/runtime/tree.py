"""Find and replace the tensors inside forward arguments and outputs.

Handles tuples, lists, dicts, namedtuples, dataclasses and every container registered
with ``torch.utils._pytree`` (``OrderedDict``, ``defaultdict``, ``deque``, Hugging Face's
``ModelOutput``, a user's own), nested; anything else is left alone. Used to cast
inputs/outputs and to route tensors through autograd nodes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

TensorFn = Callable[[torch.Tensor], torch.Tensor]


def map_tensors(obj: Any, fn: TensorFn) -> Any:
    """Return ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if type(obj) in (tuple, list):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if type(obj) is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    node = pytree.SUPPORTED_NODES.get(type(obj))
    if node is not None:  # OrderedDict, defaultdict, deque, ModelOutput, ...
        children, context = node.flatten_fn(obj)
        return node.unflatten_fn([map_tensors(x, fn) for x in children], context)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return type(obj)({k: map_tensors(v, fn) for k, v in obj.items()})
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
    elif type(obj) in (tuple, list):
        for x in obj:
            _collect(x, pred, found)
    elif type(obj) is dict:
        for x in obj.values():
            _collect(x, pred, found)
    elif type(obj) in pytree.SUPPORTED_NODES:
        for x in pytree.SUPPORTED_NODES[type(obj)].flatten_fn(obj)[0]:
            _collect(x, pred, found)
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
