"""``fsdp2.gathered``: a whole generation at one all-gather per group.

Generating N tokens with a sharded model runs N forwards, and each group that reshards
after its forward is gathered N times (N x L all-gathers for L groups). DeepSpeed
ZeRO-3 users generate with the parameters gathered once (TRL's default for ZeRO-3).
Inside ``with fsdp2.gathered(model):`` each group is gathered at its first forward and
stays gathered to the end of the block (within ``max_bytes``; the rest as usual), then
reshards. ``register_gathered_method(model, "generate")`` runs every call of a method
inside such a block: the one line a trainer that calls ``model.generate`` needs.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from .._module import groups_under
from ..runtime.gathered import GatheredBlock


@contextlib.contextmanager
def gathered(model: nn.Module, *, max_bytes: int | None = None) -> Iterator[None]:
    """Keep ``model``'s ``fully_shard`` groups gathered from their first forward inside the
    block to its end: a generation of N tokens gathers each group once, not N times.

    ``max_bytes`` bounds what the block keeps on this rank (the groups' gathered
    parameters, in their compute dtype): groups are admitted in the order their first
    forwards in the block end, while they fit; the others gather and reshard per forward
    as usual.
    ``None`` keeps every group. Whatever the block keeps, ``fsdp2.held_bytes`` counts as
    "unsharded parameters".

    The block reshards what it kept when it ends, also when it ends by an exception. A
    backward inside the block is exact (a kept group reduces its gradients as with
    ``reshard_after_forward=False``, and reshards after backward as usual), and so is
    an optimizer step (it reshards the groups first, as always). Groups that
    ``unshard()`` holds stay as they are. A block inside another over the same groups
    leaves them to the outer one. Every rank must enter and leave the block at the same
    point of its forwards (the decisions are the same on every rank, so are the
    collectives). A model that ``fully_shard`` was not (yet) applied to passes through.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp2.gathered(model) takes an nn.Module, got {type(model).__name__}")
    _check_budget("fsdp2.gathered", max_bytes)
    # Groups an enclosing block already holds are that block's (its budget, its end).
    groups = [g for g in groups_under(model) if g.gathered_block is None]
    block = GatheredBlock(max_bytes)
    for g in groups:
        g.open_gathered_block(block)
    try:
        yield
    finally:
        for g in groups:
            g.close_gathered_block()
        block.release()


def register_gathered_method(module: nn.Module, method_name: str, *, max_bytes: int | None = None) -> None:
    """Run every call of ``module.<method_name>`` (e.g. ``generate``) inside
    ``fsdp2.gathered(module, max_bytes=max_bytes)``. May be called before ``fully_shard``
    (a trainer that shards the model later, e.g. TRL's GRPOTrainer through accelerate):
    each call gathers what is sharded by then. Composes with
    ``register_fsdp_forward_method`` in either order."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_gathered_method expects an nn.Module, got {type(module).__name__}")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register")
    _check_budget("register_gathered_method", max_bytes)

    @functools.wraps(getattr(method, "__func__", method))  # the signature as it was
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with gathered(self, max_bytes=max_bytes):
            return method(*args, **kwargs)  # as it was: bound to ``module``, or set on it

    setattr(module, method_name, types.MethodType(wrapped, module))


def _check_budget(caller: str, max_bytes: object) -> None:
    if max_bytes is None:
        return
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(
            f"{caller}(max_bytes=...) takes a number of bytes >= 0, or None to keep every group, "
            f"got {max_bytes!r}"
        )
