"""A ``with fsdp2.gathered(model)`` block as the groups see it: which of them stay
gathered from their first forward in the block to its end, within a byte budget.

Generating N tokens runs N forwards; a group that reshards after each gathers its
parameters N times. Inside a block every group admitted (at the end of its first
forward, in that order, while the budget has room) skips resharding after its forwards,
so it is gathered once for the whole block; the others keep their usual resharding. The decision
depends only on the groups' sizes and forward order, the same on every rank, so every
rank issues the same collectives. A backward inside the block is exact: an admitted
group behaves as with ``reshard_after_forward=False`` (its gradients are reduced as
usual, it reshards after backward as it would, and its next forward in the block
gathers it once more). The block's end reshards what it kept (``release``).
"""

from __future__ import annotations

from typing import Protocol


class HeldGroup(Protocol):
    """What the block needs of a group (``group.ParamGroup``: it passes itself in)."""

    def gathered_bytes(self) -> int: ...
    def end_of_gathered_block(self) -> None: ...


class GatheredBlock:
    """The groups an open ``fsdp2.gathered`` block keeps gathered, and its budget."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes  # None: every group
        self.used = 0  # gathered bytes of the admitted groups
        self.decided: dict[int, bool] = {}  # id(group) -> admitted, fixed at its first forward
        self.admitted: list[HeldGroup] = []

    def keeps(self, group: HeldGroup) -> bool:
        """Whether ``group`` stays gathered after its forwards in this block; decided at
        the first call (the end of its first forward), in forward order while the
        budget lasts."""
        decided = self.decided.get(id(group))
        if decided is None:
            size = group.gathered_bytes()
            decided = self.max_bytes is None or self.used + size <= self.max_bytes
            self.decided[id(group)] = decided
            if decided:
                self.used += size
                self.admitted.append(group)
        return decided

    def has_admitted(self, group: HeldGroup) -> bool:
        """``keeps`` without deciding: False for a group whose forward has not run yet."""
        return self.decided.get(id(group), False)

    def release(self) -> None:
        """The block ends: its groups reshard what it kept."""
        for group in self.admitted:
            group.end_of_gathered_block()
