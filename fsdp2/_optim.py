"""Optimizer steps on the local shards.

A ``Shard(0)`` DTensor parameter costs a Python ``__torch_dispatch__`` round trip on
every op of the optimizer's per-parameter math (about 15 ops per parameter for AdamW),
often more than the forward and backward of a small block. For optimizers whose update
is elementwise, updating the DTensor equals updating each rank's local shard by itself.
So, for the duration of ``optimizer.step()`` only, each managed parameter in the
optimizer's ``param_groups`` is replaced by a plain tensor aliasing its local shard,
with ``.grad`` and the DTensor optimizer state likewise replaced by their local tensors;
afterwards everything is put back, and the optimizer's state keeps its DTensors (the
same objects, updated in place) for ``state_dict()`` and checkpointing.

The fast path runs only when nothing else could observe the swap or be changed by it:
the optimizer is exactly one of the elementwise ``torch.optim`` classes (a subclass may
compute norms), not ``differentiable``, stepped without a closure, with no step hooks
but fsdp2's, and the state of every parameter with a gradient already exists (the first
step creates it through the DTensor path, so its types and shapes are the regular ones).
A parameter group holding a DTensor fsdp2 does not manage, or a gradient or state entry
whose placement differs from its parameter's, steps on DTensors as before.

If the step raises midway, the post-step hook does not run: the swap is undone at the
next ``step()``, ``state_dict()``, ``load_state_dict()`` or root forward, including a
``zero_grad(set_to_none=True)`` that ran on the aliases in between.

``FSDP2_LOCAL_OPTIMIZER_STEP=0`` in the environment turns the fast path off.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim import optimizer as _optimizer

ENABLED = os.environ.get("FSDP2_LOCAL_OPTIMIZER_STEP", "1") != "0"
# Optimizers whose update of one element reads only that element's parameter, gradient
# and state (plus per-parameter scalars such as the step count).
ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.Adadelta,
        torch.optim.ASGD,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
    }
)
# Steps taken on local shards, for tests and debugging.
local_steps = 0


class _Swapped:
    """One parameter put back after the step."""

    __slots__ = ("alias", "grad", "index", "local_state", "locals", "param", "params", "state")

    def __init__(
        self,
        params: list,
        index: int,
        param: torch.Tensor,
        alias: torch.Tensor,
        grad: torch.Tensor | None,
        state: dict | None,
        local_state: dict | None,
        locals_: dict[Any, torch.Tensor],
    ) -> None:
        self.params = params
        self.index = index
        self.param = param
        self.alias = alias
        self.grad = grad
        self.state = state
        self.local_state = local_state
        self.locals = locals_


# id(optimizer) -> (weak ref to it, what its unfinished fast-path step swapped)
_ACTIVE: dict[int, tuple[weakref.ref, list[_Swapped]]] = {}
_HOOKED: weakref.WeakSet = weakref.WeakSet()  # optimizers with our state_dict repair hooks


def pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict, managed: Callable) -> None:
    """Swap managed parameters for their local shards, when safe (see the module doc)."""
    global local_steps
    if _ACTIVE:
        repair(optimizer)
    if not _eligible(optimizer, args, kwargs):
        return
    swapped: list[_Swapped] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        planned = _plan_group(optimizer, group, managed, seen)
        if planned:
            swapped.extend(planned)
    if not swapped:
        return
    if optimizer not in _HOOKED:
        _HOOKED.add(optimizer)
        optimizer.register_state_dict_pre_hook(repair)
        optimizer.register_load_state_dict_pre_hook(lambda opt, sd: repair(opt))
    state = optimizer.state
    _ACTIVE[id(optimizer)] = (weakref.ref(optimizer), swapped)  # first: repairable from here on
    for s in swapped:
        s.params[s.index] = s.alias
        s.alias.grad = s.grad
        if s.state is not None:
            del state[s.param]
            state[s.alias] = s.local_state
    local_steps += 1


def post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if _ACTIVE:
        repair(optimizer)


def repair(optimizer: torch.optim.Optimizer) -> None:
    """Put back what a fast-path step of ``optimizer`` swapped, if anything."""
    entry = _ACTIVE.pop(id(optimizer), None)
    if entry is not None and entry[0]() is optimizer:
        _restore(optimizer, entry[1])


def repair_all() -> None:
    """Undo every unfinished swap (a step raised): called at the root's forward."""
    for key in list(_ACTIVE):
        ref, swapped = _ACTIVE.pop(key)
        opt = ref()
        if opt is not None:
            _restore(opt, swapped)


def _eligible(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    return (
        ENABLED
        and type(optimizer) in ELEMENTWISE
        and len(args) <= 1
        and kwargs.get("closure") is None
        and not optimizer.defaults.get("differentiable", False)
        and len(_optimizer._global_optimizer_pre_hooks) == 1
        and not _optimizer._global_optimizer_post_hooks.keys() - _OUR_POST_HOOKS
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
        and not torch.compiler.is_compiling()
    )


_OUR_POST_HOOKS: set[int] = set()


def register_post_hook() -> Any:
    handle = _optimizer.register_optimizer_step_post_hook(post_step)
    _OUR_POST_HOOKS.add(handle.id)
    return handle


def _plan_group(
    optimizer: torch.optim.Optimizer, group: dict, managed: Callable, seen: set[int]
) -> list[_Swapped] | None:
    """What swapping this parameter group means, or ``None`` if it must stay DTensor.
    Plans only: nothing is changed until every group is planned."""
    params = group["params"]
    # Plain SGD keeps no state at all: nothing for a first DTensor step to create.
    stateless = type(optimizer) is torch.optim.SGD and not group.get("momentum")
    planned: list[_Swapped] = []
    state = optimizer.state
    for i, p in enumerate(params):
        fp = managed(p)
        if fp is None:
            if isinstance(p, DTensor):
                return None  # a DTensor we do not manage: a foreach list may not mix kinds
            continue
        if id(p) in seen:
            return None  # listed twice (torch only warns): one alias could not stand for both
        seen.add(id(p))
        local = p._local_tensor
        grad = p.grad
        if grad is not None and not _same_layout(grad, p, local):
            return None
        st = state.get(p)
        if not st:
            if grad is not None and not stateless:
                return None  # first step: let the DTensor path create the state
            st = None
        local_state = None
        locals_: dict[Any, torch.Tensor] = {}
        if st is not None:
            local_state = {}
            for k, v in st.items():
                if isinstance(v, DTensor):
                    if not _same_layout(v, p, local):
                        return None
                    v = locals_[k] = v._local_tensor
                elif v is None or (isinstance(v, torch.Tensor) and v.dim() > 0):
                    # A placeholder the step may fill (SGD's momentum_buffer saved as None),
                    # or a full-size plain tensor where DTensor state belongs: the DTensor
                    # path decides what happens, as it would without fsdp2's fast path.
                    return None
                local_state[k] = v
        alias = fp.optimizer_alias(local)
        local_grad = None if grad is None else grad._local_tensor
        planned.append(_Swapped(params, i, p, alias, local_grad, st, local_state, locals_))
    return planned


def _same_layout(t: DTensor, p: DTensor, local: torch.Tensor) -> bool:
    if not isinstance(t, DTensor):
        return False
    spec, pspec = t._spec, p._spec
    if spec is not pspec and (spec.placements != pspec.placements or spec.mesh != pspec.mesh):
        return False
    return t._local_tensor.shape == local.shape


def _restore(optimizer: torch.optim.Optimizer, swapped: list[_Swapped]) -> None:
    state = optimizer.state
    for s in swapped:
        if s.index < len(s.params) and s.params[s.index] is s.alias:
            s.params[s.index] = s.param
        if s.alias.grad is None and s.param.grad is not None:
            s.param.grad = None  # zero_grad(set_to_none=True) ran on the alias after a failed step
        s.alias.grad = None
        local_state = state.pop(s.alias, None)
        if s.state is None:
            if local_state:
                state[s.param] = {k: _as_param_layout(v, s) for k, v in local_state.items()}
            continue
        if local_state is not None:
            for k, v in local_state.items():
                if k in s.locals:
                    if v is not s.locals[k]:  # the optimizer replaced the tensor
                        orig = s.state[k]
                        s.state[k] = DTensor(v, orig._spec, requires_grad=False)
                else:
                    s.state[k] = _as_param_layout(v, s)
        state[s.param] = s.state


def _as_param_layout(value: Any, s: _Swapped) -> Any:
    """A state tensor the step created on the alias, as the DTensor path would have made
    it: with the parameter's layout when it has the shard's shape (0-dim ones stay plain:
    a step count cannot be told from a 0-dim parameter's moment)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == s.alias.shape:
        p = s.param
        return DTensor.from_local(
            value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return value
