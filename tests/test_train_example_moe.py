"""examples/train.py with ``--moe --ep 2`` under torchrun (a file of its own, so the
two test workers run it beside tests/test_train_example.py's other runs; its
configurations are listed there, in ``MOE_RUNS`` and ``tested_flag_sets``)."""

from __future__ import annotations

from test_train_example import FLAG_RUN, MOE, MOE_RUNS, _losses, _same, _torchrun


def test_moe_with_expert_parallel_trains_alike_in_every_layout_and_resumes(tmp_path) -> None:  # noqa: ANN001
    """``--moe --ep 2`` (experts split over 2 ranks, sharded over the rest with a
    per-parameter mesh) on 4 ranks: torch's ``fully_shard`` prints the same losses, and so
    does HSDP with activation checkpointing (within bf16's rounding); the pipeline and
    tensor-parallel runs with Muon and clipping print the 2-rank run's; a rank killed at step 3 resumes from
    the step-1 checkpoint and ends with the uninterrupted run's parameters, bit for bit."""
    clean, crashed, ckpt = (str(tmp_path / n) for n in ("clean.pt", "crashed.pt", "ckpt"))
    want = _losses(_torchrun(*FLAG_RUN, *MOE, "--steps", "5", "--final-params", clean, nproc=4))
    runs = {name: _losses(_torchrun(*FLAG_RUN, *flags, nproc=nproc)) for name, (nproc, flags) in MOE_RUNS.items()}
    for name, tolerance in (("impl torch", 1.5e-4), ("hsdp 2, ac full, bf16", 5e-3)):
        assert len(runs[name]) == 12, (name, runs[name])  # 4 data ranks, 3 steps
        for key, loss in runs[name].items():
            assert abs(want[key] - loss) < tolerance, (name, key, loss, want[key])
    plain = runs["muon, clip"]
    assert len(plain) == 6, plain
    for name in ("pp 2, muon, clip", "tp 2, muon, clip"):
        assert runs[name].keys() == plain.keys(), (name, runs[name])
        for key, loss in plain.items():
            assert abs(runs[name][key] - loss) < 5e-4, (name, key, runs[name][key], loss)
    log = _torchrun(
        *FLAG_RUN, *MOE, "--steps", "5", "--ckpt-dir", ckpt, "--save-every", "2", "--final-params", crashed,
        env={"FSDP2_EXAMPLE_FAIL_AT": "3"}, restarts=1, nproc=4,
    )
    assert "resumed from" in log and "step-000001" in log
    _same(clean, crashed)
