"""Hook registration: what one ``fully_shard``-ed module carries (``FSDPState``), the
forward hooks, and the step's start at the root's forward (lazy init makes the root
context: ``root.py``)."""

from __future__ import annotations

import sys
from typing import Any, cast

import torch
import torch.nn as nn

from ..optim import local_step
from ..params.spmd_annotations import paused_typecheck
from .group import ParamGroup, ShardState
from .root import RootContext


class FSDPState:
    """What one ``fully_shard``-ed module carries: its group and its hooks."""

    def __init__(self, module: nn.Module, group: ParamGroup) -> None:
        self.module = module
        self.group = group
        self._handles = [
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward_hook, prepend=False, always_call=True),
        ]

    @property
    def _comm_ctx(self) -> FSDPState:
        """torch 2.15's schedules compare stages' communication contexts by identity: each
        state is its own (``FSDPModule._get_fsdp_state``)."""
        return self

    # The hooks run eagerly also inside a compiled module (``block.compile()``, then
    # fully_shard): their collectives and bookkeeping are not traceable, and the
    # module's own forward compiles as one graph between them.
    @torch.compiler.disable
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self.pre_forward(args, kwargs)

    @torch.compiler.disable
    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if output is None and sys.exc_info()[1] is not None:
            self.on_forward_exception()  # ``always_call``: forward raised
            return None
        return self.post_forward(output)

    def on_forward_exception(self) -> None:
        """Forward raised: free the gathered parameters (the module shows the sharded ones
        again; a gather in flight is left to the reset at the next forward). Not in a
        checkpoint's recompute, which stops early by raising once it has recomputed what
        backward needs: backward goes on reading the parameters."""
        group = self.group
        ctx = cast("RootContext | None", group.ctx)  # the root's, made by ``RootContext.lazy_init``
        if ctx is not None and (ctx.in_backward or ctx.reduction is not None):
            return  # in a recompute; or the forward was refused before it changed anything
        if group.shard_state in (ShardState.UNSHARDED, ShardState.PARTIAL):
            group.reshard()
        if ctx is not None:
            ctx.needs_reset = True

    def pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with paused_typecheck():
            ctx = self._begin_forward()
        if not ctx.in_backward:  # a recompute may stop early, without its post_forward
            ctx.active_forwards += 1
        return self.group.pre_forward(self.module, args, kwargs)

    def _begin_forward(self) -> RootContext:
        """Lazy init at the first forward; a root forward starts the step."""
        ctx = cast("RootContext | None", self.group.ctx)
        if ctx is None:
            ctx = RootContext.lazy_init(self.group, self.module)
        if ctx.reduction is not None:
            ctx.check_no_reduction_pending("forward")
        # A root forward inside a registered method still running (``generate`` calls
        # ``forward`` per token) continues that method's step.
        if ctx.root is self.group and (not ctx.open_methods or ctx.needs_reset or ctx.in_backward):
            if any(g.unfinished_steps for g in ctx.groups):
                local_step.repair_owned(ctx.groups)  # an optimizer step of this model raised midway
            ctx.start_iteration()
        return ctx

    def call_registered(self, method: Any, args: tuple, kwargs: dict) -> Any:
        """A method registered with ``register_fsdp_forward_method`` (``generate``), inside
        this module's forward hooks. It counts as open until it returns or raises
        (whatever it raises: a ``finally``), so root forwards it runs continue its step."""
        try:
            args, kwargs = self.pre_forward(args, kwargs)
        except BaseException:
            self.on_forward_exception()
            raise
        ctx = cast("RootContext | None", self.group.ctx)
        if ctx is None:
            raise AssertionError("fsdp2 internal error: no step context after pre_forward")
        ctx.open_methods += 1
        try:
            output = method(*args, **kwargs)
        except BaseException:
            self.on_forward_exception()
            raise
        finally:
            ctx.open_methods -= 1
        return self.post_forward(output)

    def post_forward(self, output: Any) -> Any:
        ctx = cast("RootContext | None", self.group.ctx)
        if ctx is None:
            raise AssertionError("fsdp2 internal error: expected ctx is not None")
        if ctx.in_backward:
            return self.group.post_forward(self.module, output)
        ctx.active_forwards -= 1
        output = self.group.post_forward(self.module, output)
        if ctx.root is self.group:
            with paused_typecheck():
                ctx.end_forward()
        return output
