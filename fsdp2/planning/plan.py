"""A plan: the groups of one model, how each is sharded, checkpointed and offloaded; it
prints as a table and as code, and applies as the calls that code shows.

``Plan.calls()`` is the one list both ``apply`` and ``code`` read: per group, in order,
``checkpoint(block, ...)`` where activation checkpointing was chosen, then one
``fully_shard(modules, ...)``; the root's call last.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..api import MixedPrecisionPolicy
from .groups import AC_CHOICES, Group
from .render import experts_on, render_calls, render_table


def selective_context() -> tuple[Any, Any]:
    """``context_fn`` of selective activation checkpointing: the outputs of matmuls and
    attention are saved, everything else (norms, activations, elementwise) recomputed."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    saved = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default,
             aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


class Experts(NamedTuple):
    """The routed-experts module (fqn) whose parameters a call places itself: on the
    expert mesh (``own_mesh``) or on the call's mesh, sharded on dim 1 (fewer experts
    than ranks)."""

    fqn: str
    own_mesh: bool


@dataclass
class Estimate:
    """The tracked peak of one training step at the job's world size (bytes)."""

    peak: int
    split: dict[str, int]
    phase: str
    budget: int | None = None
    note: str = ""
    settings: tuple = ()  # the plan's (reshard_after_forward, ac, offload) per group when measured

    @property
    def fits(self) -> bool:
        return self.budget is None or self.peak <= self.budget


class Plan:
    """``fsdp2.plan``'s result. ``groups`` are in call order, the root last; change their
    ``reshard_after_forward``, ``ac`` and ``offload`` (or use ``edit``) before ``apply``."""

    def __init__(self, groups: list[Group], *, mesh: DeviceMesh | None, mp_policy: MixedPrecisionPolicy | None,
                 expert_mesh: DeviceMesh | None,
                 ignored_fqns: list[str], fingerprint: dict[str, tuple[int, ...]],
                 blocks_from: str) -> None:
        self.groups = groups
        self.mesh, self.mp_policy, self.expert_mesh = mesh, mp_policy, expert_mesh
        # By name: ``apply`` ignores these parameters of the model it is given (a copy too).
        self.ignored_fqns = ignored_fqns
        self.estimate: Estimate | None = None
        self.blocks_from = blocks_from
        self._fingerprint = fingerprint

    # ------------------------------------------------------------------ editing
    def settings(self) -> tuple[tuple[bool | int | None, str, bool], ...]:
        """Each group's ``(reshard_after_forward, ac, offload)``, in order."""
        return tuple((g.reshard_after_forward, g.ac, g.offload) for g in self.groups)

    def adopt(self, other: Plan) -> Plan:
        """Take ``other``'s settings and estimate: ``other`` is a plan of the same model
        made elsewhere (fitted before launch with ``world_size=``; this one made with the
        job's mesh). Its groups must be this plan's."""
        if [g.modules for g in other.groups] != [g.modules for g in self.groups]:
            raise ValueError("Plan.adopt expects a plan of the same model with the same groups; got groups "
                             f"{[g.name for g in other.groups][:4]}..., this plan has {[g.name for g in self.groups][:4]}...")
        for g, o in zip(self.groups, other.groups):
            g.reshard_after_forward, g.ac, g.offload = o.reshard_after_forward, o.ac, o.offload
        self.estimate = other.estimate
        return self

    def __getitem__(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name or name in g.modules:
                return g
        raise KeyError(f"no group named {name!r} in this plan; its groups: {', '.join(g.name for g in self.groups)}")

    def edit(self, pattern: str, **fields: Any) -> Plan:
        """Set ``fields`` (``reshard_after_forward``, ``ac``, ``offload``) on every group
        whose name matches the regular expression ``pattern`` (``fullmatch``). Checked
        first: a bad value changes nothing."""
        chosen = [g for g in self.groups if re.fullmatch(pattern, g.name)]
        if not chosen:
            raise ValueError(f"no group name matches {pattern!r}; the groups: {', '.join(g.name for g in self.groups)}")
        unknown = set(fields) - {"reshard_after_forward", "ac", "offload"}
        if unknown:
            raise TypeError(f"Plan.edit takes reshard_after_forward, ac and offload, got {sorted(unknown)}")
        for g in chosen:
            check_group(dataclasses.replace(g, **fields))
        for g in chosen:
            for k, v in fields.items():
                setattr(g, k, v)
        self.estimate = None  # no longer this plan's
        return self

    def check(self) -> None:
        """Each group's settings are ones ``apply`` can carry out (ValueError otherwise)."""
        for g in self.groups:
            check_group(g)

    # ----------------------------------------------------------------- applying
    def calls(self) -> list[tuple[str, tuple[str, ...], dict[str, Any]]]:
        """``(function, module fqns, keyword arguments)`` in order: ``"checkpoint"`` and
        ``"fully_shard"``. Keyword values are the objects passed (``mesh``...), but
        ``shard_placement_fn``: ``Experts(fqn)``, whose function ``experts_on`` makes,
        and ``ignored_params``: the parameters' names."""
        self.check()
        out: list[tuple[str, tuple[str, ...], dict[str, Any]]] = []
        for g in self.groups:
            if g.ac != "none":
                out.append(("checkpoint", g.modules, {"context_fn": selective_context} if g.ac == "selective" else {}))
            kwargs: dict[str, Any] = {"mesh": self.mesh, "mp_policy": self.mp_policy}
            if g.reshard_after_forward is not None:
                kwargs["reshard_after_forward"] = g.reshard_after_forward
            if g.offload:
                from ..api import CPUOffloadPolicy

                kwargs["offload_policy"] = CPUOffloadPolicy()
            if self.ignored_fqns:
                kwargs["ignored_params"] = self.ignored_fqns  # names: apply passes the model's parameters
            if g.experts is not None:
                kwargs["shard_placement_fn"] = Experts(g.experts, self.expert_mesh is not None)
            out.append(("fully_shard", g.modules, kwargs))
        return out

    def apply(self, model: nn.Module, fully_shard: Callable[..., Any] | None = None) -> nn.Module:
        """Carry out ``calls()`` on ``model`` (the model the plan was made for, unsharded).
        ``fully_shard`` defaults to fsdp2's; torch's may be passed for comparison."""
        self._check_model(model)
        if fully_shard is None:
            from ..fully_shard import fully_shard as ours

            fully_shard = ours
        from torch.distributed._composable import checkpoint

        for fn, modules, kwargs in self.calls():
            targets = [model.get_submodule(m) for m in modules]
            if fn == "checkpoint":
                for t in targets:
                    checkpoint(t, **kwargs)
                continue
            kwargs = dict(kwargs)
            if "ignored_params" in kwargs:
                kwargs["ignored_params"] = {model.get_parameter(n) for n in kwargs["ignored_params"]}
            if "shard_placement_fn" in kwargs:
                experts = model.get_submodule(kwargs["shard_placement_fn"].fqn)
                on = self.expert_mesh if kwargs["shard_placement_fn"].own_mesh else self.mesh
                kwargs["shard_placement_fn"] = experts_on(experts, on)
            fully_shard(targets[0] if len(targets) == 1 else targets, **kwargs)
        return model

    def _check_model(self, model: nn.Module) -> None:
        from .._module import FSDPModule

        if any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError("Plan.apply expects the unsharded model it was made for; this one is already "
                             "sharded (fully_shard ran on some of its modules)")
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        if shapes != self._fingerprint:
            missing = sorted(set(self._fingerprint) ^ set(shapes))[:3]
            raise ValueError("Plan.apply got a model other than the one planned (parameter names or shapes "
                             f"differ{', e.g. ' + ', '.join(missing) if missing else ''}); make the plan for this model")

    # ---------------------------------------------------------------- printing
    def code(self, model: str = "model") -> str:
        """The calls as Python, for ``model``, ``mesh``, ``mp_policy`` (and ``expert_mesh``,
        ``ignored_params``) in scope. Runs of blocks with one setting print as a loop."""
        return render_calls(self.calls(), model)

    def __str__(self) -> str:
        return render_table(self)

    def __repr__(self) -> str:
        return f"<fsdp2 Plan: {len(self.groups)} fully_shard calls>\n{self}"


def check_group(g: Group) -> None:
    """``g``'s settings are ones ``apply`` can carry out (ValueError otherwise)."""
    if g.ac not in AC_CHOICES:
        raise ValueError(f"group {g.name}: ac must be one of {AC_CHOICES}, got {g.ac!r}")
    if g.ac != "none" and g.kind == "root":
        raise ValueError(f"group {g.name}: activation checkpointing of the root is not planned; checkpoint blocks instead")
    r = g.reshard_after_forward
    if not (r is None or isinstance(r, bool) or (isinstance(r, int) and r > 1)):
        raise ValueError(f"group {g.name}: reshard_after_forward must be a bool, None or an int > 1, got {r!r}")
    if not isinstance(g.offload, bool):
        raise ValueError(f"group {g.name}: offload must be a bool, got {g.offload!r}")


def fingerprint(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}

