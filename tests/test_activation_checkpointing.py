"""Activation checkpointing in every common form trains like one local replica fed the
global batch, in float64: ``checkpoint_wrapper`` (non-reentrant and reentrant) before
``fully_shard`` on the wrapper (torchtitan's recipe), ``torch.utils.checkpoint`` of a
function or a bound method (both kinds), Hugging Face's ``checkpoint(layer.__call__)``,
the composable ``checkpoint(module)`` with ``fully_shard`` on its children and two
forwards before one backward, and selective activation checkpointing. Under a
``MixedPrecisionPolicy`` the recompute casts exactly as the forward did: training with
checkpointing equals training without it.

Every configuration runs in one set of spawned ranks per library, torch's own
``fully_shard`` included, which keeps the reference honest.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import run_ranks
from _models import ToyModel, batch, full_params, impl, loss_fn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

STEPS = 2
RTOL, ATOL = 1e-10, 1e-12

# form -> (how the blocks are checkpointed, what fully_shard is applied to)
FORMS = [
    "wrapper",  # checkpoint_wrapper(block), then fully_shard(wrapper)
    "wrapper_reentrant",
    "function",  # checkpoint(lambda t: block(t), x)
    "function_reentrant",
    "method",  # checkpoint(self.run_block, i, x): a bound method of the parent
    "method_reentrant",
    "hf_call",  # checkpoint(block.__call__, x), reentrant as Hugging Face's default
    "hf_call_non_reentrant",
    "composable",  # torch.distributed._composable.checkpoint(block), fully_shard(block.fc1/fc2)
    "selective",  # non-reentrant with create_selective_checkpoint_contexts (matmuls saved)
]
MP_FORMS = ["wrapper", "function", "hf_call", "selective"]


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    mm = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if mm else CheckpointPolicy.PREFER_RECOMPUTE


class AcModel(ToyModel):
    """ToyModel whose blocks run under activation checkpointing in the given form. The
    checkpointed functions also gate the block's output by its input, so the recompute
    saves the block's output: a dtype it got differently from the forward (a missed
    output cast) would be a checkpoint metadata mismatch."""

    def __init__(self, form: str, scalar_gate: bool, checkpointing: bool = True) -> None:
        super().__init__(n_blocks=3, scalar_gate=scalar_gate)
        self.form = form
        self.checkpointing = checkpointing

    def run_block(self, i: int, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks[i](x)
        return out if self.form.startswith(("wrapper", "composable")) else out * torch.sigmoid(x)

    def forward(self, ids: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        x = self.emb(ids)
        for i, block in enumerate(self.blocks):
            x = self._checkpointed(i, block, x) if self.checkpointing else self.run_block(i, x)
        return self.head(self.extra(x))

    def _checkpointed(self, i: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        form = self.form
        if form.startswith(("wrapper", "composable")):
            return block(x)  # checkpointing is inside the module
        reentrant = form.endswith("_reentrant") or form == "hf_call"
        if form.startswith("function"):
            return checkpoint(lambda t: block(t) * torch.sigmoid(t), x, use_reentrant=reentrant)
        if form.startswith("method"):
            return checkpoint(self.run_block, i, x, use_reentrant=reentrant)
        if form.startswith("hf_call"):
            return checkpoint(block.__call__, x, use_reentrant=reentrant) * torch.sigmoid(x)
        if form == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return checkpoint(self.run_block, i, x, use_reentrant=False, context_fn=context)
        raise AssertionError(form)


def _build(form: str, lib: Any, mp: Any, checkpointing: bool = True) -> tuple[nn.Module, nn.Module]:
    """The sharded model (checkpointed per ``form``) and its local float64 twin."""
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    torch.manual_seed(0)
    ref = AcModel(form, scalar_gate=lib.__name__ == "fsdp2", checkpointing=False).double()  # torch refuses 0-dim
    model = copy.deepcopy(ref)
    model.checkpointing = checkpointing
    kwargs = {} if mp is None else {"mp_policy": mp}
    for i, block in enumerate(model.blocks):
        if not checkpointing:
            lib.fully_shard(block, **kwargs)
        elif form.startswith("wrapper"):
            impl_kind = CheckpointImpl.REENTRANT if form.endswith("_reentrant") else CheckpointImpl.NO_REENTRANT
            model.blocks[i] = lib.fully_shard(checkpoint_wrapper(block, checkpoint_impl=impl_kind), **kwargs)
        elif form == "composable":
            composable_checkpoint(block)
            lib.fully_shard(block.fc1, **kwargs)
            lib.fully_shard(block.fc2, **kwargs)
        else:
            lib.fully_shard(block, **kwargs)
    lib.fully_shard(model)  # the root computes in float64: blocks' outputs come back as that
    return model, ref


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.replace("._checkpoint_wrapped_module", ""): t for n, t in full_params(model).items()}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = RTOL, atol: float = ATOL) -> float:
    """Largest mismatch relative to the tolerance (<= 1 passes); NaN counts as a mismatch."""
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        excess = ((g - w).abs() / (atol + rtol * w.abs())).max().item()
        worst = max(worst, math.inf if math.isnan(excess) else excess)
    return worst


def _train(model: nn.Module, rank: int, world: int, global_batch: bool, forwards: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = torch.zeros((), dtype=torch.float64)
        for f in range(forwards):  # several forwards, one backward
            ids, targets = batch(10 * step + f, 2 * world)
            if not global_batch:
                ids, targets = ids.chunk(world)[rank], targets.chunk(world)[rank]
            loss = loss + loss_fn(model(ids), targets).double() / forwards
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _parity(form: str, lib: Any, rank: int, world: int) -> float:
    model, ref = _build(form, lib, None)
    forwards = 2 if form == "composable" else 1
    _train(model, rank, world, False, forwards)
    _train(ref, rank, world, True, forwards)
    return _worst(_full(model), full_params(ref))


def _mp_equals_no_checkpointing(form: str, lib: Any, rank: int, world: int) -> float:
    """Blocks compute in float32 and reduce and output float64: checkpointed training
    equals the same training without checkpointing (the recompute casts as the forward
    did)."""
    mp = lib.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64, output_dtype=torch.float64)
    model, _ = _build(form, lib, mp)
    plain, _ = _build(form, lib, mp, checkpointing=False)
    _train(model, rank, world, False, 1)
    _train(plain, rank, world, False, 1)
    return _worst(_full(model), _full(plain), rtol=1e-12, atol=1e-14)


def _worker(rank: int, world: int, lib_name: str) -> dict[str, float | str]:
    """Every configuration; one that raises reports its error (every rank raises alike
    here: the forms are deterministic and the same on all ranks)."""
    lib = impl(lib_name)
    runs = {form: functools.partial(_parity, form) for form in FORMS}
    runs.update({f"mp_{form}": functools.partial(_mp_equals_no_checkpointing, form) for form in MP_FORMS})
    out: dict[str, float | str] = {}
    for key, run in runs.items():
        try:
            out[key] = run(lib, rank, world)
        except Exception as e:  # noqa: BLE001 - reported by the test of this configuration
            out[key] = f"{type(e).__name__}: {e}"[:300]
    return out


@functools.cache
def _results(lib_name: str) -> dict[str, float | str]:
    per_rank = run_ranks(_worker, 2, lib_name)
    return {key: max(r[key] for r in per_rank) if all(isinstance(r[key], float) for r in per_rank) else
            next(r[key] for r in per_rank if isinstance(r[key], str)) for key in per_rank[0]}


def _passes(value: float | str) -> bool:
    return isinstance(value, float) and value <= 1.0


@pytest.mark.parametrize("form", FORMS)
def test_checkpointing_matches_local_training(form: str) -> None:
    assert _passes(_results("fsdp2")[form]), _results("fsdp2")[form]


@pytest.mark.parametrize("form", MP_FORMS)
def test_recompute_casts_as_the_forward_did(form: str) -> None:
    assert _passes(_results("fsdp2")[f"mp_{form}"]), _results("fsdp2")[f"mp_{form}"]


def test_reference_holds_with_torch_fully_shard() -> None:
    results = _results("torch")
    assert all(_passes(v) for v in results.values()), results
