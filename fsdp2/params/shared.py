"""A parameter that two ``fully_shard`` groups would both manage (tied weights split
across groups, or calls made top-down), and the error that names it.

The error names both parameters by their fully qualified names. A call on a module
that holds both finds them at once (names relative to that module: the full names when
it is the root). A call on a sibling cannot know the model around it: the conflict is
kept on its group and raised at the root's lazy init (its first forward), which knows
every name, before any collective runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch.nn as nn

if TYPE_CHECKING:
    from .param import FSDPParam


class SharedParam(NamedTuple):
    module: nn.Module  # the module fully_shard was called on
    name: str  # the parameter's name under it
    other: FSDPParam  # the parameter of an earlier group that is the same tensor


def find_under(module: nn.Module, other: FSDPParam) -> str | None:
    """``other``'s name under ``module``, if one of its owner modules lies there."""
    names = {id(m): prefix for prefix, m in module.named_modules()}
    return _name_in(names, other)


def shared_error(fqn: str, other_fqn: str, where: str) -> ValueError:
    return ValueError(
        f"parameter '{fqn}' ({where}) is the same tensor as '{other_fqn}', which an earlier "
        "fully_shard call manages. If that call was on a parent of this module, apply fully_shard "
        "bottom-up (blocks first, then the root); if the parameter is shared (tied weights), put the "
        "modules that share it in one group: fully_shard([module_a, module_b]), or fully_shard only "
        "on their common parent"
    )


def raise_deferred(conflicts: list[SharedParam], root: nn.Module) -> None:
    """At the root's lazy init: the first conflict found by a call on a sibling, named
    by full names under ``root``."""
    if not conflicts:
        return
    names = {id(m): prefix for prefix, m in root.named_modules()}
    module, name, other = conflicts[0]
    prefix = names.get(id(module))
    fqn = f"{prefix}.{name}" if prefix else name
    other_fqn = _name_in(names, other)
    where = f"found by the fully_shard call on '{prefix or '<root>'}'"
    if other_fqn is None:  # its group lies outside the model being run: its name there
        other_fqn, where = other.fqn, where + "; the other one's name under its own fully_shard module"
    raise shared_error(fqn, other_fqn, where)


def _name_in(names: dict[int, str], other: FSDPParam) -> str | None:
    for owner, attr in other.owners:
        prefix = names.get(id(owner))
        if prefix is not None:
            return f"{prefix}.{attr}" if prefix else attr
    return None
