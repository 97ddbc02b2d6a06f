"""A small Llama-style transformer: RMSNorm, rotary attention, SwiGLU MLP, or a
Mixture-of-Experts of SwiGLU experts (token choice, top-k) in place of the MLP."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    hidden_dim: int = 344
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    n_experts: int = 0  # > 0: each block's MLP is a Mixture-of-Experts of this many experts
    top_k: int = 2  # experts per token


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd).
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.head_dim = args.dim // args.n_heads
        # Separate projections (not one fused wqkv): colwise tensor parallel then gives
        # each rank whole heads of q, k and v.
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[:2]
        # -1 heads: under tensor parallel each rank holds n_heads / tp of them.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``n`` SwiGLU experts as 3-D parameters (expert, in, out). Under expert parallel
    they are ``Shard(0)`` DTensors over the ep mesh: each rank computes its own experts."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = n
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: rows sorted by (this rank's) expert, ``counts[j]`` for expert j."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        outs = [(F.silu(xj @ w1[j]) * (xj @ w3[j])) @ w2[j] for j, xj in enumerate(x.split(counts))]
        return torch.cat(outs)


def _local(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class MoE(nn.Module):
    """Token-choice routing: each token goes to its ``top_k`` experts by softmax score and
    returns their outputs weighted by those scores. With ``ep_group`` (expert parallel)
    rows travel to the ranks holding their experts and back, one all-to-all each way."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.hidden_dim)
        self.ep_group: object | None = None  # set by examples/moe.py's parallelize_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores, chosen = torch.softmax(self.router(x).float(), dim=-1).topk(self.top_k, dim=-1)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        rows = x[order // self.top_k]  # one row per (token, choice), grouped by expert
        counts = torch.bincount(flat, minlength=self.experts.num_experts)
        out = self.experts(rows, counts.tolist()) if self.ep_group is None else _dispatch(self, rows, counts)
        unsorted = torch.zeros_like(out).index_copy(0, order, out)
        y = (unsorted.view(-1, self.top_k, shape[-1]) * scores.unsqueeze(-1).to(out.dtype)).sum(1)
        return y.reshape(shape)


def _dispatch(moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Expert parallel: send each row to the rank of its expert, run this rank's experts,
    send the outputs back (autograd sends the gradients the other way)."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group = moe.ep_group
    ep = dist.get_world_size(group)
    local = moe.experts.num_experts // ep
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank][local expert]
    grid = received_counts.view(ep, local)
    send, recv = counts.view(ep, local).sum(1).tolist(), grid.sum(1).tolist()
    received = all_to_all_single_autograd(rows, recv, send, group)
    by_source = received.split(grid.flatten().tolist())  # (source, expert) order
    out = moe.experts(torch.cat([by_source[s * local + j] for j in range(local) for s in range(ep)]),
                      grid.sum(0).tolist())
    by_expert = out.split(grid.t().flatten().tolist())  # (expert, source) order
    back = torch.cat([by_expert[j * ep + s] for s in range(ep) for j in range(local)])
    return all_to_all_single_autograd(back, send, recv, group)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = MoE(args) if args.n_experts else FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rotary_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))

    def init_weights(self, seed: int = 0) -> None:
        init_weights(self, seed)


class TransformerStage(nn.Module):
    """Layers ``[start, end)`` of a ``Transformer`` as one pipeline stage, with the token
    embedding (first stage) and the final norm and output (last stage). Parameter names
    are the full model's (``layers.3.attention.wq.weight``), so checkpoints of a
    pipelined run and of a plain one have the same keys."""

    def __init__(self, model: Transformer, start: int, end: int) -> None:
        super().__init__()
        self.args = model.args
        first, last = start == 0, end == model.args.n_layers
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def init_weights(module: nn.Module, seed: int = 0) -> None:
    """Deterministic initialization of a ``Transformer`` or any part of one, sharded or
    not: each parameter's values depend only on its name (activation checkpoint
    wrappers aside) and the seed, so a pipeline stage gets what the full model would."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            name = name.replace("._checkpoint_wrapped_module", "")
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02
            _copy_full(p, full)
        args = module.args
        cos, sin = rotary_tables(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
        module.rope_cos.copy_(cos)
        module.rope_sin.copy_(sin)


def _copy_full(p: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        p.copy_(distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None))
    else:
        p.copy_(full)
