"""Frozen policy dataclasses: the knobs of ``fully_shard`` that are not the mesh."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn

from ._compat import TORCH

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard


_DTYPES = MappingProxyType({"int8": torch.int8, "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn})
# The largest magnitude each quantized dtype holds, the ``qmax`` a block's amax maps to.
QMAX = MappingProxyType({torch.int8: 127.0, torch.float8_e4m3fn: 448.0})


@dataclass(frozen=True)
class BlockQuantization:
    """Blockwise quantization of a collective's payload (``MixedPrecisionPolicy``'s
    ``quantize_gather`` / ``quantize_reduce``).

    Attributes:
        dtype: ``torch.int8`` (or ``"int8"``) or ``torch.float8_e4m3fn`` (or ``"fp8"``).
        block_size: values per float32 scale; a power of two from 16 to 65536. Bytes sent per
            value: ``1 + 4 / block_size`` (128: 1.03, a 0.258x of float32's).
    """

    dtype: torch.dtype | str = torch.int8
    block_size: int = 128

    def __post_init__(self) -> None:
        dtype = _DTYPES.get(self.dtype, self.dtype) if isinstance(self.dtype, str) else self.dtype
        if dtype not in QMAX:
            raise ValueError(
                f"BlockQuantization.dtype must be torch.int8 ('int8') or torch.float8_e4m3fn ('fp8'), "
                f"got {self.dtype!r}"
            )
        object.__setattr__(self, "dtype", dtype)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"BlockQuantization.block_size must be an int, got {type(self.block_size).__name__}")
        if not 16 <= self.block_size <= 1 << 16 or self.block_size & (self.block_size - 1):
            raise ValueError(
                f"BlockQuantization.block_size must be a power of two from 16 to 65536 (one float32 scale "
                f"per block; 128 is a good default), got {self.block_size}"
            )

    @property
    def qmax(self) -> float:
        return QMAX[self.dtype]  # type: ignore[index]

    @property
    def name(self) -> str:
        return "int8" if self.dtype == torch.int8 else "fp8"


def as_quantization(value: object, field: str) -> BlockQuantization | None:
    """``None``, a ``BlockQuantization``, or a dtype / its short name as the default blocks."""
    if value is None or isinstance(value, BlockQuantization):
        return value
    if isinstance(value, (str, torch.dtype)):
        try:
            return BlockQuantization(value)
        except ValueError:
            pass
    raise ValueError(
        f"MixedPrecisionPolicy.{field} expects None, 'int8', 'fp8', torch.int8, torch.float8_e4m3fn or "
        f"fsdp2.BlockQuantization(dtype, block_size), got {value!r}"
    )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision.

    Attributes:
        param_dtype: dtype of the unsharded parameters, so of the all-gather and
            of forward/backward compute. ``None`` keeps each parameter's dtype.
        reduce_dtype: dtype of the gradient reduce-scatter, and of gradients accumulated
            without synchronization. ``None`` follows the installed torch: on torch 2.15,
            each parameter's gradient dtype (its ``grad_dtype`` if set, else its own dtype:
            float32 masters reduce in float32 under a bf16 ``param_dtype``); on torch
            2.13 and 2.14, ``param_dtype`` (or the parameter's dtype when that is ``None``).
        output_dtype: dtype that floating-point forward outputs are cast to.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        param_dtype_override_fn: keyword only (torch 2.15's, on every torch). Called once
            per parameter at ``fully_shard``: ``None`` or ``param_dtype`` keeps the policy's
            ``param_dtype`` for it, the parameter's own dtype keeps it unconverted (e.g. a
            norm's or router's weight in float32); nothing else is allowed. Forward inputs
            are still cast to ``param_dtype``. It must answer alike on every rank.
        quantize_gather: fsdp2 only, keyword only. ``"int8"``, ``"fp8"`` (float8 e4m3) or
            a ``BlockQuantization``: each rank sends its full-precision shards quantized
            blockwise (one float32 scale per block) and the parameters are rebuilt in
            ``param_dtype`` from the dequantized values: about a quarter of float32's
            bytes. Used for compute only; the sharded parameters stay exact.
        quantize_reduce: fsdp2 only, keyword only. The same for the gradient reduce:
            one all-to-all of quantized rows, dequantized and summed in float32. With
            HSDP the replica all-reduce stays in ``reduce_dtype``.

    Sharded parameters, gradients and optimizer state always keep the
    original dtype: checkpoints never hold the low-precision copies. Neither
    quantization applies on one shard rank, to non-floating parameters, or to
    parameters with an all-gather extension (they gather through their own hooks).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    _: KW_ONLY
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = None
    quantize_gather: BlockQuantization | str | None = None
    quantize_reduce: BlockQuantization | str | None = None

    def __repr__(self) -> str:
        """The installed torch's, plus the fsdp2 fields that are set (so a policy torch
        could build prints exactly as torch's does)."""
        names = ["param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"]
        if TORCH.policy_shows_override_fn or self.param_dtype_override_fn is not None:
            names.append("param_dtype_override_fn")
        names += [n for n in ("quantize_gather", "quantize_reduce") if getattr(self, n) is not None]
        return f"MixedPrecisionPolicy({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def param_dtype_for(self, param: torch.Tensor) -> torch.dtype | None:
        """The dtype ``param`` is gathered and computed in under this policy (``None``:
        its own), ``param_dtype_override_fn`` applied and checked as torch 2.15 does."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        chosen = self.param_dtype_override_fn(param)  # type: ignore[arg-type]
        if chosen is None:
            return self.param_dtype
        if not isinstance(chosen, torch.dtype):
            raise ValueError(  # noqa: TRY004 - torch 2.15 raises ValueError here
                f"param_dtype_override_fn must return a torch.dtype or None, got {type(chosen).__name__} {chosen!r}"
            )
        if chosen not in (self.param_dtype, param.dtype):
            raise ValueError(
                f"param_dtype_override_fn must return None, param_dtype ({self.param_dtype}) or the "
                f"parameter's own dtype ({param.dtype}), got {chosen} for a parameter of shape "
                f"{tuple(param.shape)}; other dtypes are not supported"
            )
        return chosen

    def __post_init__(self) -> None:
        if self.param_dtype_override_fn is not None and not callable(self.param_dtype_override_fn):
            raise TypeError(
                "MixedPrecisionPolicy.param_dtype_override_fn expects a callable (parameter -> dtype or "
                f"None) or None, got {type(self.param_dtype_override_fn).__name__}"
            )
        for name in ("quantize_gather", "quantize_reduce"):
            object.__setattr__(self, name, as_quantization(getattr(self, name), name))
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(
                    f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, "
                    f"got {type(value).__name__} {value!r}; pass e.g. torch.bfloat16"
                )
            if value is not None and not value.is_floating_point:
                raise ValueError(
                    f"MixedPrecisionPolicy.{name} must be a floating-point dtype, got {value}"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the default of ``fully_shard(offload_policy=...)``."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU.

    Sharded parameters are copied to the mesh's device before each all-gather and
    reduced gradients are copied back, so ``optimizer.step()`` runs on the CPU.
    On a CPU mesh everything already lives on the CPU and this costs nothing.

    Attributes:
        pin_memory: pin the CPU shards so host/device copies can overlap compute.
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of a full SPMD mesh are data parallel (``fully_shard(...,
    dp_mesh_dims=...)``, torch 2.13's name and fields).

    Attributes:
        shard: mesh dim name(s) parameters are sharded over (several are flattened).
        replicate: mesh dim name(s) of HSDP's replicas (several are flattened).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard, replicate or both set to mesh dim names")
        for name in ("shard", "replicate"):
            value = getattr(self, name)
            if isinstance(value, list):  # torch's takes a list of names as the tuple
                value = tuple(value)
                object.__setattr__(self, name, value)
            names = value if isinstance(value, tuple) else (value,)
            if value is not None and not all(isinstance(n, str) for n in names):
                raise TypeError(f"DataParallelMeshDims.{name} expects a dim name or a tuple of them, got {value!r}")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return to shard one parameter over a mesh of its
    own (Mixture-of-Experts: routed experts over the expert-data-parallel mesh, the rest
    over the mesh passed to ``fully_shard``). The parameters of one ``fully_shard`` call
    on different meshes form one group per mesh: one all-gather and one reduce each,
    issued together.

    Attributes:
        placement: ``Shard(dim)``, or ``None`` for ``Shard(0)``.
        mesh: a 1-D (FSDP) or 2-D ``(replicate, shard)`` (HSDP) mesh; ``None``: the
            mesh passed to ``fully_shard``. With ``dp_mesh_dims``, the full SPMD mesh.
        dp_mesh_dims: as ``fully_shard(dp_mesh_dims=...)``, for this mesh.

    torch's own ``ShardPlacementResult(placement, mesh_info)`` (with an
    ``FSDPMeshInfo``/``HSDPMeshInfo``) is accepted too, read by its fields.
    """

    placement: Shard | None = None
    mesh: DeviceMesh | None = None  # torch's FSDPMeshInfo is taken here too
    dp_mesh_dims: DataParallelMeshDims | None = None
