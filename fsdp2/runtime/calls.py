"""A group's forward calls in the current step, and the autograd node that tells it
when one call's backward is complete.

Each forward call of a group's modules whose inputs require grad passes them through a
``_PostBackward`` node; its backward runs once every op of that call has run backward,
so the parameters' gradients of the call are all in the leaves. ``BackwardCalls``
counts those nodes (``pending``), and the calls whose gradients may come without one
(``reduce_at_finalize``): the group's post-backward runs when the last node fires, or
at the end of backward for the rest.

``settle_async_inputs`` prepares a call's inputs before that: it waits for those that
are collectives still in flight (see there).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from ..params.spmd_annotations import register_local_function
from .tree import collect_tensors, map_tensors


class CountedGroup(Protocol):
    """What the counted nodes need of a group (``group.ParamGroup``, one layer up: it
    passes itself in, it is not imported)."""

    calls: BackwardCalls

    def post_backward_node(self, counted: bool) -> None: ...


class BackwardCalls:
    def __init__(self) -> None:
        self.pending = 0  # forward calls whose _PostBackward.backward has not run
        self.generation = 0  # bumped when counting restarts: older nodes no longer count
        # Gradients may reach the leaves with no node of ours to say when they are all
        # there (a forward call without inputs that need grad, a reentrant recompute, an
        # explicit unshard): the end of backward runs the post-backward. Set alike on
        # every rank.
        self.reduce_at_finalize = False
        # Forward calls whose outputs carry a pre_backward hook, and how many fired so far.
        self.hooked = 0
        self.started = 0
        # A forward call ran under saved-tensor hooks (activation checkpointing, offloading):
        # autograd may not hold the parameters it needs, so the storage count proves nothing.
        self.saved_by_hooks = False

    @property
    def awaiting(self) -> bool:
        """Gradients are still to be reduced this step: a node to fire, or the end of backward."""
        return self.pending > 0 or self.reduce_at_finalize

    @property
    def all_started(self) -> bool:
        """Every hooked forward call's backward has begun: no pre_backward is to come."""
        return self.started >= self.hooked

    def forget(self) -> None:
        """Start counting afresh; older nodes no longer count."""
        self.pending = 0
        self.generation += 1
        self.reduce_at_finalize = False
        self.saved_by_hooks = False
        self.hooked = self.started = 0

    def dropped(self, generation: int) -> None:
        """A counted node was freed without its backward running (a grad-enabled forward
        whose output was never backpropagated): stop waiting for it."""
        if generation == self.generation and self.pending > 0:
            self.pending -= 1

    def route_inputs(self, group: CountedGroup, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Pass the call's inputs that require grad through a new counted node."""
        inputs = collect_tensors((args, kwargs), _requires_grad)
        if not inputs:
            self.reduce_at_finalize = True
            return args, kwargs
        outs = _PostBackward.apply(group, *inputs)
        self._count_node(outs)
        routed = dict(zip(map(id, inputs), outs))
        return map_tensors((args, kwargs), lambda t: routed.get(id(t), t))

    def _count_node(self, outs: tuple) -> None:
        """Count the node this call's outputs come from, and only that one: a type
        checker may run the function again on stand-ins (``spmd_types``' global mode
        does, on meta DTensors), whose nodes are freed at once and must not count as
        dropped. Where the outputs carry no node of ours to read, the end of backward
        runs the post-backward instead."""
        count = getattr(getattr(outs[0], "grad_fn", None), "count", None) if outs else None
        if count is None:
            self.reduce_at_finalize = True
            return
        count[0] = True
        self.pending += 1
        weakref.finalize(outs[0].grad_fn, _node_freed, self, count)

    def hook_outputs(self, output: Any, hook: Any) -> None:
        """Call ``hook`` when the first gradient of the call's outputs arrives."""
        tensors = collect_tensors(output, _requires_grad)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")
            self.hooked += 1


def saved_tensor_hooks_active() -> bool:
    """Whether tensors autograd saves now go through ``saved_tensors_hooks`` (True when
    this build of torch cannot tell: the caller then stays conservative)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


def settle_async_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Wait for the inputs that are still collectives in flight and require grad (a
    tensor-parallel output such as ``RowwiseParallel(output_layouts=Shard(1))``'s, which
    hands the next block an ``AsyncCollectiveTensor``), keeping them in the autograd graph.

    A compiled block given such an input returns no gradient through it: the gradient
    reaches the collective's redistribute as a plain tensor and backward fails inside
    DTensor (torch 2.13, plain tensor parallel alike). The block would wait for the input
    at its first op anyway, so waiting here (in eager mode too) costs no overlap worth
    keeping. Only the direct inputs of a ``fully_shard`` module are settled.
    """
    if not collect_tensors((args, kwargs), _async_requiring_grad):
        return args, kwargs
    return map_tensors((args, kwargs), lambda t: _Settle.apply(t) if _async_requiring_grad(t) else t)


def _async_requiring_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and isinstance(t, AsyncCollectiveTensor)


@register_local_function
class _Settle(torch.autograd.Function):
    """Identity on values: an ``AsyncCollectiveTensor`` in, its waited plain tensor out (a
    new tensor, not a view made inside this node, so the block may modify it in place)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(t: AsyncCollectiveTensor) -> torch.Tensor:
        return t.trigger_wait().detach()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:
        return tangent


def _node_freed(calls: BackwardCalls, count: list) -> None:
    if count[0]:
        count[0] = False
        calls.dropped(count[1])


@register_local_function
class _PostBackward(torch.autograd.Function):
    """Autograd node in front of one forward call of a module: it passes the call's
    inputs that require grad through, and its backward runs once their gradients are
    complete. Every op of the call was created after this node, so autograd, which runs
    the newest ready node first and accumulates a leaf's gradient as soon as it is
    ready, has by then run all of them: the parameters' gradients of the call are in
    the leaves and nothing of the call reads the parameters any more.
    """

    # The node only counts, it computes nothing: forward-mode AD and the functorch
    # transforms (``torch.func.jvp``, ``hessian``, ``vmap``) pass through it as through
    # an identity (``setup_context`` and ``jvp`` let them; the tangents are returned as
    # views, as the outputs are their inputs as-is).
    generate_vmap_rule = True

    @staticmethod
    def forward(group: CountedGroup, *inputs: torch.Tensor) -> tuple:
        return inputs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        group = inputs[0]
        ctx.group = group
        ctx.set_materialize_grads(False)
        # [still counted, generation]: counted once ``BackwardCalls.route_inputs`` claims
        # the node; cleared when backward runs, else its finalizer tells the group when
        # the graph is freed without a backward.
        ctx.count = [False, group.calls.generation]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        counted = ctx.count[0] and ctx.count[1] == ctx.group.calls.generation
        ctx.count[0] = False
        ctx.group.post_backward_node(counted)
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, group_tangent: Any, *tangents: torch.Tensor | None) -> tuple:
        return tuple(t if t is None else t.view_as(t) for t in tangents)
