"""fsdp2: fully sharded data parallel training, a drop-in for torch's ``fully_shard``."""

from . import optim  # noqa: F401 (fsdp2.optim.Muon after import fsdp2)
from ._module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .api import (
    BlockQuantization,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardPlacementResult,
)
from .fully_shard import fully_shard
from .memory.held import held_bytes, release_memory
from .optim import clip_grad_norm_
from .params.state_dict import StateDictError
from .planning import plan as plan  # fsdp2.plan, not in torch's __all__
from .runtime.root import GradientReductionHandle
from .weights import full_weights, gathered, register_gathered_method

__all__ = [
    "BlockQuantization",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardPlacementResult",
    "StateDictError",
    "UnshardHandle",
    "clip_grad_norm_",
    "full_weights",
    "fully_shard",
    "gathered",
    "held_bytes",
    "register_fsdp_forward_method",
    "register_gathered_method",
    "release_memory",
    "share_comm_ctx",
]
__version__ = "0.1.0"
