"""Small models and helpers shared by the multi-process tests."""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, scalar_gate: bool = True) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(dim))
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.gate = nn.Parameter(torch.tensor(0.5) if scalar_gate else torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.norm_weight
        return x + self.gate * self.fc2(torch.tanh(self.fc1(h)))


class ToyModel(nn.Module):
    """Embedding, blocks with uneven (7-row) weights and a 0-dim gate, an optional
    ``extra`` layer (unused when ``use_extra=False``), a head tied to the embedding."""

    def __init__(
        self, vocab: int = 11, dim: int = 6, hidden: int = 7, n_blocks: int = 3,
        tie: bool = True, scalar_gate: bool = True,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden, scalar_gate) for _ in range(n_blocks))
        self.extra = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        if use_extra:
            x = self.extra(x)
        return self.head(x)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float() if logits.dtype == torch.bfloat16 else logits.flatten(0, -2), targets.flatten())


def tiny_llama_config(**overrides: Any) -> Any:
    """A tiny ``LlamaConfig`` (no download): 2 decoder layers of width 32, vocab 64, untied
    embeddings, eager attention; ``overrides`` replace fields."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return LlamaConfig(**{**fields, **overrides})


def impl(name: str) -> Any:
    """The module that provides ``fully_shard``: ours or torch's (to keep tests honest).
    ``fsdp2-in-place``: ours, with every bucket (however small) gathered and reduced in
    place, as large buckets are on gloo."""
    if name == "fsdp2-in-place":
        force_in_place()
        name = "fsdp2"
    return importlib.import_module("fsdp2" if name == "fsdp2" else "torch.distributed.fsdp")


def in_place_worker(fn: Any, rank: int, world: int, *args: Any) -> Any:
    """``fn(rank, world, *args)`` in a rank where every bucket gathers and reduces in
    place: ``run_ranks(functools.partial(in_place_worker, fn), world, ...)``."""
    force_in_place()
    return fn(rank, world, *args)


def force_in_place(gather: bool = True) -> None:
    """In this process, every bucket built from now on reduces in place, and with
    ``gather`` also gathers in place (on any number of ranks)."""
    import fsdp2.bucket.in_place

    fsdp2.bucket.in_place.IN_PLACE_MIN_BYTES = 0
    fsdp2.bucket.in_place.IN_PLACE_MIN_WORLD = 2
    fsdp2.bucket.in_place.GATHER_IN_PLACE = gather


def batch(step: int, global_batch: int, seq: int = 5, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (global_batch, seq), generator=g)
    targets = torch.randint(0, vocab, (global_batch, seq), generator=g)
    return ids, targets


def local_rows(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` rows of ``full`` (empty for trailing ranks)."""
    if full.dim() == 0:
        return full
    chunks = list(torch.chunk(full, world))
    return chunks[rank] if rank < len(chunks) else full[:0]


def copy_full_into_sharded(model: nn.Module, full: dict[str, torch.Tensor], rank: int, world: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(local_rows(full[name], rank, world))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's full value, on every rank (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    full = _rows_of_every_rank(params)
    return {
        n: full[n] if n in full else (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in params.items()
    }


def _rows_of_every_rank(params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """The plain parameters sharded by rows over every rank of a gloo job in rank order
    (fully_shard's default on the default mesh), gathered whole in one collective for all
    of them rather than one ``full_tensor`` each (hundreds of collectives a test, a fifth
    of a 4-rank world's time): a rank's rows are the chunk ``Shard(0)`` gives it, so the
    full tensor is the ranks' rows concatenated in rank order. Any other layout: none."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return {}
    world = dist.get_world_size()
    names = [
        n for n, p in params.items()
        if isinstance(p, DTensor) and p.placements == (Shard(0),) and type(p.to_local()) is torch.Tensor
        and p.device_mesh.mesh.tolist() == list(range(world))
    ]
    if len(names) < 2:
        return {}
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, [params[n].to_local().detach() for n in names])
    return {n: torch.cat([r[i] for r in rows]) for i, n in enumerate(names)}


def worst(values: list[float]) -> float:
    """The largest difference; a NaN anywhere counts as infinitely wrong (Python's max
    would skip it)."""
    import math

    return math.inf if any(math.isnan(v) for v in values) else max(values)
