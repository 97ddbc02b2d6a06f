"""What a fast-path optimizer step swaps for the duration of ``optimizer.step()`` (see
``local_step``), and how it is put back afterwards."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..params.dtensor import make_dtensor, spec_where_it_is
from ..params.param import FSDPParam, HoldingGroup


class _Swapped:
    """One parameter stepped through a plain alias of its local shard."""

    __slots__ = ("alias", "fp", "grad", "local_state", "locals", "param", "state")

    def __init__(
        self,
        param: DTensor,
        fp: FSDPParam,
        alias: torch.Tensor,
        grad: torch.Tensor | None,
        state: dict | None,
        local_state: dict | None,
        locals_: dict[str, torch.Tensor],
    ) -> None:
        self.param = param
        self.fp = fp
        self.alias = alias
        self.grad = grad
        self.state = state
        self.local_state = local_state
        self.locals = locals_


class _FlatSwapped:
    """A whole bucket stepped as one flat alias of its sharded flat buffer."""

    __slots__ = ("alias", "bucket", "flats", "fps", "grad", "local_state", "params", "snapshot", "states")

    def __init__(
        self,
        alias: torch.Tensor,
        grad: torch.Tensor,
        entries: list[_Swapped],
        local_state: dict,
        flats: dict[str, torch.Tensor],
    ) -> None:
        self.alias = alias
        bucket = entries[0].fp.bucket
        if bucket is None:  # a managed parameter's bucket made it (``FlatBucket.__init__``)
            raise AssertionError("fsdp2 internal error: a flat step over a parameter in no bucket")
        self.bucket = bucket
        self.snapshot: tuple[list, list] = ([], [])  # taken after the step (``_snapshot``)
        self.grad: torch.Tensor | None = grad  # None while a kept plan waits (``_remember_plans``)
        self.params = [s.param for s in entries]
        self.fps = [s.fp for s in entries]
        self.states: list[dict | None] = [s.state for s in entries]
        self.local_state = local_state
        self.flats = flats  # state key -> the flat tensor the parameters' DTensor state views


class _GroupSwap:
    """One parameter group's list, replaced for the step."""

    __slots__ = ("entries", "flats", "group", "groups", "original", "params", "swapped_list")

    def __init__(
        self, group: dict, swapped_list: list, entries: list[_Swapped], flats: list[_FlatSwapped]
    ) -> None:
        self.group = group
        self.original = group["params"]
        self.params = tuple(self.original)  # its contents when planned
        self.swapped_list = swapped_list
        self.entries = entries
        self.flats = flats
        self.groups: list[HoldingGroup] | None = None  # the fsdp2 groups it touches (``local_step._groups``)


# ----------------------------------------------------------------------- restoring
def _restore(optimizer: torch.optim.Optimizer, swaps: list[_GroupSwap]) -> None:
    state = optimizer.state
    for swap in swaps:
        if swap.group["params"] is swap.swapped_list:
            swap.group["params"] = swap.original
        for s in swap.entries:
            _restore_one(state, s)
        for f in swap.flats:
            _restore_flat(state, f)


def _restore_one(state: dict, s: _Swapped) -> None:
    if s.alias.grad is None and s.param.grad is not None:
        s.param.grad = None  # zero_grad(set_to_none=True) ran on the alias after a failed step
    s.alias.grad = None
    local_state = state.pop(s.alias, None)
    if s.state is None:
        if local_state:
            state[s.param] = {k: _as_param_layout(v, s) for k, v in local_state.items()}
        return
    if local_state is not None:
        for k, v in local_state.items():
            if k in s.locals:
                if v is not s.locals[k]:  # the optimizer replaced the tensor
                    orig = s.state[k]
                    s.state[k] = make_dtensor(v, orig._spec)
            else:
                s.state[k] = _as_param_layout(v, s)


def _restore_flat(state: dict, f: _FlatSwapped) -> None:
    if f.alias.grad is None:
        for p in f.params:
            p.grad = None  # zero_grad(set_to_none=True) ran on the alias after a failed step
    f.alias.grad = None
    local_state = state.pop(f.alias, None) or {}
    for k, v in local_state.items():
        flat = f.flats.get(k)
        if flat is not None:
            if v is not flat:  # the optimizer replaced the tensor: keep ours, with its values
                flat.copy_(v)
            continue
        for i, (p, fp) in enumerate(zip(f.params, f.fps)):
            st = f.states[i]
            if st is None:
                st = f.states[i] = state[p] = {}
            old = st.get(k)
            if old is v:
                continue
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # new full-size state: per-parameter views
                local = v[fp.offset : fp.offset + p._local_tensor.numel()].view(p._local_tensor.shape)
                st[k] = _like_param(local, p)
            elif isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape:
                old.copy_(v)  # the step count: every parameter keeps its own tensor
            else:
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v


def _as_param_layout(value: Any, s: _Swapped) -> Any:
    """A state tensor the step created on the alias, as the DTensor path would have made
    it: with the parameter's layout when it has the shard's shape (0-dim ones stay plain:
    a step count cannot be told from a 0-dim parameter's moment)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == s.alias.shape:
        return _like_param(value, s.param)
    return value


def _like_param(local: torch.Tensor, p: DTensor) -> DTensor:
    """``local`` as a DTensor laid out like the parameter ``p`` (its own dtype), sharing
    ``p``'s spec when the dtypes agree."""
    spec = p._spec
    if spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
        spec = spec_where_it_is(local, p.device_mesh, p.placements, p.shape, p.stride())
    return make_dtensor(local, spec)

