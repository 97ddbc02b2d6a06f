"""examples/train.py with ``--moe --ep 2`` (a file of its own, so the two test workers run
it beside tests/test_train_example.py's other runs; its configurations are listed there,
in ``MOE_RUNS`` and ``tested_flag_sets``)."""

from __future__ import annotations

from test_train_example import FLAG_RUN, MOE, MOE_RUNS, _losses, _same, run_example


def test_moe_with_expert_parallel_trains_alike_in_every_layout_and_resumes(tmp_path) -> None:  # noqa: ANN001
    """``--moe --ep 2`` (experts split over 2 ranks, sharded over the rest with a
    per-parameter mesh) on 4 ranks: torch's ``fully_shard`` prints the same losses, and so
    does HSDP with activation checkpointing (within bf16's rounding); the pipeline and
    tensor-parallel runs with Muon and clipping print the 2-rank run's; a run stopped after
    step 2 resumes from the step-1 checkpoint and ends with the uninterrupted run's
    parameters, bit for bit (as the job of a rank killed at step 3 would: the kill and the
    restart under torchrun are tests/test_train_example.py's, on the dense model)."""
    clean, resumed = str(tmp_path / "clean.pt"), str(tmp_path / "resumed.pt")
    saving = ["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    # One set of 4 ranks for every 4-rank run: the uninterrupted 5-step run, the same
    # saving every 2 steps stopped after step 2 ("first"), then resumed to step 5, and
    # the layouts of MOE_RUNS.
    runs = {
        "want": [*FLAG_RUN, *MOE, "--steps", "5", "--final-params", clean],
        "first": [*FLAG_RUN, *MOE, "--steps", "3", *saving],
        "resumed": [*FLAG_RUN, *MOE, "--steps", "5", *saving, "--final-params", resumed],
    }
    runs |= {name: [*FLAG_RUN, *flags] for name, (nproc, flags) in MOE_RUNS.items() if nproc == 4}
    logs = run_example(4, runs)
    logs |= run_example(2, {name: [*FLAG_RUN, *flags] for name, (nproc, flags) in MOE_RUNS.items() if nproc == 2})
    want = _losses(logs["want"])
    runs = {name: _losses(logs[name]) for name in MOE_RUNS}
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
    assert "resumed from" in logs["resumed"] and "step-000001" in logs["resumed"]
    _same(clean, resumed)
