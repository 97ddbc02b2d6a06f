"""The DTensors of one parameter: the spec of a shard wherever its tensor lives, a
shard's local tensor over its rows of a flat buffer (``own_storage_view``), a wrapper
over it, and the mesh and placements a shard lives on (data-parallel dims composed with
tensor parallel, or a full SPMD mesh)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import _disable_current_modes

from ..comm.mesh import SpmdDims

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

def spec_where_it_is(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: torch.Size, stride: tuple[int, ...]
) -> DTensorSpec:
    """The DTensor spec of ``local`` as a shard of a ``shape`` tensor, for ``make_dtensor``.
    Read off a meta stand-in: ``DTensor.from_local`` copies a tensor that is not on the
    mesh's device type there (an offloaded host shard would land on the GPU)."""
    stand_in = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="meta")
    return DTensor.from_local(stand_in, mesh, placements, run_check=False, shape=shape, stride=stride)._spec


def make_dtensor(local: torch.Tensor, spec: Any, requires_grad: bool = False) -> DTensor:  # a DTensorSpec
    """``DTensor(local, spec)`` whose wrapper has storage offset 0.

    In torch 2.13 a DTensor built over a view at a nonzero storage offset (our shards and
    state are views into flat buffers) copies that offset into the wrapper, which then
    reports a non-null ``data_ptr`` and ``torch.save`` / ``copy.deepcopy`` fail on its
    storage ("invalid python storage"). The wrapper owns no data, so its offset is 0.
    """
    if local.storage_offset() == 0:
        return DTensor(local, spec, requires_grad=requires_grad)
    meta = spec.tensor_meta
    out = torch.Tensor._make_wrapper_subclass(
        DTensor,
        meta.shape,
        strides=meta.stride,
        storage_offset=0,
        dtype=local.dtype,
        device=local.device,
        layout=local.layout,
        requires_grad=requires_grad,
    )
    out._spec = spec
    out._local_tensor = local
    return out


def own_storage_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous ``shape`` tensor over ``flat``'s elements from ``offset`` on, whose
    storage is a slice of ``flat``'s (it keeps ``flat``'s alive) and starts at its data.

    As torch's own sharded parameters, the local tensor sits at storage offset 0: a
    DTensor built over it by torch's ops (``p.detach()``, ``p.data``, a view) then has
    offset 0 too, which ``torch.save`` and ``copy.deepcopy`` need of a wrapper. A plain
    view where there is no data (meta and fake tensors: the planner's dry runs) and in
    pinned host memory (offloaded shards): the host allocator records a ``non_blocking``
    copy's event only on a tensor whose storage is its own allocation, and would reuse
    the memory under a copy still reading it. Made outside any dispatch mode, so memory
    trackers count ``flat`` alone.
    """
    numel = math.prod(shape)
    if flat.untyped_storage().device.type == "meta" or flat.is_pinned():
        return flat[offset : offset + numel].view(shape)
    size = flat.element_size()
    start = (flat.storage_offset() + offset) * size
    with _disable_current_modes():
        piece = flat.untyped_storage()[start : start + numel * size]
        return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(piece, 0, shape, contiguous_stride(shape))


def make_parameter(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """``nn.Parameter(make_dtensor(local, spec))`` as ``nn.Parameter`` makes one of a tensor
    subclass (the tensor itself, marked ``_is_param``, ``requires_grad`` set), without its
    ``detach()``: DTensor's detach rebuilds the wrapper at ``local``'s storage offset, the
    one ``make_dtensor`` leaves out, and the parameter could not be saved or deep-copied."""
    param = make_dtensor(local, spec, requires_grad=requires_grad)
    param._is_param = True
    return param


def spmd_placements(
    spmd: SpmdDims, placements: tuple[Placement, ...], fsdp: Placement, dim: int
) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of a shard of a DTensor parameter on a full SPMD mesh.

    Each data-parallel shard dim's ``Replicate()`` becomes ``Shard(dim)``, or
    ``_StridedShard(dim, split_factor=k)`` when later mesh dims shard ``dim`` too (``k``
    the product of their sizes): the local tensor was split by those first. Several
    shard dims were flattened into one group: the shard then lives on the data-parallel
    mesh (flattened, and ``(replicate, shard)`` under HSDP) in the first shard dim's place."""
    mesh = spmd.mesh
    out = list(placements)
    for i in spmd.shard:
        split = math.prod(
            mesh.size(j) for j in range(i + 1, mesh.ndim) if isinstance(pl := out[j], Shard) and pl.dim == dim
        )
        out[i] = _StridedShard(dim, split_factor=split) if split > 1 and isinstance(fsdp, Shard) else fsdp
    if len(spmd.shard) <= 1:  # one shard dim, or none (replicas only)
        return mesh, tuple(out)
    names = mesh.mesh_dim_names
    if names is None:
        raise AssertionError("fsdp2 internal error: expected names is not None")
    meshes: list[DeviceMesh] = []
    spec: list[Placement] = []
    for i in range(mesh.ndim):
        if i == spmd.shard[0]:
            meshes.append(spmd.dp_mesh)
            spec.extend([Replicate(), out[i]] if spmd.replicate else [out[i]])
        elif i not in spmd.dp:
            meshes.append(mesh[names[i]])
            spec.append(out[i])
    return DeviceMesh._concatenate(meshes), tuple(spec)


def concatenate_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The mesh of the data-parallel dimensions followed by the TP ones: both must be
    slices of one named mesh (``init_device_mesh(..., mesh_dim_names=...)``)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None or dp_mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(
            f"parameter {fqn} is a DTensor on the mesh {tp_mesh}; fully_shard composes it with the "
            f"data-parallel mesh {dp_mesh} only when both are named slices of one mesh: build "
            "mesh = init_device_mesh(..., mesh_dim_names=('dp', 'tp')), parallelize over mesh['tp'] "
            "and pass mesh['dp'] to fully_shard"
        )
    try:
        return concatenate([dp_mesh, tp_mesh])
    except RuntimeError as e:
        raise ValueError(
            f"parameter {fqn} is a DTensor on {tp_mesh}, which does not combine with the data-parallel "
            f"mesh {dp_mesh} ({e}); slice both from one mesh built with init_device_mesh"
        ) from e


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
