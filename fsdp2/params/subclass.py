"""Parameters with an all-gather extension: which ones have it, and how their local
tensor is made over another tensor (its rows of the bucket's flat buffer): a
one-inner-tensor subclass is rebuilt around it (``SubclassWrapper``); a tensor whose
hooks were bound to the object itself stays that object, its data re-pointed
(``KeepObject``). The gather itself is ``bucket.extension.ExtensionGather``."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def has_extension(local: torch.Tensor) -> bool:
    """``local`` customizes its all-gather (both hooks, or an error naming the missing one)."""
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"{type(local).__name__} defines only fsdp_{'pre' if pre else 'post'}_all_gather; an all-gather "
            "extension needs both fsdp_pre_all_gather and fsdp_post_all_gather"
        )
    return pre


class SubclassWrapper:
    """Rebuilds a one-inner-tensor subclass around another tensor (``__tensor_flatten__``
    / ``__tensor_unflatten__``): the fast path, whose shards are views of the bucket's
    flat buffer. ``of`` gives None for every other subclass (several inner tensors, an
    ``__tensor_unflatten__`` of another signature or one that does not rebuild it):
    those are sharded through their own ops (``FSDPParam.dispatch_shard``), as torch
    shards them."""

    def __init__(self, cls: type, name: str, ctx: Any) -> None:
        self.cls, self.name, self.ctx = cls, name, ctx

    @classmethod
    def of(cls, local: torch.Tensor) -> SubclassWrapper | None:
        flatten = getattr(local, "__tensor_flatten__", None)
        unflatten = getattr(type(local), "__tensor_unflatten__", None)
        if flatten is None or unflatten is None:
            return None
        names, ctx = flatten()
        try:
            n_args = len(inspect.signature(unflatten).parameters)
        except (TypeError, ValueError):
            return None
        if len(names) != 1 or n_args != 4:
            return None
        wrapper = cls(type(local), names[0], ctx)
        inner = getattr(local, names[0])
        try:  # one trial rebuild around its own inner tensor
            rebuilt = wrapper.wrap(inner)
        except Exception:  # noqa: BLE001 - it rebuilds some other way: the general path
            return None
        return wrapper if type(rebuilt) is type(local) and wrapper.inner(rebuilt) is inner else None

    def inner(self, t: torch.Tensor) -> torch.Tensor:
        return getattr(t, self.name) if isinstance(t, self.cls) else t

    def wrap(self, plain: torch.Tensor) -> torch.Tensor:
        return self.cls.__tensor_unflatten__({self.name: plain}, self.ctx, plain.shape, plain.stride())  # type: ignore[attr-defined]


class KeepObject:
    """The local tensor of a parameter whose hooks were bound to the tensor object itself
    (``local.fsdp_pre_all_gather = fn.__get__(local)`` after ``fully_shard``, as torch's
    tests do): no rebuilt tensor would carry them, so this very object stays the local
    tensor, and ``wrap`` re-points its data at the bucket's flat buffer (``.data``
    keeps the object, its ``__dict__`` and so the bound hooks)."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def inner(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def wrap(self, plain: torch.Tensor) -> torch.Tensor:
        self.local.data = plain
        return self.local


def late_wrapper(fqn: str, local: torch.Tensor) -> SubclassWrapper | KeepObject | None:
    """How a local tensor that gained all-gather hooks after ``fully_shard`` is kept:
    hooks bound to the object itself (instance methods, as torch's tests monkey-patch
    them) keep that object (``KeepObject``, plain tensors only); hooks its class gained
    are handled as at ``fully_shard`` (a ``SubclassWrapper``, or None: its own ops)."""
    own = vars(local)
    if "fsdp_pre_all_gather" not in own and "fsdp_post_all_gather" not in own:
        return SubclassWrapper.of(local)
    if type(local) is torch.Tensor:
        return KeepObject(local)
    raise NotImplementedError(
        f"parameter {fqn}: fsdp_pre_all_gather was bound to its local tensor, a {type(local).__name__}; "
        "fsdp2 supports hooks bound to plain tensors, or defined on the subclass itself"
    )
