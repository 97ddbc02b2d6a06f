"""Gradient clipping across any mesh, on local shards.

``torch.nn.utils.clip_grad_norm_`` on DTensor gradients computes each norm through
DTensor and stacks them, which fails once gradients live on different meshes (FSDP over
TP: the blocks on ``(dp, tp)``, a final norm on ``dp`` only) and cannot see other
pipeline stages. Here:

  Phase 1  each gradient's local tensor contributes ``sum |x|^p`` (``max |x|`` for
           ``inf``), grouped by the ranks that hold different pieces of it (the mesh
           dims where it is sharded; replicas hold copies and are counted once);
  Phase 2  one all-reduce per distinct group of ranks, then, with ``pp_mesh``, one over
           the pipeline stages: every rank has the same total norm;
  Phase 3  every local gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..comm.collectives import traced
from ..comm.mesh import collective_device
from ._pieces import sharded_group

# A gradient's layout, as ``_group_of`` caches it: (id of its mesh, its placements).
_LayoutKey = tuple[int, tuple[Placement, ...]]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total ``norm_type``-norm of
    ``max_norm``, and return that total norm (before clipping) as a plain tensor, the
    same on every rank. torch's signature; ``pp_mesh`` (a 1-D DeviceMesh over the
    pipeline stages) makes the norm span the stages. Gradients may be DTensors on any
    meshes (FSDP, HSDP, FSDP over TP, ``Shard(d)``) or plain tensors (taken as
    replicated); ``foreach`` is accepted for compatibility (local norms always use the
    foreach kernels)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    if not norm_type >= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be >= 0 or inf, got {norm_type}")
    grads = [p.grad for p in parameters if p.grad is not None]
    # Phase 1: local contributions, by the ranks that hold different pieces.
    by_group: dict[tuple[int, ...], tuple[dist.ProcessGroup | None, list[torch.Tensor]]] = {}
    groups: dict[_LayoutKey, tuple[dist.ProcessGroup | None, tuple[int, ...]]] = {}  # see _group_of
    for g in grads:
        if isinstance(g, DTensor):
            spec = g._spec
            found = groups.get((id(spec.mesh), spec.placements)) or _group_of(spec, groups)
            local, (group, ranks) = g._local_tensor, found
        else:
            local, group, ranks = g, None, ()
        entry = by_group.get(ranks)
        if entry is None:
            entry = by_group[ranks] = (group, [])
        entry[1].append(local)
    locals_ = [t for _, ts in by_group.values() for t in ts]
    device = _comm_device(grads, locals_)
    dtype = _acc_dtype(locals_)
    total = torch.zeros((), dtype=dtype, device=device)
    # Phase 2: one all-reduce per group of ranks, then over the pipeline stages.
    with traced("fsdp2::grad_norm"):
        for group, ts in by_group.values():
            part = _combine_local(ts, norm_type, dtype, device)
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(part, op=_op(norm_type), group=group)
            if norm_type == 0:
                part = (part > 0).sum().to(dtype)  # tensors with a non-zero element
            total = torch.maximum(total, part) if norm_type == math.inf else total + part
        if pp_mesh is not None:
            dist.all_reduce(total, op=_op(norm_type), group=pp_mesh.get_group())
    if norm_type not in (0.0, 1.0, math.inf):
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    # Phase 3: scale the local gradients.
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in locals_:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad(), traced("fsdp2::clip_grads"):
        for (dev, dt), ts in by_kind.items():
            torch._foreach_mul_(ts, coef.to(device=dev, dtype=dt))
    return total


def _comm_device(grads: list[torch.Tensor], locals_: list[torch.Tensor]) -> torch.device:
    """Where the norms are summed: the meshes' device (offloaded gradients live on the
    host, but their collectives run on the accelerator), else the gradients'."""
    here = locals_[0].device if locals_ else torch.device("cpu")
    for g in grads:
        if isinstance(g, DTensor) and g.device_mesh.device_type not in ("cpu", "meta"):
            return collective_device(g.device_mesh, here)
    return here


def _group_of(spec: DTensorSpec, seen: dict[_LayoutKey, tuple[dist.ProcessGroup | None, tuple[int, ...]]]) -> tuple:
    """The group of ranks holding the other pieces of a gradient laid out as ``spec``
    (None and no ranks when it is whole here), cached in ``seen`` by layout: most
    gradients share one, and comparing meshes costs more than the rest."""
    if any(isinstance(pl, Partial) for pl in spec.placements):
        raise ValueError(
            f"clip_grad_norm_: a gradient has placements {tuple(spec.placements)}; Partial gradients are "
            "not reduced yet, so their norm is not known: clip after they are reduced"
        )
    group, ranks = sharded_group(spec.mesh, spec.placements)
    found = seen[(id(spec.mesh), spec.placements)] = (group, ranks if group is not None else ())
    return found


def _acc_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """Sum norms in the widest floating dtype among the gradients, float32 at least."""
    dtype = torch.float32
    for t in tensors:
        if t.dtype.is_floating_point and t.dtype.itemsize > dtype.itemsize:
            dtype = t.dtype
    return dtype


def _combine_local(ts: list[torch.Tensor], p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``sum |x|^p`` over the tensors (``max |x|`` for ``inf``). ``p=0``: torch's 0-norm
    of the tensors' norms, the number of tensors with a non-zero element: per tensor
    (in the same order on every rank of the group), the non-zero count, summed by the
    all-reduce, and ``_count_tensors`` counts those above zero."""
    if p == 0:
        return torch.stack([t.count_nonzero() for t in ts]).to(device=device, dtype=dtype) if ts else torch.zeros(0, dtype=dtype, device=device)
    ts = [t for t in ts if t.numel()]  # a trailing rank's empty shard adds nothing
    if not ts:
        return torch.zeros((), dtype=dtype, device=device)
    each = torch._foreach_norm(ts, p)
    try:
        norms = torch.stack(each).to(device=device, dtype=dtype)  # one dtype and device: the usual case
    except RuntimeError:
        norms = torch.stack([n.to(device=device, dtype=dtype) for n in each])
    if p == math.inf:
        return norms.max()
    if p in (0.0, 1.0):
        return norms.sum()
    return norms.pow(p).sum()


def _op(p: float) -> dist.ReduceOp.RedOpType:
    return dist.ReduceOp.MAX if p == math.inf else dist.ReduceOp.SUM
