"""A tensor subclass that customizes its FSDP all-gather, as torchao's float8 weights do.

``Doubled`` wraps one tensor; every op runs on the inner tensor, and the structural ops
FSDP applies to a parameter (views, slices, copies, ``new_zeros``) keep the wrapper.
Its all-gather sends two inputs of different dtypes: the inner values doubled (float64)
and an int64 tag of the same shape; ``fsdp_post_all_gather`` checks the tags and halves the values,
so training is exact (float64 parity holds) and a gather that skipped the hooks would
show. ``calls`` counts the hook calls; ``OldSignature`` uses the older one-argument
``fsdp_pre_all_gather(mesh)`` (which cannot know the padded size: even shards only).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
_KEEP = {
    aten.detach.default, aten.view.default, aten._unsafe_view.default, aten.alias.default,
    aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.narrow.default,
    aten.as_strided.default, aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.empty_like.default, aten.zeros_like.default, aten.clone.default, aten._to_copy.default,
    aten.copy_.default, aten.t.default, aten.reshape.default,
}
calls = {"pre": 0, "post": 0, "post_out": 0}


class Doubled(torch.Tensor):
    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Doubled:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, requires_grad=inner.requires_grad,
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self._inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_inner"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> Doubled:
        return cls(inner["_inner"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*tree_map_only(cls, lambda t: t._inner, args), **tree_map_only(cls, lambda t: t._inner, kwargs or {}))
        if func in _KEEP:
            return tree_map_only(torch.Tensor, cls, out)
        return out

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        calls["pre"] += 1
        inner = self._inner
        padded = -(-outer_size[0] // mesh.size())  # inputs must have the padded shard's rows
        if inner.shape[0] < padded:
            inner = torch.cat([inner, inner.new_zeros(padded - inner.shape[0], *inner.shape[1:])])
        return (inner * 2, torch.full(inner.shape, 7, dtype=torch.int64, device=inner.device)), "meta"

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        doubled, tags = outputs
        assert metadata == "meta" and bool((tags == 7).all()), (metadata, tags)
        if out is not None:
            calls["post_out"] += 1
            out.data.copy_((doubled / 2)[: out.shape[0]])  # out: the unpadded parameter
            return None
        calls["post"] += 1
        value = (doubled / 2).to(param_dtype)
        return value, (value,)


class Releasing(Doubled):
    """Says its unsharded tensor does not alias the gathered outputs (torch 2.15's
    ``fsdp_should_release_all_gather_outputs_after_post_all_gather``); ``last_outputs``
    keeps the outputs of its latest ``fsdp_post_all_gather`` to see whether they were freed."""

    last_outputs: list[torch.Tensor] = []

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        Releasing.last_outputs = list(outputs)
        return super().fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)


class BadRelease(Doubled):
    """Answers the release question with something other than a bool."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> Any:
        return 1


def outputs_held() -> int:
    """Bytes the latest ``Releasing`` gather's outputs still hold."""
    return sum(t.untyped_storage().nbytes() for t in Releasing.last_outputs)


class OldSignature(Doubled):
    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:  # type: ignore[override]
        calls["pre"] += 1
        return (self._inner * 2, torch.full(self._inner.shape, 7, dtype=torch.int64, device=self._inner.device)), "meta"


class OwnUnflatten(Doubled):
    """``__tensor_unflatten__`` as a static method of three arguments (no flatten
    context): a signature torch's ``fully_shard`` never calls, so it works there."""

    @staticmethod
    def __tensor_unflatten__(inner: dict, outer_size: Any, outer_stride: Any) -> OwnUnflatten:  # type: ignore[override]
        return OwnUnflatten(inner["_inner"])


seen = threading.local()  # what ``ThreadLocal``'s hook saw, on the thread that called it


class ThreadLocal(Doubled):
    """Records the mesh ``fsdp_pre_all_gather`` got in per-thread state, as user code
    that reads it after the forward on the same thread does."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        seen.meshes = getattr(seen, "meshes", []) + [mesh]
        return super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


class Pair(TwoTensor):
    """Two inner tensors (``a``, ``b``, torch's ``TwoTensor``), both gathered; every op
    runs on each, so after any number of optimizer steps ``a == b`` and the unsharded
    value ``(a + b) / 2`` is exactly the parameter (float64 parity holds). A gather that
    mixed the two up, or a step that updated only one, would show."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        calls["pre"] += 1
        padded = -(-outer_size[0] // mesh.size())
        a, b = self.a, self.b
        if a.shape[0] < padded:
            a = torch.cat([a, a.new_zeros(padded - a.shape[0], *a.shape[1:])])
            b = torch.cat([b, b.new_zeros(padded - b.shape[0], *b.shape[1:])])
        return (a, b), "pair"

    def fsdp_post_all_gather(
        self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        a, b = outputs
        assert metadata == "pair", metadata
        if out is not None:
            calls["post_out"] += 1
            out.data.copy_(((a + b) / 2)[: out.shape[0]])
            return None
        calls["post"] += 1
        value = ((a + b) / 2).to(param_dtype)
        return value, (value,)

    @staticmethod
    def make(t: torch.Tensor) -> Pair:
        return Pair(t, t.clone())


class Stateful(Doubled):
    """Keeps state on its local tensor, as torchao's float8 weight keeps the scale that
    ``precompute_float8_dynamic_scale_for_fsdp`` sets after each step: the test sets
    ``tag`` on ``param._local_tensor``; the hook must see it (a rebuilt tensor would not),
    so it records what it saw in ``tags_seen``."""

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        tags_seen.append(getattr(self, "tag", None))
        return super().fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)


tags_seen: list[Any] = []


def bind_hooks(local: torch.Tensor) -> None:
    """Hooks bound to a plain tensor object after ``fully_shard`` (instance methods, as
    torch's tests monkey-patch them): ``Doubled``'s gather (values doubled, int64 tags),
    the mesh noted in ``seen`` as ``ThreadLocal`` does."""

    def fsdp_pre_all_gather(
        self: torch.Tensor, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        seen.meshes = getattr(seen, "meshes", []) + [mesh]
        return Doubled.fsdp_pre_all_gather(Doubled(self), mesh, outer_size, outer_stride, module, mp_policy)

    def fsdp_post_all_gather(
        self: torch.Tensor, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype, *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        return Doubled.fsdp_post_all_gather(Doubled(self), outputs, metadata, param_dtype, out=out)

    local.fsdp_pre_all_gather = fsdp_pre_all_gather.__get__(local)  # type: ignore[attr-defined]
    local.fsdp_post_all_gather = fsdp_post_all_gather.__get__(local)  # type: ignore[attr-defined]
