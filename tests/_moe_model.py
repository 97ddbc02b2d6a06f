"""A small Mixture-of-Experts transformer for the MoE tests, and its expert parallel.

Each block: a dense mixing layer, then a token-choice MoE (softmax router, top-k) whose
experts are 3-D parameters ``w1 (E, dim, hidden)``, ``w2 (E, hidden, dim)`` and a 2-D
bias ``b2 (E, dim)``, plus an optional dense shared expert. ``parallelize_experts(model, ep_mesh)`` splits the experts
over ``ep_mesh`` (``Shard(0)`` DTensors, ``E / ep`` per rank) and dispatches tokens to
their experts' ranks with one all-to-all each way, as torchtitan's expert parallel
does; without it every rank computes every expert. Same numbers either way (up to the
order of float sums).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class Experts(nn.Module):
    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = n_experts
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) / hidden**0.5)
        self.b2 = nn.Parameter(torch.randn(n_experts, dim) * 0.1)  # 2-D: one output bias per expert

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: tokens sorted by (local) expert, ``counts[j]`` of them for expert j."""
        w1, w2, b2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.b2))
        outs = [torch.tanh(xj @ w1[j]) @ w2[j] + b2[j] for j, xj in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[-1])


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, shared: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(n_experts, dim, hidden)
        self.shared = nn.Linear(dim, dim) if shared else None
        self.ep_group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        routed = x[order // self.top_k]  # one row per (token, choice), by expert
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        if self.ep_group is None:
            out = self.experts(routed, counts.tolist())
        else:
            out = _dispatch(self.experts, routed, counts, self.ep_group)
        unsorted = torch.zeros_like(out).index_copy(0, order, out)
        y = (unsorted.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)


def _dispatch(experts: Experts, routed: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send each row to the rank holding its expert, run the local experts, send back."""
    ep = dist.get_world_size(group)
    local = experts.num_experts // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [source rank][local expert]
    send_sizes = counts.view(ep, local).sum(1).tolist()
    recv_sizes = recv_counts.view(ep, local).sum(1).tolist()
    received = dist_fn.all_to_all_single(
        routed.new_empty(sum(recv_sizes), routed.shape[-1]), routed, recv_sizes, send_sizes, group=group
    )
    by_source = received.split(recv_counts.tolist())  # (source, expert) order
    grid = recv_counts.view(ep, local)
    by_expert = [by_source[s * local + j] for j in range(local) for s in range(ep)]
    out = experts(torch.cat(by_expert), grid.sum(0).tolist())
    pieces = out.split(grid.t().flatten().tolist())  # (expert, source) order
    back = torch.cat([pieces[j * ep + s] for s in range(ep) for j in range(local)])
    return dist_fn.all_to_all_single(routed.new_empty(routed.shape), back, send_sizes, recv_sizes, group=group)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, shared: bool) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.mix = nn.Linear(dim, dim)
        self.moe = MoE(dim, hidden, n_experts, top_k, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.mix(x * self.norm_weight))
        return x + self.moe(x)


class MoEModel(nn.Module):
    def __init__(
        self, vocab: int = 13, dim: int = 8, hidden: int = 6, n_experts: int = 4, top_k: int = 2,
        n_blocks: int = 2, shared: bool = True,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MoEBlock(dim, hidden, n_experts, top_k, shared) for _ in range(n_blocks))
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.norm_weight)


def parallelize_experts(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Expert parallel: every ``Experts`` split over ``ep_mesh`` (``Shard(0)``)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.ep_group = ep_mesh.get_group()
            ex = module.experts
            for name in ("w1", "w2", "b2"):
                value = getattr(ex, name)
                setattr(ex, name, nn.Parameter(distribute_tensor(value.detach(), ep_mesh, [Shard(0)])))


def expert_params(module: nn.Module) -> set[nn.Parameter]:
    return {p for m in module.modules() if isinstance(m, Experts) for p in m.parameters()}
