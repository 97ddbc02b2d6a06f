"""Which modules become ``fully_shard`` groups: the blocks, the embeddings, the final norm
with the output head, and the root, as torchtitan's ``apply_fsdp`` writes them by hand.

* Blocks: the classes named by Hugging Face's ``_no_split_modules`` where the model has
  them (what accelerate's transformer policy wraps), otherwise the module class that
  repeats and whose instances hold the most parameters (leaf classes such as ``Linear``
  never count); only the outermost instances.
* Embeddings: the ``nn.Embedding`` modules outside the blocks, one group.
* Head: the modules with parameters that follow the last block in registration order
  (the final norm, the output projection), one group, kept gathered after forward since
  backward starts with it.
* Tied weights: when a parameter is shared by two groups' modules, those groups merge
  into one (torchtitan's ``[tok_embeddings, norm, lm_head]``).
* Root: whatever is left; its call comes last.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

AC_CHOICES = ("none", "selective", "full")
ROOT = ""


@dataclass
class Group:
    """One ``fully_shard`` call of a plan. Edit its fields before ``Plan.apply``."""

    modules: tuple[str, ...]  # fqns of the modules of the call ("" is the root)
    kind: str  # "embeddings", "block", "head", "tied", "root"
    why: str
    params: int = 0  # elements of the parameters this call manages
    gathered_bytes: int = 0  # their unsharded bytes at the compute dtype
    reshard_after_forward: bool | int | None = True
    ac: str = "none"  # activation checkpointing of a block: none, selective, full
    offload: bool = False
    experts: str | None = None  # fqn of the experts module sharded on the expert mesh
    fqns: list[str] = field(default_factory=list, repr=False)  # the parameters it manages

    @property
    def name(self) -> str:
        if self.modules == (ROOT,):
            return "<root>"
        return self.modules[0] if len(self.modules) == 1 else "[" + ", ".join(self.modules) + "]"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of ``t``: a DTensor's local tensor (tensor or expert parallel)."""
    return t.to_local() if hasattr(t, "to_local") else t


def block_classes(model: nn.Module, given: Iterable[type | str] | None) -> tuple[set[str], str]:
    """The names of the block classes, and where they came from."""
    if given is not None:
        names = {c if isinstance(c, str) else c.__name__ for c in given}
        return names, "given as blocks="
    for m in model.modules():
        found = getattr(m, "_no_split_modules", None)
        if found:
            return set(found), f"{type(m).__name__}._no_split_modules"
    return _repeated_class(model), "the repeated class holding the most parameters"


def _repeated_class(model: nn.Module) -> set[str]:
    count: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    for name, m in model.named_modules():
        if name and any(True for _ in m.children()) and not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            count[type(m).__name__] += 1
            total[type(m).__name__] += sum(p.numel() for p in m.parameters())
    repeated = [c for c in count if count[c] >= 2 and total[c] > 0]
    return {max(repeated, key=lambda c: total[c])} if repeated else set()


def find_blocks(model: nn.Module, classes: set[str]) -> list[str]:
    """The outermost modules (not the root) whose class is a block class, in order."""
    blocks: list[str] = []
    for name, m in model.named_modules():
        if name and type(m).__name__ in classes and not any(name.startswith(b + ".") for b in blocks):
            blocks.append(name)
    return blocks


def _inside(name: str, outer: Iterable[str]) -> bool:
    return any(name == o or name.startswith(o + ".") for o in outer)


def find_groups(model: nn.Module, blocks: list[str], ignored: set[nn.Parameter]) -> list[Group]:
    """The plan's groups in forward (registration) order, the root last."""
    names = list(dict(model.named_modules()))
    own = {n: [p for p in model.get_submodule(n).parameters(recurse=False) if p not in ignored] for n in names}
    embeddings = [n for n in names if isinstance(model.get_submodule(n), nn.Embedding) and own[n]
                  and not _inside(n, blocks)]
    last = names.index(blocks[-1]) if blocks else len(names)
    head = [n for n in names[last + 1:] if own[n] and not _inside(n, blocks) and n not in embeddings
            and not _inside(n, [h for h in names[last + 1:] if h != n and own[h] and n.startswith(h + ".")])]
    groups: list[Group] = []
    if embeddings:
        groups.append(Group(tuple(embeddings), "embeddings", "input embeddings: one gather before the first block"))
    groups += [Group((b,), "block", "") for b in blocks]
    if head:
        groups.append(Group(tuple(head), "head", "final norm + output head: backward starts here, kept gathered",
                            reshard_after_forward=False))
    groups = _merge_tied(model, groups)
    groups.append(Group((ROOT,), "root", "the rest (the root's call comes last)", reshard_after_forward=None))
    _count(model, groups, ignored)
    return groups


def _merge_tied(model: nn.Module, groups: list[Group]) -> list[Group]:
    """Groups whose modules share a parameter become one (FSDP manages a parameter once)."""
    owner: dict[int, int] = {}
    merged: dict[int, int] = {}
    for gi, g in enumerate(groups):
        for m in g.modules:
            for p in model.get_submodule(m).parameters():
                first = owner.setdefault(id(p), gi)
                if first != gi:
                    merged[gi] = merged.get(first, first)
    if not merged:
        return groups
    out: list[Group] = []
    for gi, g in enumerate(groups):
        if gi in merged:
            target = groups[merged[gi]]
            target.modules = target.modules + g.modules
            target.kind, target.reshard_after_forward = "tied", False
            target.why = "tied weights: embeddings and output head share a parameter, one group, kept gathered"
        else:
            out.append(g)
    return out


def _count(model: nn.Module, groups: list[Group], ignored: set[nn.Parameter]) -> None:
    """Each group's parameters: those under its modules that no earlier group took
    (fully_shard runs bottom-up: the root's call takes what is left)."""
    taken: set[int] = {id(p) for p in ignored}
    for g in groups:
        for m in g.modules:
            for name, p in model.get_submodule(m).named_parameters():
                if id(p) not in taken:
                    taken.add(id(p))
                    g.fqns.append(f"{m}.{name}" if m else name)
                    mine = local(p)
                    g.params += mine.numel()
                    g.gathered_bytes += mine.numel() * mine.element_size()


def scale_to_dtype(groups: list[Group], dtype: torch.dtype | None) -> None:
    """Gathered bytes at ``dtype`` (the mixed-precision policy's ``param_dtype``)."""
    if dtype is None:
        return
    for g in groups:
        g.gathered_bytes = g.params * torch.empty((), dtype=dtype).element_size()


def find_experts(model: nn.Module, block: str) -> str | None:
    """The innermost module under ``block`` holding routed experts (a class named
    ``...Experts`` other than shared experts), or None."""
    found = None
    for name, m in model.get_submodule(block).named_modules():
        cls = type(m).__name__.lower()
        if name and cls.endswith("experts") and "shared" not in cls and any(True for _ in m.parameters()):
            found = f"{block}.{name}"
    return found
