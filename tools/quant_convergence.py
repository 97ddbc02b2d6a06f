"""Does quantized communication train as well as full precision? The example's model on
real text, at 4 gloo ranks on CPU, once per setting.

    python tools/quant_convergence.py                                  # every setting, 300 steps each
    python tools/quant_convergence.py --settings fp32 --steps 20 --md /tmp/q.md --png /tmp/q.png

Each setting is ``examples/train.py``'s ``main(argv)`` with ``--data text`` (bytes of the
standard library's source), in ranks forked by ``tests/_dist.py``'s ``run_ranks``: the
example's own flags, nothing re-implemented. Every setting has the same seed, so the same
initial weights, data order and held-out batches; only the communication differs. The
train loss (mean over the ranks, every step) and the held-out loss (every
``--eval-every`` steps and at the end) are read from the lines the example prints.

Writes a PNG of the curves and a markdown table: per setting, the final held-out loss, its
relative gap to full precision (``fp32``) and whether that meets the target (quantized
gather alone within 1%, with a quantized reduce too within 2%; a lower loss always meets it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import platform
import re
import shlex
import sys
import time
from typing import NamedTuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # run_ranks: forked gloo ranks
sys.path.insert(0, os.path.join(ROOT, "examples"))  # the ranks import train from here
from _dist import RankError, run_ranks  # noqa: E402


class Setting(NamedTuple):
    flags: list[str]  # added to the example's command line
    target_pct: float | None  # allowed held-out gap to fp32 in percent (None: the reference)


SETTINGS: dict[str, Setting] = {
    "fp32": Setting([], None),
    "gather-int8": Setting(["--quantize-gather", "int8"], 1.0),
    "gather-fp8": Setting(["--quantize-gather", "fp8"], 1.0),
    "both-int8": Setting(["--quantize-gather", "int8", "--quantize-reduce", "int8"], 2.0),
    "both-fp8": Setting(["--quantize-gather", "fp8", "--quantize-reduce", "fp8"], 2.0),
}
REFERENCE = "fp32"


class Curves(NamedTuple):
    train: dict[int, float]  # step -> train loss, the mean over the data ranks
    heldout: dict[int, float]  # step -> held-out loss (rank 0 prints the all-reduced mean)
    step_ms: float  # rank 0's median step time (the example's step_time)
    seconds: float  # wall time of the whole setting, start and import of the ranks included


class Outcome(NamedTuple):
    curves: Curves | None  # None: the setting failed
    error: str  # the failure's last line, "" when it ran


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, from {', '.join(SETTINGS)} (default: all)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches per rank per evaluation")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default="cosine",
                   help="the example's: cosine decays to lr/10 by the last step, which steadies the final loss")
    p.add_argument("--seeds", default="0,1,2",
                   help="comma-separated: every setting runs once per seed (weights and data order); the gaps "
                        "are taken per seed against fp32 of the same seed and averaged")
    p.add_argument("--extra", default="", help="more flags for every setting, e.g. '--bf16'")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one setting may take")
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "quant_convergence.png"),
                   help="the curves (needs matplotlib); '' for none")
    p.add_argument("--md", default=os.path.join(ROOT, "docs", "quant_convergence.md"))
    p.add_argument("--json", default=None, help="also write the curves here")
    args = p.parse_args(argv)
    args.command = list(sys.argv[1:] if argv is None else argv)  # for the report
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or not args.settings:
        p.error(f"--settings: unknown {unknown} (choose from {', '.join(SETTINGS)})")
    if args.png and importlib.util.find_spec("matplotlib") is None:  # before minutes of training, not after
        p.error("--png needs matplotlib: pip install matplotlib (or pass --png '')")
    return args


def example_argv(args: argparse.Namespace, setting: Setting, seed: int) -> list[str]:
    """The example's command line for one setting and seed: the same model and data for all."""
    return ["--data", "text", "--steps", str(args.steps), "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), "--dim", str(args.dim), "--layers", str(args.layers),
            "--heads", str(args.heads), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--lr-schedule", args.lr_schedule, "--seed", str(seed), *args.extra.split(),
            *setting.flags]


def _rank(rank: int, world: int, argv: list[str]) -> str:
    """One rank of the example in run_ranks' gloo process group: what it printed."""
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(argv)
    return out.getvalue()


def parse_logs(logs: list[str], seconds: float) -> Curves:
    """Every rank prints its own train loss and step time; rank 0 prints the held-out losses."""
    per_step: dict[int, list[float]] = {}
    for log in logs:
        for step, loss in re.findall(r"^rank \d+ data \d+ step +(\d+) loss +([0-9.]+)", log, re.MULTILINE):
            per_step.setdefault(int(step), []).append(float(loss))
    train = {step: sum(v) / len(v) for step, v in sorted(per_step.items())}
    found = re.findall(r"^eval step (\d+) heldout_loss ([0-9.]+)", logs[0], re.MULTILINE)
    heldout = {int(s): float(v) for s, v in found}
    times = sorted(float(t) for t in re.findall(r"^rank 0 .* step_time +([0-9.]+) ms", logs[0], re.MULTILINE))
    if not train or not heldout or not times:
        raise ValueError("no train or held-out losses in the example's output:\n" + logs[0][-2000:])
    return Curves(train, heldout, times[len(times) // 2], seconds)


def run_setting(args: argparse.Namespace, name: str, seed: int) -> Outcome:
    start = time.perf_counter()
    try:
        logs = run_ranks(_rank, args.ranks, example_argv(args, SETTINGS[name], seed), timeout=args.timeout)
    except RankError as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        return Outcome(None, lines[-1] if lines else "failed")
    return Outcome(parse_logs(logs, time.perf_counter() - start), "")


# setting -> seed -> its run
Results = dict[str, dict[int, Outcome]]


def gap_pct(loss: float, reference: float) -> float:
    return (loss - reference) / reference * 100


def seed_gaps(results: Results, name: str) -> list[float] | None:
    """The setting's held-out gap to fp32 per seed (paired: same weights and data), or
    None when a run is missing."""
    ref = results.get(REFERENCE, {})
    gaps = []
    for seed, outcome in results[name].items():
        base = ref.get(seed)
        if outcome.curves is None or base is None or base.curves is None:
            return None
        gaps.append(gap_pct(final_heldout(outcome.curves), final_heldout(base.curves)))
    return gaps


def table(args: argparse.Namespace, results: Results) -> str:
    """The markdown report: how it was made, then one row per setting."""
    header = ("| setting | final held-out loss (mean) | gap to fp32 per seed | mean gap | target | meets "
              "| step (ms) | time (s) |")
    lines = ["# Quantized communication: convergence against full precision", "", describe(args), "", header,
             "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
    lines += [_row(results, name) for name in results]
    spread = _seed_spread(results)
    if spread:
        lines += ["", spread]
    return "\n".join(lines) + "\n"


def _seed_spread(results: Results) -> str:
    """How much fp32's own final loss moves with the seed: the scale a gap is read against."""
    finals = [final_heldout(o.curves) for o in results.get(REFERENCE, {}).values() if o.curves is not None]
    if len(finals) < 2:
        return ""
    mean = sum(finals) / len(finals)
    return (f"fp32's final held-out loss over the seeds: {min(finals):.4f} to {max(finals):.4f} "
            f"(a spread of {(max(finals) - min(finals)) / mean * 100:.2f}% of the mean).")


def describe(args: argparse.Namespace) -> str:
    command = shlex.join(["python", "tools/quant_convergence.py", *args.command])
    extra = f", {args.extra}" if args.extra else ""
    return (
        f"`{command}`: the example's model (dim {args.dim}, {args.layers} layers, {args.heads} heads) on "
        f"`--data text` at {args.ranks} gloo ranks, {args.steps} steps, seq {args.seq_len}, batch "
        f"{args.batch_size} per rank, lr {args.lr} ({args.lr_schedule}), seeds {args.seeds}{extra}; "
        f"held-out loss every {args.eval_every} steps on {args.eval_batches} batches per rank, the same "
        f"batches for every setting, evaluated through the same (quantized) forward. torch {torch.__version__}, "
        f"Python {platform.python_version()} (its standard library is the corpus). A gap is the setting's final "
        "held-out loss against fp32's of the same seed; one-sided: a lower loss always meets the target."
    )


def _row(results: Results, name: str) -> str:
    target = SETTINGS[name].target_pct
    target_text = "reference" if target is None else f"within {target:g}%"
    runs = results[name]
    failed = [o.error for o in runs.values() if o.curves is None]
    if failed:
        return f"| {name} | - | - | - | {target_text} | failed: {failed[0].replace('|', '/')} | - | - |"
    curves = [o.curves for o in runs.values() if o.curves is not None]
    final = sum(final_heldout(c) for c in curves) / len(curves)
    step_ms = sorted(c.step_ms for c in curves)[len(curves) // 2]
    seconds = sum(c.seconds for c in curves)
    gaps = seed_gaps(results, name)
    if target is None or gaps is None:
        per_seed, mean, meets = "-", ("0.00%" if target is None else "-"), "-"
    else:
        per_seed = ", ".join(f"{g:+.2f}%" for g in gaps)
        mean_gap = sum(gaps) / len(gaps)
        mean, meets = f"{mean_gap:+.2f}%", ("yes" if mean_gap <= target else "**no**")
    return f"| {name} | {final:.4f} | {per_seed} | {mean} | {target_text} | {meets} | {step_ms:.0f} | {seconds:.0f} |"


def final_heldout(curves: Curves) -> float:
    return curves.heldout[max(curves.heldout)]


def moving_mean(values: list[float], n: int) -> list[float]:
    """Each value's mean with the up to ``n - 1`` before it."""
    return [sum(values[max(0, i - n + 1):i + 1]) / (i + 1 - max(0, i - n + 1)) for i in range(len(values))]


def mean_curve(curves: list[dict[int, float]]) -> dict[int, float]:
    """The mean over runs at the steps every run has."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return {s: sum(c[s] for c in curves) / len(curves) for s in steps}


def plot(results: Results, path: str) -> None:
    """Train loss (a 10-step moving mean) and held-out loss against the step, each the mean
    over the seeds."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in results.items():
        curves = [o.curves for o in runs.values() if o.curves is not None]
        if not curves:
            continue
        train, heldout = mean_curve([c.train for c in curves]), mean_curve([c.heldout for c in curves])
        left.plot(list(train), moving_mean(list(train.values()), 10), label=name, linewidth=1)
        right.plot(list(heldout), list(heldout.values()), marker="o", markersize=3, label=name, linewidth=1)
    seeds = len(next(iter(results.values())))
    left.set(title=f"train loss (10-step mean, mean of {seeds} seeds)", xlabel="step", ylabel="loss")
    right.set(title=f"held-out loss (mean of {seeds} seeds)", xlabel="step", ylabel="loss")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(args: argparse.Namespace, results: Results) -> None:
    for path in (args.md, args.png, args.json):
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(args.md, "w") as f:
        f.write(table(args, results))
    if args.png:
        plot(results, args.png)
    if args.json:
        with open(args.json, "w") as f:
            curves = {
                n: {seed: o.curves._asdict() if o.curves else {"error": o.error} for seed, o in runs.items()}
                for n, runs in results.items()
            }
            json.dump(curves, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: Results = {}
    for name in args.settings:
        for seed in args.seeds:
            print(f"{name} seed {seed}: {' '.join(example_argv(args, SETTINGS[name], seed))}", flush=True)
            results.setdefault(name, {})[seed] = outcome = run_setting(args, name, seed)
            if outcome.curves is None:
                print(f"  failed: {outcome.error}", flush=True)
                continue
            curves = outcome.curves
            print(f"  {curves.seconds:.0f} s ({curves.step_ms:.0f} ms a step), final held-out loss "
                  f"{final_heldout(curves):.4f}", flush=True)
    write_outputs(args, results)
    print(table(args, results), end="")
    print(f"wrote {', '.join(p for p in (args.md, args.png, args.json) if p)}", flush=True)
    return 0 if all(o.curves is not None for runs in results.values() for o in runs.values()) else 1


if __name__ == "__main__":  # the ranks start from a fork server that imports this file again
    sys.exit(main())
