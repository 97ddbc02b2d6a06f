"""examples/train.py ``--auto-plan``: the model sharded by ``fsdp2.plan`` (embeddings,
each block, final norm + output, root) trains exactly like the hand-written per-block
loop; with ``--memory-budget`` the plan is fitted before the process group starts (dry
runs on torch's fake process group) and, with the activation checkpointing and
resharding it chose, still trains exactly like it; a budget nothing fits exits with
status 1 and says so; flags the planner cannot serve are refused."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import free_port, run_scenarios
from test_train_example import FLAG_RUN, ROOT, SMALL, _example_rank, _losses

import fsdp2

TOO_SMALL = "100KiB"  # under the sharded parameters, optimizer state and activations of one step


def _train() -> Any:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train

    return train


def _budget() -> int:
    """95% of the peak of the planner's default plan for the flag run (embeddings and every
    block resharded after forward, nothing checkpointed), estimated as the example does:
    under every rung of the fit's ladder that only reshards (those keep the last block
    gathered too), over full checkpointing of every block, so the fit has to checkpoint."""
    train = _train()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("WORLD_SIZE", "2")
        args = train.parse_args([*SMALL, *FLAG_RUN, "--auto-plan"])
        default = train.fit_plan(args, train.model_args(args), train.precision_policy(args, fsdp2))
    return int(default.estimate.peak * 0.95)


def _fresh_group_rank(rank: int, world: int, argv: list[str], port: int) -> str:
    """The example as torchrun starts it: no process group yet (``--memory-budget`` fits
    before ``init_process_group``); ``main`` then starts gloo itself on a new port."""
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    return _example_rank(rank, world, argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:  # noqa: ANN001
    """name -> (log of both ranks, final parameters): the hand-written sharding, the
    plan's, and the plan fitted to ``_budget()`` (with ``--meta-init``), in one set of
    ranks; "bytes": that budget."""
    out = tmp_path_factory.mktemp("plan")
    budget = _budget()
    flags = {"hand": [], "plan": ["--auto-plan"],
             "budget": ["--auto-plan", "--memory-budget", f"{budget}B", "--meta-init"]}
    paths = {name: str(out / f"{name}.pt") for name in flags}
    argv = {name: [*SMALL, *FLAG_RUN, *f, "--final-params", paths[name]] for name, f in flags.items()}
    scenarios = {"hand": (_example_rank, (argv["hand"],)), "plan": (_example_rank, (argv["plan"],)),
                 "budget": (_fresh_group_rank, (argv["budget"], free_port()))}  # last: it replaces the group
    logs = run_scenarios(2, scenarios, timeout=300)
    return {**{name: ("".join(logs[name]), paths[name]) for name in flags}, "bytes": budget}


def _same_training(got: tuple[str, str], want: tuple[str, str]) -> None:
    """The same losses (as printed) and the same final parameters, bit for bit: the plan's
    groups reduce each gradient over the same ranks, and checkpointing recomputes exactly."""
    losses = _losses(got[0])
    assert len(losses) == 6 and losses == _losses(want[0]), (losses, _losses(want[0]))
    a, b = torch.load(got[1]), torch.load(want[1])
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k


def _table(log: str) -> dict[str, tuple[str, str]]:
    """The printed plan's block rows: group -> (reshard, AC)."""
    rows = re.findall(r"^(layers\.\d+)\s+1\s+[\d,]+\s+[\d.]+\s+(\S+)\s+(\S+)\s+(?:yes|no)\s", log, re.M)
    return {name: (reshard, ac) for name, reshard, ac in rows}


def test_auto_plan_trains_like_the_hand_written_sharding(runs) -> None:  # noqa: ANN001
    log = runs["plan"][0]
    assert "auto-plan" in log and "fitted" not in log
    assert re.search(r"^tok_embeddings\s", log, re.M) and re.search(r"^\[norm, output\]\s.*False", log, re.M)
    assert _table(log) == {f"layers.{i}": ("True", "none") for i in range(4)}, _table(log)
    assert "estimated peak" not in log  # no budget: no dry runs
    _same_training(runs["plan"], runs["hand"])


def test_budget_fitted_plan_checkpoints_and_trains_like_the_hand_written_sharding(runs) -> None:  # noqa: ANN001
    log, budget = runs["budget"][0], runs["bytes"]
    assert f"auto-plan fitted to {budget / 2**20:,.1f} MiB" in log
    table = _table(log)
    assert list(table) == [f"layers.{i}" for i in range(4)], table
    assert any(ac != "none" for _, ac in table.values()), table  # it had to checkpoint
    # The ladder reshards before it checkpoints (the last block stays gathered), and
    # checkpoints blocks in forward order.
    assert [reshard for reshard, _ in table.values()] == ["True", "True", "True", "False"], table
    assert table["layers.0"][1] != "none", table
    peak = re.search(r"estimated peak per rank: ([\d,.]+) MiB \(\w+\), budget ([\d,.]+) MiB: fits", log)
    assert peak and float(peak[1].replace(",", "")) <= float(peak[2].replace(",", "")), log
    assert re.search(r"fitted: rung \d+ of \d+ \(layers\.\d: (selective|full) activation checkpointing\)", log), log
    _same_training(runs["budget"], runs["hand"])


def test_a_budget_nothing_fits_exits_with_status_1(capsys, monkeypatch) -> None:  # noqa: ANN001
    """Before any process group: the fit fails, rank 0 prints why, the process exits 1."""
    train = _train()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert not dist.is_initialized()
    with pytest.raises(SystemExit) as exit_:
        train.main([*SMALL, *FLAG_RUN, "--auto-plan", "--memory-budget", TOO_SMALL])
    assert exit_.value.code == 1 and not dist.is_initialized()
    err = capsys.readouterr().err
    assert "no plan fits the budget of 0.1 MiB per rank" in err and "every group offloaded" in err, err


def test_flags_the_planner_cannot_serve_are_refused(capsys) -> None:  # noqa: ANN001
    train = _train()

    assert train.parse_args(["--auto-plan", "--memory-budget", "0.5"]).memory_budget == 2**29  # GiB
    assert train.parse_args(["--auto-plan", "--memory-budget", "800MiB"]).memory_budget == 800 * 2**20
    for argv, fragment in [
        (["--memory-budget", "40"], "add --auto-plan"),
        (["--auto-plan", "--memory-budget", "0"], "positive number of GiB"),
        (["--auto-plan", "--memory-budget", "lots"], "memory_budget must be"),
        (["--auto-plan", "--impl", "torch"], "--auto-plan cannot run with --impl torch"),
        (["--auto-plan", "--pp", "2", "--microbatches", "2"], "--auto-plan cannot run with --pp"),
        (["--auto-plan", "--tp", "2"], "--auto-plan cannot run with --tp"),
        (["--auto-plan", "--moe", "--memory-budget", "40"], "--memory-budget cannot run with --moe"),
        (["--auto-plan", "--ac", "full"], "--auto-plan cannot run with --ac full"),
        (["--auto-plan", "--compile"], "--auto-plan cannot run with --compile"),
        (["--auto-plan", "--optim", "muon", "--memory-budget", "40"], "--memory-budget cannot run with --optim"),
    ]:
        with pytest.raises(SystemExit), pytest.MonkeyPatch.context() as m:
            m.setenv("WORLD_SIZE", "4")
            train.parse_args(argv)
        assert fragment in capsys.readouterr().err, argv
