"""State dict support.

``state_dict()`` needs nothing from us: the registered parameters are the sharded
DTensors, so keys are the unsharded model's and values are sharded DTensors, with
no communication. Loading needs two things:

* a pre-hook per module owning managed parameters turns a full plain tensor (say, a
  Hugging Face checkpoint or one saved from the unsharded model) into this rank's shard
  as a DTensor view, so the in-place ``copy_`` keeps writing into our flat storage;
* ``validate_state_dict`` checks keys, shapes and dtypes of the whole dict first and
  raises with every problem before anything is copied, so a bad dict loads nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .dtensor import make_dtensor
from .param import FSDPParam


class StateDictError(ValueError, RuntimeError):
    """A state dict that does not fit the model; nothing was loaded.

    A ``ValueError`` for bad input, and a ``RuntimeError`` like torch's own
    ``load_state_dict`` errors, so existing ``except RuntimeError`` code still works.
    """


def register_state_dict_hooks(params: list[FSDPParam]) -> None:
    """Per owner module: a load pre-hook sharding full tensors of its parameters, and a
    state_dict post-hook making their values picklable."""
    by_owner: dict[int, tuple[nn.Module, list[tuple[str, FSDPParam]]]] = {}
    for fp in params:
        for module, name in fp.owners:
            by_owner.setdefault(id(module), (module, []))[1].append((name, fp))
    for module, slots in by_owner.values():
        module.register_load_state_dict_pre_hook(_ShardFullTensors(slots))
        module.register_state_dict_post_hook(_Picklable([name for name, _ in slots]))


class _Picklable:
    """``state_dict()`` values are ``p.detach()``: DTensors over views into our flat
    buffers, which torch 2.13 cannot ``torch.save`` or deep-copy (``make_dtensor``)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name in self.names:
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor) and value.storage_offset() != 0:
                state_dict[prefix + name] = make_dtensor(
                    value._local_tensor, value._spec, value.requires_grad
                )


class _ShardFullTensors:
    def __init__(self, slots: list[tuple[str, FSDPParam]]) -> None:
        self.slots = slots

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        for name, fp in self.slots:
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == fp.shape:
                param = fp.sharded
                if param is None:
                    raise AssertionError("fsdp2 internal error: expected param is not None")
                local = fp.local_chunk(value.detach()).to(param.device)
                state_dict[prefix + name] = fp.to_dtensor(local)


def validate_state_dict(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> None:
    """Raise ``StateDictError`` listing every mismatch, before anything is loaded."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"load_state_dict expects a mapping of names to tensors, got {type(state_dict).__name__}"
        )
    expected = module.state_dict()
    problems: list[str] = []
    if strict:
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        if missing:
            problems.append(f"missing keys: {', '.join(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {', '.join(unexpected)}")
    for key, want in expected.items():
        got = state_dict.get(key)
        if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
            continue
        if got.shape != want.shape:
            problems.append(f"{key}: shape {tuple(got.shape)} given, {tuple(want.shape)} expected")
        elif got.dtype != want.dtype:
            problems.append(f"{key}: dtype {got.dtype} given, {want.dtype} expected")
    if problems:
        raise StateDictError(
            "state dict does not fit the model, nothing was loaded:\n  " + "\n  ".join(problems) + "\n"
            "Load with strict=False to skip missing/unexpected keys; convert shapes or dtypes "
            "in the dict first (e.g. {k: v.float() for k, v in sd.items()})"
        )
