"""One managed parameter: its sharded DTensor, its unsharded ``nn.Parameter``, and
where their data lives.

An ``FSDPParam`` owns no storage. Its shard is a view into its bucket's sharded flat
buffer (so the all-gather needs no copy-in) and its unsharded parameter is a leaf
``nn.Parameter`` over a view of the bucket's unsharded flat buffer: one object for the
parameter's whole life, so every autograd graph built on it (a forward, an activation
checkpoint's recompute, a direct call of an inner module) accumulates into its
``.grad``. Its owner modules register whichever of the two matches the group's shard
state. Which slices of which dim are this rank's is its ``ShardLayout``'s business;
0-dim parameters are replicated (``Replicate()``) and their gradients summed over ranks.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from ..comm.mesh import MeshInfo
from .dtensor import (
    concatenate_meshes,
    contiguous_stride,
    make_dtensor,
    make_parameter,
    spec_where_it_is,
    spmd_placements,
)
from .layout import ShardLayout
from .spmd_annotations import SpmdAnnotation
from .subclass import KeepObject, SubclassWrapper, has_extension, late_wrapper

# id(unsharded leaf) -> its FSDPParam (weakly), to tell an optimizer that was handed the
# unsharded parameters (``unsharded_owner``).
# process-wide: the global optimizer hooks see only tensors; an entry is weak and is
# trusted only if its FSDPParam still holds that very tensor, so models never mix.
_LEAF_OWNER: weakref.WeakValueDictionary[int, FSDPParam] = weakref.WeakValueDictionary()


def unsharded_owner(t: torch.Tensor) -> FSDPParam | None:
    """The ``FSDPParam`` whose unsharded leaf ``t`` is, if any."""
    fp = _LEAF_OWNER.get(id(t))
    return fp if fp is not None and fp.unsharded is t else None


# id(sharded parameter) -> its FSDPParam: which parameters fsdp2 manages. Weak on the
# FSDPParam, not on the tensor: a weakref on a parameter makes ``module._apply`` unable
# to swap it.
# process-wide: as ``_LEAF_OWNER`` (the optimizer hooks and clip see only tensors).
_SHARDED_OWNER: weakref.WeakValueDictionary[int, FSDPParam] = weakref.WeakValueDictionary()


def sharded_owner(t: torch.Tensor) -> FSDPParam | None:
    """The ``FSDPParam`` whose sharded parameter ``t`` is, if any."""
    fp = _SHARDED_OWNER.get(id(t))
    return fp if fp is not None and fp.sharded is t else None


class _BucketCommit(Protocol):
    """What is read of a bucket's ``GradCommit`` through ``FSDPParam.bucket``."""

    def flat_grad(self) -> torch.Tensor | None: ...


class HoldingBucket(Protocol):
    """What is read of the ``FlatBucket`` holding a parameter (``FSDPParam.bucket``)."""

    @property
    def params(self) -> list[FSDPParam]: ...
    @property
    def scalars(self) -> list[FSDPParam]: ...
    @property
    def shard_numel(self) -> int: ...
    @property
    def sharded_flat(self) -> torch.Tensor: ...
    @property
    def commit(self) -> _BucketCommit: ...

    def optimizer_flat_alias(self) -> torch.Tensor: ...


class HoldingGroup(Protocol):
    """What is read of the ``ParamGroup`` holding a parameter (``FSDPParam.group()``):
    the optimizer steps in flight over it (``optim/local_step.py``)."""

    @property
    def unfinished_steps(self) -> list[weakref.ref]: ...

    def note_unfinished_step(self, optimizer_ref: weakref.ref) -> None: ...
    def keep_unfinished_steps(self, keep: Callable[[weakref.ref], bool]) -> None: ...


class FSDPParam:
    """One parameter: where its shard sits (``layout``), its sharded ``nn.Parameter`` and
    its unsharded leaf.

    A tensor-parallel parameter (already a DTensor on a TP mesh) is sharded as its local
    tensor: its sharded DTensor lives on the data-parallel and TP mesh dimensions
    together, and its unsharded leaf is the TP DTensor again."""

    def __init__(
        self,
        fqn: str,
        owners: list[tuple[nn.Module, str]],
        param: torch.Tensor,
        info: MeshInfo,
        dim: int,
        annotation: SpmdAnnotation | None = None,
    ) -> None:
        self.fqn = fqn
        # A plain parameter typed with spmd_types: sharded as the DTensor its type
        # describes, shown to the model as a plain tensor typed again.
        self.annotation = annotation
        if annotation is not None:
            param = annotation.as_dtensor(param)
        self.comm = info  # the mesh it is sharded over (its bucket's)
        self.owners = owners  # every (module, attribute) registering this parameter (tied weights)
        self.shape = param.shape  # the global shape, as the DTensors report it
        self.stride = contiguous_stride(tuple(param.shape))
        self.dtype = param.dtype
        # Set by ``fully_shard`` from the policy: the dtype it is gathered in (``None``:
        # its own); and from the parameter: the dtype its gradient comes in, an explicit
        # ``grad_dtype`` (kept through dtype changes) or its own dtype.
        self.policy_dtype: torch.dtype | None = None
        self.grad_dtype: torch.dtype = param.dtype
        self.explicit_grad_dtype = False
        self.tp: tuple[DeviceMesh, tuple[Placement, ...]] | None = None
        local_shape = param.shape
        local = param
        if isinstance(param, DTensor):
            self.tp = (param.device_mesh, tuple(param.placements))
            local_shape = param._local_tensor.shape
            local = param._local_tensor
        # A subclass that customizes its all-gather (``bucket/extension.py``) keeps its class: as a
        # view of the bucket's flat buffer rebuilt around it (``wrapper``, one inner
        # tensor), or else as a shard of its own made through its own ops (``dispatched``).
        self.extension = has_extension(local)
        self.wrapper: SubclassWrapper | KeepObject | None = None
        if self.extension:
            _check_extension_param(fqn, param, dim)
            self.wrapper = SubclassWrapper.of(local)
        self.dispatched = self.extension and self.wrapper is None
        self.layout = ShardLayout(local_shape, dim, info.shard_size, info.shard_rank)
        # Read on the hot path (deposit, reduce, commit): plain attributes.
        self.is_replicated = self.layout.is_replicated
        self.shard_numel = self.layout.shard_numel
        self.local_shape = self.layout.local_shape
        fsdp: Placement = Replicate() if self.layout.is_replicated else Shard(dim)
        # Mesh dims of the unsharded DTensor whose gradient placements are left to the
        # reduce (SPMD meshes: the data-parallel dims); the rest are redistributed to tp's.
        self.dp_dims: frozenset[int] = frozenset()
        self.placements: tuple[Placement, ...]
        if info.spmd is not None:
            if self.tp is None:
                raise AssertionError("fsdp2 internal error: SPMD parameters are DTensors")
            self.mesh, self.placements = spmd_placements(info.spmd, self.tp[1], fsdp, dim)
            self.dp_dims = info.spmd.dp
        elif self.tp is None:
            self.mesh = info.mesh
            self.placements = info.dp_placements(fsdp)
        else:
            tp_mesh, tp_placements = self.tp
            self.mesh = concatenate_meshes(info.mesh, tp_mesh, fqn)
            # TP shards this dim first; the data-parallel shards of its local tensor then
            # interleave with the TP shards (``_StridedShard``), as torch describes them.
            split = math.prod(
                tp_mesh.size(i) for i, pl in enumerate(tp_placements) if isinstance(pl, Shard) and pl.dim == dim
            )
            if split > 1 and isinstance(fsdp, Shard):
                fsdp = _StridedShard(dim, split_factor=split)
            self.placements = info.dp_placements(fsdp) + tp_placements
        self.offset = -1  # element offset of this shard in the bucket's per-rank section
        self.rs_index = -1  # index among the bucket's reduced parameters; -1 when frozen
        self.bucket_index = -1  # index in the bucket's parameter list
        self.bucket: HoldingBucket | None = None  # the FlatBucket holding this parameter
        self.group: Callable[[], HoldingGroup | None] = lambda: None  # weak reference to the ParamGroup holding it
        self.sharded: DTensor | None = None  # an ``nn.Parameter`` (``make_parameter``)
        self.unsharded: nn.Parameter | None = None  # the unsharded leaf (set by the bucket)
        self._grad_acc: torch.autograd.graph.Node | None = None  # its AccumulateGrad node, held (``_settle_holders``)
        self._quiet_holders = (-1, 0)
        self._alias: tuple[torch.Tensor, torch.Tensor] | None = None  # (local shard, its alias)
        self._tp_pending: DTensor | None = None  # TP gradient kept Partial while accumulating

    def gained_extension(self) -> tuple[bool, SubclassWrapper | KeepObject | None]:
        """At lazy init: whether its local tensor gained all-gather hooks since
        ``fully_shard``, and the wrapper to gather it through (``late_wrapper``). Only
        checks (raising on what cannot be gathered): ``take_extension`` moves it, once
        every parameter of the group passed."""
        if self.extension or self.sharded is None:
            return False, None
        local = self.sharded._local_tensor
        if not has_extension(local):
            return False, None
        _check_extension_param(self.fqn, self.sharded if self.tp is not None else local, self.layout.dim)
        return True, late_wrapper(self.fqn, local)

    def take_extension(self, wrapper: SubclassWrapper | KeepObject | None) -> None:
        """From now on it gathers through its hooks; the caller re-buckets it."""
        self.extension, self.wrapper = True, wrapper
        self.dispatched = wrapper is None

    def local_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the parameter's value ``full``: its own local tensor (a TP
        DTensor's local tensor), or the global value (split for TP first, locally)."""
        if self.wrapper is not None:
            full = self.wrapper.inner(full)
        if self.tp is not None:
            if isinstance(full, DTensor):
                full = full.to_local()
            elif full.shape == self.shape:
                full = distribute_tensor(full, self.tp[0], self.tp[1], src_data_rank=None).to_local()
        return self.layout.local_chunk(full)

    def dispatch_shard(self, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's shard of ``value`` (the full parameter, or already this rank's
        shard), a tensor of the subclass's own class and storage on ``device``, made by
        its own ops (``narrow``, ``new_zeros``, ``copy_``) as torch makes it: for
        subclasses ``wrapper`` cannot rebuild."""
        rows = value if tuple(value.shape) == self.local_shape else self.layout.local_chunk(value)
        shard = rows.new_zeros(self.local_shape)
        if rows.device.type != "meta":
            shard.copy_(rows)
        return shard if shard.device == device else shard.to(device)

    def new_sharded(self, local: torch.Tensor, requires_grad: bool) -> DTensor:
        """The sharded ``nn.Parameter`` over ``local`` (a view of the bucket's flat buffer),
        as the subclass the parameter was when it has an all-gather extension."""
        if self.wrapper is not None:
            local = self.wrapper.wrap(local)
        # ``local`` itself, not a detached alias: hooks bound to it (``KeepObject``) stay bound.
        spec = spec_where_it_is(local, self.mesh, self.placements, self.shape, self.stride)
        param = make_parameter(local, spec, requires_grad)
        if self.explicit_grad_dtype:  # the original's ``grad_dtype`` carries over
            param.grad_dtype = self.grad_dtype
        return param

    def to_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap a local shard of this parameter as a DTensor of the full shape, where the
        shard is (an offloaded one stays on the host)."""
        return make_dtensor(local, spec_where_it_is(local, self.mesh, self.placements, self.shape, self.stride))

    def grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """Like ``to_dtensor`` for a gradient, reusing the parameter's DTensor spec: this
        runs for every parameter every step, and building a spec costs ~80 us."""
        spec = getattr(self.sharded, "_spec", None)
        if spec is None or spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
            return self.to_dtensor(local)
        return make_dtensor(local, spec)  # at offset 0 in its wrapper: the gradient saves

    def optimizer_alias(self, local: torch.Tensor) -> torch.Tensor:
        """A plain tensor sharing ``local``'s data, stepped by the optimizer in its place
        (``fsdp2.optim.local_step``); made once per local shard."""
        if self._alias is None or self._alias[0] is not local:
            self._alias = (local, local.detach())
        return self._alias[1]

    def forget_alias(self) -> None:
        """Drop the optimizer's alias of the local shard (its storage is being replaced)."""
        self._alias = None

    def set_sharded(self, param: DTensor) -> None:
        """``param`` is this parameter's sharded ``nn.Parameter`` from now on."""
        self.sharded = param
        _SHARDED_OWNER[id(param)] = self

    def reassigned(self) -> torch.Tensor | None:
        """What the first owner module registers instead of our sharded parameter, if a
        user assigned another one (``module.weight = nn.Parameter(...)``) since."""
        module, name = self.owners[0]
        current = module._parameters.get(name)
        return None if current is self.sharded or current is self.unsharded else current

    def register(self, value: torch.Tensor) -> None:
        """Make ``value`` what every owner module sees under this parameter's name."""
        for module, name in self.owners:
            module._parameters[name] = value  # type: ignore[assignment]

    def register_sharded(self) -> None:
        if self.sharded is None:
            raise AssertionError("fsdp2 internal error: parameter not sharded yet")
        self.register(self.sharded)

    def register_unsharded(self) -> None:
        """Show the unsharded leaf, trainable exactly when the sharded parameter is."""
        leaf, sharded = self.unsharded, self.sharded
        if leaf is None or sharded is None:
            raise AssertionError("fsdp2 internal error: no unsharded parameter")
        if leaf.requires_grad != sharded.requires_grad:
            leaf.requires_grad_(sharded.requires_grad)
            self._settle_holders()
        self.register(leaf)

    def set_unsharded(self, view: torch.Tensor) -> None:
        """A new unsharded leaf over ``view`` (at build time and after ``rebind``)."""
        requires_grad = self.sharded.requires_grad if self.sharded is not None else False
        if self.tp is not None and self.annotation is None:
            view = DTensor.from_local(
                view, self.tp[0], self.tp[1], run_check=False, shape=self.shape, stride=self.stride
            )
        self.unsharded = nn.Parameter(view, requires_grad=requires_grad)
        _LEAF_OWNER[id(self.unsharded)] = self
        self._settle_holders()

    def _settle_holders(self) -> None:
        """Hold the leaf's AccumulateGrad node (so every graph uses this one, and its
        references are a constant) and note how many references the leaf has while
        nothing but fsdp2 holds it, before any module registers it."""
        leaf = self.unsharded
        if leaf is None:
            raise AssertionError("fsdp2 internal error: expected leaf is not None")
        self._grad_acc = None
        if leaf.requires_grad:
            with torch.enable_grad():  # may run inside backward, where grad mode is off
                self._grad_acc = leaf.view_as(leaf).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        del leaf  # counted by ``_holders`` otherwise
        self._quiet_holders = self._holders()

    def _holders(self) -> tuple[int, int]:
        """(C++ references to the leaf's tensor, Python references to the leaf). A tensor
        autograd saved adds to the first, an attribute a custom Function keeps on its
        ``ctx`` to the second."""
        leaf = self.unsharded
        use_count = getattr(leaf, "_use_count", None)
        return (use_count() if use_count is not None else -1), sys.getrefcount(leaf)

    def is_unheld(self) -> bool:
        """Nothing but fsdp2 and the owner modules holds the unsharded leaf: no tensor
        autograd saved, no autograd context, no other Python reference; so nothing can
        read it through the leaf itself (views of its storage are counted apart, by the
        bucket). Conservative where this build of torch cannot tell."""
        impl, py = self._holders()
        quiet_impl, quiet_py = self._quiet_holders
        return quiet_impl >= 0 and impl <= quiet_impl and py <= quiet_py + len(self.owners)

    def take_unsharded_grad(self, defer_tp_in: torch.dtype | None = None) -> torch.Tensor | None:
        """The gradient accumulated in the unsharded leaf (as a local tensor), which is
        cleared. A tensor-parallel gradient still to be reduced over TP (``Partial``) is
        redistributed first; with ``defer_tp_in`` (accumulating without synchronization)
        it is instead kept in that dtype and added to the earlier ones (None then), so
        the TP reduction runs once, at the step that synchronizes."""
        leaf = self.unsharded
        grad = None if leaf is None else leaf.grad
        if grad is not None:
            leaf.grad = None  # type: ignore[union-attr]
        if grad is None and self._tp_pending is None:
            return None
        if self.tp is None:
            return grad
        if grad is None:
            grad, self._tp_pending = self._tp_pending, None
        elif self.annotation is not None:
            grad = self.annotation.grad_dtensor(grad, self.shape, self.stride)
        if not isinstance(grad, DTensor):
            raise AssertionError(f"fsdp2 internal error: local gradient for TP parameter {self.fqn}")
        # The data-parallel dims of an SPMD mesh stay as they are (a Partial there is
        # what the reduce sums); the others go to the parameter's own placements.
        target = tuple(g if i in self.dp_dims else t for i, (g, t) in enumerate(zip(grad.placements, self.tp[1])))
        if tuple(grad.placements) != target:
            if defer_tp_in is not None:
                grad = cast(DTensor, grad.to(defer_tp_in))
                self._tp_pending = grad if self._tp_pending is None else cast(DTensor, self._tp_pending + grad)
                return None
            if self._tp_pending is not None:
                grad, self._tp_pending = cast(DTensor, self._tp_pending + grad), None
            grad = grad.redistribute(self.tp[0], target)
        return grad.to_local()

    def discard_unsharded_grad(self) -> None:
        """Drop the leaf's gradient and any deferred TP one, communicating nothing."""
        if self.unsharded is not None:
            self.unsharded.grad = None
        self._tp_pending = None

    def clear_grads(self) -> None:
        """Drop the sharded parameter's gradient and the leaf's."""
        self.discard_unsharded_grad()
        if self.sharded is not None:
            self.sharded.grad = None

    @property
    def has_plain_leaf(self) -> bool:
        """The unsharded leaf is a plain tensor (not a DTensor): no tensor-parallel
        placements, or typed with spmd_types instead."""
        return self.tp is None or self.annotation is not None

    @property
    def has_unsharded_grad(self) -> bool:
        return (self.unsharded is not None and self.unsharded.grad is not None) or self._tp_pending is not None


def _check_extension_param(fqn: str, param: torch.Tensor, dim: int) -> None:
    what = (
        "a tensor-parallel DTensor" if isinstance(param, DTensor)
        else f"sharded on dim {dim}" if dim != 0
        else "0-dim" if param.dim() == 0
        else None
    )
    if what is not None:
        raise NotImplementedError(
            f"parameter {fqn} customizes its all-gather (fsdp_pre_all_gather) and is {what}; "
            "fsdp2 supports the all-gather extension on plain parameters sharded on dim 0"
        )
