"""A script written for torch (torch's imports only), run by tests/test_patch.py through
``python -m fsdp2.patch`` (and once without it). It prints one ``PATCH_SCRIPT {json}`` line
per rank: where its names came from, its ``sys.argv`` and ``__name__``, and with 2 ranks
the worst error of a zero-bubble pipeline (2 ranks, 4 stages in a V, each stage's blocks
sharded with ``fully_shard``) against local training, in float64 (at most 1 passes), and
the all-gathers of 5 forwards inside ``fsdp2.gathered`` (the one line a user adds).
Its helpers come from tests/test_pipeline.py, found through the script's own folder on
``sys.path``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from test_pipeline import VOCAB, Model, Stage, loss_fn, worst_excess
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble


def names() -> dict:
    return {
        "fully_shard": fully_shard.__module__, "FSDPModule": FSDPModule.__module__,
        "PipelineStage": PipelineStage.__module__, "argv": sys.argv, "name": __name__,
    }


def train(steps: int) -> tuple[float, int]:
    """Worst ``|got - want| / (ATOL + RTOL |want|)`` over the parameters after ``steps``,
    and ``gathered_generation``'s all-gathers in the same process group."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    ref, full = Model().double(), Model().double()
    full.load_state_dict(ref.state_dict())
    mine = [rank, 3 - rank]  # a V: stages 0 and 3 on rank 0
    modules = [Stage(full, i, 4) for i in mine]
    stages = []
    for index, module in zip(mine, modules):
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        stages.append(PipelineStage(module, index, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
    runner = ScheduleZBVZeroBubble(stages, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids, targets = torch.randint(0, VOCAB, (8, 5), generator=g), torch.randint(0, VOCAB, (8, 5), generator=g)
        loss_fn(ref(ids), targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        runner.step(*([ids] if rank == 0 else []), **({"target": targets} if rank == 0 else {}))
        opt.step()
        opt.zero_grad()
    worst = worst_excess(modules, ref)
    gathers = gathered_generation(5)
    dist.destroy_process_group()
    return worst, gathers


def gathered_generation(tokens: int) -> int:
    """All-gathers of ``tokens`` no-grad forwards of a model sharded with torch's names
    (fsdp2's under the launcher) inside the one line ``fsdp2.gathered`` takes."""
    from _comm import CommCounter

    import fsdp2

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    counter = CommCounter()
    with counter.active(), torch.no_grad(), fsdp2.gathered(model):
        for _ in range(tokens):
            model(torch.randn(2, 4))
    return counter.calls["all_gather"]


if __name__ == "__main__":
    out = names()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out["worst"], out["gathered_gathers"] = train(int(sys.argv[sys.argv.index("--steps") + 1]))
    # One write of the whole line (atomic on a pipe up to 4 KiB): the ranks share stdout,
    # and a print's text and newline may go out apart, interleaving two ranks' lines.
    sys.stdout.flush()
    os.write(1, ("PATCH_SCRIPT " + json.dumps(out) + "\n").encode())
