"""Pipeline parallel (``torch.distributed.pipelining``) over fsdp2-sharded stages on a
(pp 2, dp 2) mesh trains like one local replica fed the global batch, in float64, for
every schedule and ``reshard_after_forward`` setting, reducing each group's gradients
once per step and running no more data-parallel collectives than torch's
``fully_shard`` on the same schedule. The same worker runs torch's ``fully_shard``
(where torch trains correctly: not the zero-bubble schedules with resharding after
forward), which keeps the reference and the counts honest.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _comm import CommCounter
from _dist import run_ranks
from _models import impl

from fsdp2._compat import stage_drives_fsdp_publicly

VOCAB, DIM, HIDDEN, BLOCKS, MICRO_BATCHES, STEPS, PER_RANK_BATCH = 11, 6, 7, 4, 2, 2, 8
# Each micro-batch and step is a chain of point-to-point hand-offs between the ranks,
# what these runs mostly wait on. Two micro-batches tell a reduce per step from one per
# micro-batch as four did, and with two torch's weight passes still find resharded
# parameters in the zero-bubble schedules (its results there as wrong); DualPipeV
# requires as many as stages (4). Two steps: the first also infers shapes, the second is
# counted (a third repeated it).
RTOL, ATOL = 1e-10, 1e-12
# Schedules with two stages per rank, and which of them place them as a V.
LOOPED = {"Interleaved1F1B", "ZBVZeroBubble", "LoopedBFS", "InterleavedZeroBubble", "DualPipeV"}
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}
SPLIT_BACKWARD = {"ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"}
CONFIGS = [(s, None) for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "LoopedBFS", "InterleavedZeroBubble", "DualPipeV")]
CONFIGS += [(s, raf) for s in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble") for raf in (True, False)]


# torch 2.15's own stage and schedules drive fsdp2's modules through public methods under
# the launcher (``fsdp2.patch``): each schedule, and the schedule options of 2.15 that act on
# FSDP modules. Run where the installed torch's pipelining does so (none before 2.15).
PUBLIC = [
    ("GPipe", None, "plain"), ("1F1B", None, "plain"), ("Interleaved1F1B", None, "plain"),
    ("ZBVZeroBubble", False, "plain"), ("Interleaved1F1B", None, "defer_reduce_grad_wait"),
    ("Interleaved1F1B", None, "unshard_lookahead"), ("1F1B", None, "finalize_gradients"),
]
PUBLIC = PUBLIC if stage_drives_fsdp_publicly() else []


def _torch_trains_it(schedule: str, raf: bool | None) -> bool:
    """torch's fully_shard trains zero-bubble schedules wrongly unless parameters stay
    gathered after forward (its weight pass finds the sharded parameters)."""
    return raf is False or (schedule not in SPLIT_BACKWARD and raf is True)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    """Stage ``index`` of ``count``: a slice of the blocks, plus the embedding (first) or
    the head (last)."""

    def __init__(self, full: Model, index: int, count: int) -> None:
        super().__init__()
        per = BLOCKS // count
        self.emb = full.emb if index == 0 else None
        self.blocks = nn.ModuleList(full.blocks[index * per : (index + 1) * per])
        self.head = full.head if index == count - 1 else None
        self.first_block = index * per

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    n = 2 * PER_RANK_BATCH  # the global batch: dp 2
    return torch.randint(0, VOCAB, (n, 5), generator=g), torch.randint(0, VOCAB, (n, 5), generator=g)


def _stage_class(lib_name: str, adapter: str) -> Any:
    import torch.distributed.pipelining as pp

    if lib_name == "torch" or adapter == "none":
        return pp.PipelineStage
    if adapter == "adapt_stage":
        from fsdp2.pipelining import adapt_stage

        return lambda *a, **k: adapt_stage(pp.PipelineStage(*a, **k))
    from fsdp2.pipelining import PipelineStage

    return PipelineStage


def worst_excess(modules: list[nn.Module], ref: nn.Module) -> float:
    """The stages' full parameters against the local model's, in units of the tolerance
    (``ATOL + RTOL * |want|``); a NaN counts as infinitely wrong."""
    want = dict(ref.named_parameters())
    worst = 0.0
    for module in modules:
        for name, p in module.named_parameters():
            if name.startswith("blocks."):
                parts = name.split(".")
                name = ".".join(["blocks", str(module.first_block + int(parts[1])), *parts[2:]])
            got, w = p.full_tensor().detach(), want[name].detach()
            excess = ((got - w).abs() / (ATOL + RTOL * w.abs())).max().item()
            worst = max(worst, math.inf if math.isnan(excess) else excess)
    return worst


def _run(
    lib_name: str, schedule: str, raf: bool | None, rank: int, adapter: str = "PipelineStage", option: str = "plain"
) -> dict[str, Any]:
    """One schedule's training run; ``adapter="launcher"``: torch's own stage (and, for
    fsdp2, under ``fsdp2.patch``), with one of torch 2.15's schedule ``option``s."""
    if adapter == "launcher" and lib_name == "fsdp2":
        import fsdp2.patch

        with fsdp2.patch.applied():
            return _run(lib_name, schedule, raf, rank, "none", option)
    import torch.distributed.pipelining as pp
    from torch.distributed.device_mesh import init_device_mesh

    lib = impl(lib_name)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    count = 4 if schedule in LOOPED else 2
    mine = [pp_rank, count - 1 - pp_rank] if schedule in V_SHAPED else [pp_rank, pp_rank + 2] if count == 4 else [pp_rank]
    torch.manual_seed(0)
    ref = Model().double()
    full = Model().double()
    full.load_state_dict(ref.state_dict())
    make_stage = _stage_class(lib_name, adapter)
    modules, stages = [], []
    for index in mine:
        module = Stage(full, index, count)
        if adapter == "stage_first":  # torchtitan's pipeline_llm: the stage, then fully_shard
            stages.append(make_stage(module, index, count, torch.device("cpu"), group=mesh["pp"].get_group()))
        for block in module.blocks:
            lib.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=raf)
        lib.fully_shard(module, mesh=mesh["dp"], reshard_after_forward=raf)
        modules.append(module)
        if adapter != "stage_first":
            stages.append(make_stage(module, index, count, torch.device("cpu"), group=mesh["pp"].get_group()))
    schedule_cls = getattr(pp, "Schedule" + schedule)
    micro_batches = max(MICRO_BATCHES, count) if schedule == "DualPipeV" else MICRO_BATCHES
    options = {option: True if option == "defer_reduce_grad_wait" else "auto"} if option in ("defer_reduce_grad_wait", "unshard_lookahead") else {}
    runner = schedule_cls(stages if count == 4 else stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, **options)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    counts = []
    for step in range(STEPS):
        ids, targets = _batch(step)
        ref_opt.zero_grad()
        if option == "finalize_gradients":  # the two calls' losses add up
            sum(loss_fn(ref(ids[i::2]), targets[i::2]) for i in range(2)).backward()
        else:
            loss_fn(ref(ids), targets).backward()
        ref_opt.step()
        rows = slice(dp_rank * PER_RANK_BATCH, (dp_rank + 1) * PER_RANK_BATCH)
        kwargs = {"target": targets[rows]} if count - 1 in mine else {}
        with CommCounter().active() as counter:
            if option == "finalize_gradients":  # the step's batch in two calls, reduced once
                for i, last in ((0, False), (1, True)):
                    part = {k: v[i::2] for k, v in kwargs.items()}
                    runner.step(*([ids[rows][i::2]] if 0 in mine else []), finalize_gradients=last, **part)
            else:
                runner.step(*([ids[rows]] if 0 in mine else []), **kwargs)
        counts.append(dict(counter.calls))
        opt.step()
        opt.zero_grad()
    worst = worst_excess(modules, ref)
    groups = sum(len(m.blocks) + (m.emb is not None or m.head is not None) for m in modules)  # with parameters
    return {"worst": worst, "counts": counts[1:], "groups": groups}  # step 0 also infers shapes


def _worker(rank: int, world: int, lib_name: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for schedule, raf in CONFIGS:
        if lib_name == "fsdp2" or _torch_trains_it(schedule, raf):
            out[f"{schedule}-{raf}"] = _run(lib_name, schedule, raf, rank)
    for schedule, raf, option in PUBLIC:
        out[f"public-{schedule}-{raf}-{option}"] = _run(lib_name, schedule, raf, rank, "launcher", option)
    if lib_name == "fsdp2":
        out["adapt_stage"] = _run(lib_name, "Interleaved1F1B", None, rank, adapter="adapt_stage")
        # (Its own world once: these ranks serve as well, a spawn and a warm-up saved.)
        out["stage_first"] = _run(lib_name, "Interleaved1F1B", None, rank, adapter="stage_first")
        try:  # last: it fails in the middle of a schedule
            _run(lib_name, "GPipe", None, rank, adapter="none")
            out["unadapted"] = "ran"
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            out["unadapted"] = str(e)
    return out


@functools.cache
def _results(lib_name: str) -> list[dict[str, Any]]:
    return run_ranks(_worker, 4, lib_name, timeout=420)


@pytest.mark.parametrize("schedule,raf", CONFIGS, ids=[f"{s}-{r}" for s, r in CONFIGS])
def test_pipeline_matches_local_training(schedule: str, raf: bool | None) -> None:
    for rank, out in enumerate(_results("fsdp2")):
        run = out[f"{schedule}-{raf}"]
        assert run["worst"] <= 1.0, (rank, run)
        for step in run["counts"]:  # one reduce per group per step, not per micro-batch
            assert step.get("reduce", 0) == run["groups"], (rank, run)


@pytest.mark.parametrize("schedule,raf", [c for c in CONFIGS if _torch_trains_it(*c)], ids=str)
def test_no_more_collectives_than_torch(schedule: str, raf: bool | None) -> None:
    for rank, (ours, theirs) in enumerate(zip(_results("fsdp2"), _results("torch"))):
        mine, torch_run = ours[f"{schedule}-{raf}"], theirs[f"{schedule}-{raf}"]
        assert torch_run["worst"] <= 1.0, (rank, torch_run)  # the reference holds for torch too
        for a, b in zip(mine["counts"], torch_run["counts"]):
            for kind in ("all_gather", "reduce"):
                assert a.get(kind, 0) <= b.get(kind, 0), (rank, kind, mine["counts"], torch_run["counts"])


def test_adapt_stage_and_the_error_without_it() -> None:
    """``adapt_stage`` works like the subclass; torch's own stage is refused at the first
    forward (the ranks of the first stage say why; the others then lose their peers)."""
    results = _results("fsdp2")
    for out in results:
        assert out["adapt_stage"]["worst"] <= 1.0, out["adapt_stage"]
        assert out["unadapted"] != "ran", out
    for out in results[:2]:  # pp rank 0: the stage that runs forward first
        assert "fsdp2.pipelining.PipelineStage" in out["unadapted"], out["unadapted"]


def test_stage_built_before_fully_shard() -> None:
    """torchtitan's ``pipeline_llm`` builds each ``PipelineStage`` on the unsharded chunk and
    shards it afterwards: the stage still drives (and reduces) the groups created since."""
    for rank, out in enumerate(_results("fsdp2")):
        run = out["stage_first"]
        assert run["worst"] <= 1.0, (rank, run)
        for step in run["counts"]:
            assert step.get("reduce", 0) == run["groups"], (rank, run)


LAUNCHER_CASES = PUBLIC or [("torch-before-2.15", None, "PipelineStage")]


@pytest.mark.parametrize("schedule,raf,option", LAUNCHER_CASES, ids=[f"{s}-{r}-{o}" for s, r, o in LAUNCHER_CASES])
def test_torch_stage_drives_fsdp2_under_the_launcher(schedule: str, raf: bool | None, option: str) -> None:
    """torch 2.15: torch's own ``PipelineStage`` and schedules, fsdp2's modules, the launcher
    giving torch's pipelining fsdp2's ``FSDPModule``: exact, one reduce per group per step,
    and no more collectives than torch's ``fully_shard`` on the same schedule. Before 2.15
    (torch's stage reaches into its FSDP's internals) the launcher makes torch's
    ``PipelineStage`` name fsdp2's stage instead."""
    if not PUBLIC:
        import torch.distributed.pipelining as pp

        import fsdp2.patch
        from fsdp2.pipelining import PipelineStage

        with fsdp2.patch.applied():
            assert pp.PipelineStage is PipelineStage
        assert pp.PipelineStage is not PipelineStage
        return
    key = f"public-{schedule}-{raf}-{option}"
    for rank, (ours, theirs) in enumerate(zip(_results("fsdp2"), _results("torch"))):
        mine, torch_run = ours[key], theirs[key]
        assert mine["worst"] <= 1.0, (rank, mine)
        assert torch_run["worst"] <= 1.0, (rank, torch_run)
        for a, b in zip(mine["counts"], torch_run["counts"]):
            assert a.get("reduce", 0) == mine["groups"], (rank, mine)
            for kind in ("all_gather", "reduce"):
                assert a.get(kind, 0) <= b.get(kind, 0), (rank, kind, mine["counts"], torch_run["counts"])
