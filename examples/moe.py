"""The example's Mixture-of-Experts parallelism (``--moe --ep N``), torchtitan's layout.

The data-parallel shard dim of ``S`` ranks is split into ``efsdp x ep`` (``ep`` = N):
the routed experts are split over the ``ep`` ranks (``Shard(0)`` DTensors: ``E / ep``
experts each, tokens dispatched by all-to-all) and sharded by ``fully_shard`` over the
``efsdp`` ranks only, through ``shard_placement_fn`` returning a ``ShardPlacementResult``
with that mesh; every other parameter is sharded over all ``S`` ranks as usual. HSDP
replicas (``--hsdp``) replicate both; pipeline stages (``--pp``) hold a mesh each. Under
tensor parallel (``--tp``) each MoE layer takes its tp group's whole sequence and
computes it alike on every rank of the group (experts and router replicated over tp:
expert parallel spreads the experts instead), then hands back the rank's sequence shard.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn
from model import MoE
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


class MoEMeshes(NamedTuple):
    dense: DeviceMesh  # what fully_shard gets: (shard) or (replicate, shard)
    experts: DeviceMesh | None  # the experts' fully_shard mesh: (efsdp) or (replicate, efsdp); None without ep
    ep: DeviceMesh | None  # the expert-parallel mesh
    pp: DeviceMesh | None  # the pipeline stages' mesh (--pp)
    tp: DeviceMesh | None = None  # the tensor-parallel mesh (--tp)


def moe_meshes(device_type: str, world: int, pp: int, replicate: int, ep: int, tp: int = 1) -> MoEMeshes:
    """The meshes of a ``(pp, replicate, efsdp, ep, tp)`` layout; dims of size 1 left out
    except the data-parallel shard dim."""
    shard = world // (pp * replicate * tp)
    dims = [("pp", pp), ("dp_replicate", replicate), ("efsdp", shard // ep), ("ep", ep), ("tp", tp)]
    kept = [(n, s) for n, s in dims if s > 1 or n == "efsdp"]
    root = init_device_mesh(device_type, tuple(s for _, s in kept), mesh_dim_names=tuple(n for n, _ in kept))
    names = [n for n, _ in kept]
    shard_dims = tuple(n for n in ("efsdp", "ep") if n in names)
    if len(shard_dims) > 1:
        root[shard_dims]._flatten("dp_shard")
    shard_name = "dp_shard" if len(shard_dims) > 1 else shard_dims[0]
    replica = ("dp_replicate",) if "dp_replicate" in names else ()
    dense = root[(*replica, shard_name)] if replica else root[shard_name]
    experts = (root[(*replica, "efsdp")] if replica else root["efsdp"]) if ep > 1 else None
    return MoEMeshes(dense, experts, root["ep"] if ep > 1 else None, root["pp"] if pp > 1 else None,
                     root["tp"] if tp > 1 else None)


def parallelize_experts(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE's experts over ``ep_mesh`` and route their tokens through it."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.ep_group = ep_mesh.get_group()
            experts = module.experts
            for name, value in list(experts.named_parameters(recurse=False)):
                setattr(experts, name, nn.Parameter(distribute_tensor(value.detach(), ep_mesh, [Shard(0)])))


def expert_placement_fn(block: nn.Module, impl: str, meshes: MoEMeshes) -> Any:
    """``shard_placement_fn`` for one block (torchtitan's choice): experts ``Shard(1)`` when
    more ranks shard them than there are experts (no padding), else ``Shard(0)``; over
    the expert mesh under expert parallel."""
    experts = {p for m in block.modules() if isinstance(m, MoE) for p in m.experts.parameters()}
    if not experts:
        return None
    n_experts = next(m for m in block.modules() if isinstance(m, MoE)).experts.num_experts
    shard_degree = meshes.dense.size(meshes.dense.ndim - 1)  # efsdp x ep
    placement = Shard(1) if shard_degree > n_experts else Shard(0)
    if meshes.experts is None:
        return (lambda p: placement if p in experts else None) if placement == Shard(1) else None
    if impl == "fsdp2":
        from fsdp2 import ShardPlacementResult

        result = ShardPlacementResult(placement, meshes.experts)
        return lambda p: result if p in experts else None
    # torch's fully_shard takes its own (private) classes, as torchtitan builds them.
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as TorchResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    expert_result = TorchResult(placement, _get_mesh_info(meshes.experts))
    dense_result = TorchResult(Shard(0), _get_mesh_info(meshes.dense))
    return lambda p: expert_result if p in experts else dense_result


def moe_tp_plan() -> Any:
    """The tensor-parallel style of an MoE layer: the sequence-parallel input gathered
    (a plain tensor: router and experts are not split over tp), the output scattered
    back to sequence shards."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
    )


def scale_expert_grads(model: nn.Module, ep: int) -> None:
    """Each mesh's gradients are averaged over its own ranks (torch's rule, fsdp2's too):
    the experts' over ``efsdp`` only, while they summed the tokens of ``ep`` ranks as
    well. Divided by ``ep`` here, every gradient is the global batch's mean."""
    if ep == 1:
        return
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoE):
                for p in module.experts.parameters():
                    if p.grad is not None:
                        p.grad.div_(ep)
