"""Parameters typed with the ``spmd_types`` package (torchtitan's default SPMD backend).

Such a parameter is a plain tensor whose SPMD type (``spmd_types.assert_type``) says,
per axis of the mesh it is computed on, how its local value relates to the other
ranks': ``R`` (the same on every rank), ``I``, ``S(d)`` (split along ``d``), ``P``.
``fully_shard(mesh=full_mesh, dp_mesh_dims=...)`` takes it as the DTensor on the full
mesh that type describes (``Replicate()`` on the data-parallel dims, which must be typed
``R`` or not at all, fsdp2 reducing their gradients), shards that DTensor like any other,
and shows the model a plain unsharded tensor again, typed as it was, before each forward.
Its gradient arrives plain; its meaning on the full mesh is the backward type of each
axis (``R`` -> ``Partial()``, ``S(d)`` -> ``Shard(d)``, ``I`` -> ``Replicate()``), from
which the other SPMD parameters' path takes it on. A parameter typed ``P`` (a partial
sum) on any axis is refused: fsdp2's shards hold values, not partial sums.

fsdp2's own work in the hooks (gathers, copies, reductions) runs with type checking
paused (``paused_typecheck``); what the model sees (its inputs, the unsharded
parameters, its outputs) stays typed. The package is optional: nothing here imports it
unless the process already did (a tensor can carry a type only then), so ``import
fsdp2`` does not pay its import time.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from .._compat import spmd_types_package
from ..comm.mesh import SpmdDims

_NO_PAUSE = contextlib.nullcontext()
# Autograd Functions of fsdp2's that the type checker is to treat as local ops, until
# registered with it.
# process-wide: the checker's registry is itself process-wide, and the classes are fsdp2's
# own (not a model's): registering them once serves every model.
_registered: list[type] = []


def register_local_function(cls: type) -> type:
    """Let the type checker pass types through ``cls`` (an identity on values, as
    ``calls._PostBackward``): registered once ``spmd_types`` is imported, at the first
    ``fully_shard`` of a typed parameter or the first pause, whichever comes first."""
    _registered.append(cls)
    return cls


def _register_functions(package: types.ModuleType) -> None:
    while _registered:
        package.register_local_autograd_function(_registered.pop())


def paused_typecheck() -> contextlib.AbstractContextManager[None]:
    """A context in which ``spmd_types`` checks nothing (fsdp2's own ops on the
    unsharded parameters and gradients), or a no-op when it is not checking."""
    package = spmd_types_package()
    if package is None or not package.is_type_checking():
        return _NO_PAUSE
    if _registered:
        _register_functions(package)
    return package.no_typecheck()


def pausing_typecheck(fn: Callable) -> Callable:
    """``fn`` run inside ``paused_typecheck()`` (a hook fsdp2 installs)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        with paused_typecheck():
            return fn(*args, **kwargs)

    return paused


@dataclass(frozen=True)
class SpmdAnnotation:
    """How one typed parameter lives on its full mesh, and the type to show it with."""

    mesh: Any  # the full mesh fully_shard got (a DeviceMesh)
    placements: tuple[Placement, ...]  # its DTensor's on the full mesh (Replicate() on dp dims)
    grad_placements: tuple[Placement, ...]  # its plain gradient's there (Partial() on dp dims)
    local_type: dict  # per compute-mesh axis, restored on the unsharded tensor
    partition_spec: Any  # the spec it was typed with (S(d) entries), or None

    def as_dtensor(self, param: torch.Tensor) -> DTensor:
        """The parameter as the DTensor its type describes (its value is the local tensor;
        made outside the checker, whose own ``from_local`` rule wants ``I`` where we put
        ``Replicate()``: ``fully_shard`` may run inside a type-checking context)."""
        with paused_typecheck():
            return DTensor.from_local(param.data, self.mesh, self.placements, run_check=False)

    def grad_dtensor(self, grad: torch.Tensor, shape: torch.Size, stride: tuple[int, ...]) -> DTensor:
        """A plain gradient of the unsharded tensor, as a DTensor of the parameter's shape."""
        with paused_typecheck():
            return DTensor.from_local(grad, self.mesh, self.grad_placements, run_check=False, shape=shape, stride=stride)

    def restore(self, tensor: torch.Tensor | None) -> None:
        """Type ``tensor`` (the unsharded parameter) as the parameter was, while checking."""
        package = spmd_types_package()
        if tensor is not None and package is not None and package.is_type_checking() and self.local_type:
            package.assert_type(tensor, self.local_type, partition_spec=self.partition_spec)


def annotation_of(p: torch.Tensor, fqn: str, spmd: SpmdDims | None) -> SpmdAnnotation | None:
    """The annotation of a plain parameter typed with ``spmd_types`` that a
    ``dp_mesh_dims`` call shards over ``spmd.mesh``, or None if it carries no type.
    Raises ValueError for a type that does not describe a tensor on that mesh, and for a
    typed parameter of a call without ``dp_mesh_dims`` (``spmd`` None): sharded over a
    data-parallel mesh alone, its type, and the reduce over its other axes (an ``R``
    weight's partial gradients over tp), would be lost."""
    package = spmd_types_package()
    if package is None or isinstance(p, DTensor):
        return None
    local = dict(package.get_local_type(p))
    spec = package.get_partition_spec(p)
    if not local and spec is None:
        return None
    if spmd is None:
        raise ValueError(
            f"parameter {fqn} is typed with spmd_types, but fully_shard got no dp_mesh_dims: pass the "
            "full mesh its type names and which of its dims are data-parallel, "
            "fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(shard=...))"
        )
    _register_functions(package)
    return _Resolver(package, p, fqn, spmd, local, spec).annotation()


class _Resolver:
    """One typed parameter's type read against the full mesh ``fully_shard`` got."""

    def __init__(self, package: Any, p: torch.Tensor, fqn: str, spmd: SpmdDims, local: dict, spec: Any) -> None:
        from spmd_types._mesh_axis import flatten_axes
        from spmd_types.types import partition_spec_to_shard_types

        self.st, self.fqn, self.local, self.spec = package, fqn, local, spec
        self.mesh = mesh = spmd.mesh
        names = mesh.mesh_dim_names
        if names is None:
            raise AssertionError("fsdp2 internal error: an SPMD mesh has mesh_dim_names")
        self.names = names
        self.axes = [package.MeshAxis.of(mesh.get_group(n)) for n in names]  # one per mesh dim
        self.dp = spmd.dp
        self.dp_axis = flatten_axes(tuple(a for i, a in enumerate(self.axes) if i in self.dp))
        # Per axis: the local type, with S(d) where the partition spec splits dim d over it.
        self.types = dict(local)
        if spec is not None:
            self.types.update(partition_spec_to_shard_types(spec))

    def _same_ranks(self, a: Any, b: Any) -> bool:
        from spmd_types._mesh_axis import flatten_axes

        left, right = self.st.normalize_mesh(frozenset(a)), self.st.normalize_mesh(frozenset(b))
        if not left or not right:
            return left == right
        return flatten_axes(tuple(left)) == flatten_axes(tuple(right))

    def _compute_axes(self) -> tuple:
        """The axes the parameter is computed on (and its type restored over): the typed
        ones when they cover the full mesh, else the current ``spmd_types`` mesh."""
        typed = tuple(self.types)
        if self._same_ranks(typed, self.axes):
            return typed
        current = self.st.current_mesh()
        if current is None:
            raise ValueError(
                f"parameter {self.fqn} is typed with spmd_types on the axes {typed}, which do not cover "
                f"the mesh fully_shard got ({self.names}: {tuple(self.axes)}), and no current spmd_types "
                "mesh names the rest: type it on every axis of that mesh, or call fully_shard inside "
                "spmd_types.set_current_mesh(...)"
            )
        compute = tuple(current)
        stray = [a for a in self.local if a not in compute]
        if stray:
            raise ValueError(
                f"parameter {self.fqn} is typed with spmd_types on {tuple(stray)}, axes outside the current "
                f"spmd_types mesh {compute}: type it on that mesh's axes only"
            )
        if not self._same_ranks(compute, self.axes):
            raise ValueError(
                f"parameter {self.fqn} is computed on the spmd_types mesh {compute}, which does not span the "
                f"ranks of the mesh fully_shard got ({self.names}): shard it over the mesh it is typed on"
            )
        return compute

    def _storage_type(self, i: int) -> Any:
        """The type of mesh dim ``i`` (not data-parallel): given, or R for a size-1 dim."""
        axis = self.axes[i]
        kind = self.types.get(axis)
        if kind is None:
            if axis.size() == 1:
                return self.st.R
            raise ValueError(
                f"parameter {self.fqn} is typed with spmd_types on {tuple(self.types)} but not on the mesh "
                f"dim {self.names[i]!r} ({axis}), which fully_shard does not shard over: give its type on "
                "that dim (R, I or S(d)) too"
            )
        return kind

    def _check_axes(self) -> None:
        storage = {a for i, a in enumerate(self.axes) if i not in self.dp}
        for axis, kind in self.types.items():
            if axis <= self.dp_axis:
                if kind is not self.st.R:
                    raise ValueError(
                        f"parameter {self.fqn} is typed {kind} on the data-parallel axis {axis}; fully_shard "
                        "shards it there and reduces its gradients, so it must be typed R (or not at all) there"
                    )
            elif axis not in storage:
                raise ValueError(
                    f"parameter {self.fqn} is typed on the axis {axis}, which is neither a dim of the mesh "
                    f"fully_shard got ({self.names}) nor part of its data-parallel dims"
                )

    def _placement(self, kind: Any) -> Placement:
        try:
            return self.st.spmd_type_to_dtensor_placement(kind)
        except ValueError as e:
            raise ValueError(f"parameter {self.fqn}: its spmd_types type {kind} has no DTensor placement ({e})") from None

    def annotation(self) -> SpmdAnnotation:
        compute = self._compute_axes()
        self._check_axes()
        placements: list[Placement] = []
        grads: list[Placement] = []
        for i in range(len(self.axes)):
            if i in self.dp:
                placements.append(Replicate())
                grads.append(Partial())
                continue
            kind = self._storage_type(i)
            if kind is self.st.P:
                raise ValueError(
                    f"parameter {self.fqn} is typed P (a partial sum) on the mesh dim {self.names[i]!r}; "
                    "fully_shard takes parameters whose value is known on each rank: type it R, I or S(d) there"
                )
            placements.append(self._placement(kind))
            grads.append(self._placement(kind.backward_type()))
        restored = {axis: self.local.get(axis, self.st.R) for axis in compute}
        return SpmdAnnotation(self.mesh, tuple(placements), tuple(grads), restored, self.spec)
