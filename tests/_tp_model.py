"""A small transformer and the torchtitan-style tensor-parallel plan the 2D/3D tests use:
embedding rowwise, attention and MLP colwise/rowwise, sequence-parallel norms, the
output layer colwise with replicated logits."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        # -1 heads: tensor parallel leaves each rank its own heads.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TPModel(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, heads: int = 2, hidden: int = 12, n_blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parallelize(model: TPModel, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> None:
    """Tensor parallel over ``tp_mesh``, as torchtitan's Llama plan does it."""
    seq = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    for block in model.blocks:
        plan = {
            "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "ffn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "ffn.w1": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attn_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
