"""examples/rl_loop.py at 2 and 4 ranks: each iteration the engine's weights equal the
trained full weights; fsdp2's export takes one all-gather per ``fully_shard`` group in
the engine's dtype, the per-parameter loop on torch's ``fully_shard`` one per parameter
in float32; both libraries train alike. With ``--generate-with policy`` the sharded
policy generates, inside ``fsdp2.gathered`` at one all-gather per group, the same
completions as torch's ``fully_shard`` at one per block per token."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

import pytest
from _dist import cached_outcome, run_scenarios

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "64", "--iterations", "2"]
PARAMS = 1 + 2 * 9 + 2  # embeddings; per block 2 norms, wq/wk/wv/wo, w1/w2/w3; final norm, output


def _rank(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import rl_loop

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = rl_loop.main(argv)
    return {**summary, "log": out.getvalue()}


@cached_outcome
def _runs(world: int) -> dict[str, list[dict[str, Any]]]:
    impls = ["fsdp2", "torch"] if world == 2 else ["fsdp2"]
    scenarios = {impl: (_rank, ([*SMALL, "--impl", impl],)) for impl in impls}
    if world == 2:  # the sharded policy generates (fsdp2.gathered), on both libraries
        for impl in impls:
            scenarios[f"policy-{impl}"] = (_rank, ([*SMALL, "--impl", impl, "--generate-with", "policy"],))
    return run_scenarios(world, scenarios, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_the_engine_gets_the_trained_weights_in_one_gather_per_group(world: int) -> None:
    runs = _runs(world)
    for rank, out in enumerate(runs["fsdp2"]):
        assert out["equal"] == [True, True], out
        assert [calls for calls, _, _ in out["exports"]] == [3, 3], out  # 2 blocks + the root
        assert ("engine == trained: True" in out["log"]) == (rank == 0), out["log"]
    if world == 2:
        for mine, theirs in zip(runs["fsdp2"], runs["torch"]):
            assert theirs["equal"] == [True, True], theirs
            assert [calls for calls, _, _ in theirs["exports"]] == [PARAMS, PARAMS], theirs
            # bf16 before the gather against float32 after: half the bytes (fsdp2's padding aside)
            assert mine["exports"][0][1] < 0.55 * theirs["exports"][0][1], (mine["exports"], theirs["exports"])
        losses = [[line.split("loss ")[1].split()[0] for line in runs[i][0]["log"].splitlines()] for i in ("fsdp2", "torch")]
        assert losses[0] == losses[1], losses


def test_the_policy_generates_inside_gathered_at_one_gather_per_group() -> None:
    runs = _runs(2)
    gen_len, groups = 8, 3  # rl_loop's default --gen-len; 2 blocks + the root
    for mine, theirs in zip(runs["policy-fsdp2"], runs["policy-torch"]):
        assert mine["equal"] == theirs["equal"] == [True, True], (mine, theirs)
        for (calls, _, _, seqs), (their_calls, _, _, their_seqs) in zip(mine["generations"], theirs["generations"]):
            assert calls == groups, mine["generations"]
            assert their_calls >= 2 * gen_len, theirs["generations"]  # the blocks, every token
            assert seqs == their_seqs  # the same completions, bit for bit
