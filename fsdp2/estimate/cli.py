"""How much memory one rank of a large job needs, measured on this CPU.

    python -m fsdp2.estimate --nproc-per-node 8 --nnodes 128 -- examples/train.py --tp 8 --meta-init
    python -m fsdp2.estimate --nproc-per-node 8 --nnodes 128 --compare "--ac full" --compare "--bf16" \\
        -- examples/train.py --tp 8 --meta-init

runs a torchrun script as rank ``--rank`` (default 0) of a job of ``nproc-per-node x
nnodes`` ranks, in this process: ``init_process_group`` starts torch's fake process group
(collectives cost nothing and move no data), so the script builds only this rank's
shards, gathers one group at a time and computes on its real local batch, and the
tensors it allocates are the ones that rank of the real job allocates (fsdp2 takes the
accelerator's path, as under NCCL). It stops after ``--steps`` training steps (steps of
the first optimizer; default 2, so the optimizer state exists) and reports the peak of
live tensor bytes on the rank, split by category at that moment (``fsdp2.memory.tracker``),
with the phase and module of the peak, per step. ``--json`` prints the report as JSON;
``--compare ARGS`` (repeatable) runs the script again with ``ARGS`` appended and prints
the peaks side by side.

Scripts need no change beyond what torchrun scripts do: the torchrun environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...) is set, and the script's
``init_process_group`` (any backend) gets the fake one. It runs on the CPU, so a script
must fall back to the CPU when CUDA is absent. An all-to-all (Mixture-of-Experts token
dispatch) delivers from every peer what this rank sends to itself: routing as balanced
as this rank's own. What cannot work this way (object collectives such as a
checkpoint's, other data from other ranks) stops the run with the script's error and a
note.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
from typing import Any

from ..memory.tracker import CATEGORIES
from .fake import fake_distributed
from .session import Session, mib


def estimate(script: str, args: list[str], world: int, rank: int, local_world: int, steps: int,
             progress: bool = True) -> dict[str, Any]:
    """Run ``script`` as ``rank`` of ``world`` and return the report (see ``main``)."""
    if not 0 <= rank < world:
        raise ValueError(f"fsdp2.estimate: --rank must be in [0, {world}), got {rank}")
    if steps < 1:
        raise ValueError(f"fsdp2.estimate: --steps must be at least 1, got {steps}")
    session = Session(steps, progress)
    undo = fake_distributed(rank, world, local_world)
    session._note(f"running {script} as rank {rank} of {world} on the fake process group")
    error = None
    try:
        session.run(script, args)
    except SystemExit as e:
        error = f"the script exited with {e.code}"
    except Exception as e:  # noqa: BLE001 (reported, with why it may not run here)
        error = f"{type(e).__name__}: {e}"
    finally:
        undo()
    if error is not None and not session.per_step:
        raise RuntimeError(
            f"fsdp2.estimate: {script} stopped before completing a training step ({error}). Under the "
            "estimate the script runs on the CPU, on a fake process group whose collectives move no data; "
            "scripts that need CUDA, object collectives (checkpoint save/load, all_gather_object) or data "
            "from other ranks cannot run this way: switch those parts off with the script's flags"
        )
    return session.report(script, args, world, rank, error)


def format_report(report: dict[str, Any]) -> str:
    peak = report["peak"]
    lines = [f"rank {report['rank']} of {report['world_size']}: {' '.join(report['script'])}"]
    if peak is None:
        return lines[0] + "\n  (no training step completed)"
    lines.append(f"peak live tensors: {mib(peak['peak'])} in step {peak['step']}, "
                 f"{peak['phase']}{', ' + peak['module'] if peak['module'] else ''}")
    for c in CATEGORIES:
        share = peak["split"][c] / peak["peak"] if peak["peak"] else 0.0
        lines.append(f"  {c:22s} {mib(peak['split'][c]):>14s}  {share:6.1%}")
    if peak.get("device"):
        dev = peak["device"]
        lines.append(f"  CUDA allocator then: allocated {mib(dev['allocated'])}, reserved {mib(dev['reserved'])} "
                     f"(the caching allocator holds {mib(dev['reserved'] - dev['allocated'])} more)")
    lines.append("per step: " + ", ".join(f"{s['step']}: {mib(s['peak'])} ({s['phase']})" for s in report["steps"]))
    if report.get("note"):
        lines.append(f"note: the script stopped early: {report['note']}")
    return "\n".join(lines)


def _compare(ns: argparse.Namespace, script: str, args: list[str]) -> int:
    variants: list[tuple[str, list[str]]] = [("(as given)", [])] + [(v, shlex.split(v)) for v in ns.compare]
    reports = []
    for label, extra in variants:
        cmd = [sys.executable, "-m", "fsdp2.estimate", "--nproc-per-node", str(ns.nproc_per_node),
               "--nnodes", str(ns.nnodes), "--rank", str(ns.rank), "--steps", str(ns.steps), "--json",
               "--", script, *args, *extra]
        print(f"[fsdp2.estimate] {label}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, text=True)
        if done.returncode != 0:
            print(f"fsdp2.estimate: the variant {label!r} failed (its error is above)", file=sys.stderr)
            return done.returncode
        reports.append((label, json.loads(done.stdout.strip().splitlines()[-1])))
    if ns.json:
        print(json.dumps({label: r for label, r in reports}))
        return 0
    width = max(len(label) for label, _ in reports)
    short = ("sharded", "gathered", "grads", "optimizer", "comm", "activations", "other")
    print(f"{'variant':{width}s}  {'peak':>14s}  " + "  ".join(f"{c:>11s}" for c in short))
    for label, r in reports:
        p = r["peak"]
        cells = "  ".join(f"{p['split'][c] / 2**20:11,.1f}" for c in CATEGORIES)
        print(f"{label:{width}s}  {mib(p['peak']):>14s}  {cells}")
    print("(MiB, at each variant's peak: sharded and gathered parameters, gradients, optimizer state, "
          "communication buffers, activations, other)")
    return 0


def _measure(ns: argparse.Namespace, script: str, args: list[str]) -> int:
    """The same tracking in a real run (each rank tracks; ``--rank`` reports)."""
    rank = int(os.environ.get("RANK", "0"))
    session = Session(ns.steps, progress=rank == ns.rank)
    baseline = _rss()
    session.run(script, args)
    if rank == ns.rank:
        report = session.report(script, args, int(os.environ.get("WORLD_SIZE", "1")), rank, None)
        # The process's peak resident memory above what it held before the script (Linux).
        report["rss"] = {"baseline": baseline, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        print(json.dumps(report) if ns.json else format_report(report), flush=True)
    return 0


def _rss() -> int:
    """Resident bytes of this process now (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def parse_command(argv: list[str]) -> tuple[argparse.Namespace, str, list[str]]:
    """The estimator's options, the script and its arguments (argparse errors exit 2)."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m fsdp2.estimate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="the rank to run (default 0)")
    p.add_argument("--steps", type=int, default=2, help="training steps to run (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as one line of JSON")
    p.add_argument("--compare", action="append", default=[], metavar="ARGS",
                   help="also run with these script arguments appended (repeatable)")
    p.add_argument("--measure", action="store_true",
                   help="no fake process group: track a real run (under torchrun: "
                        "torchrun ... -m fsdp2.estimate --measure -- script.py); rank --rank reports")
    head = argv[:split]
    # ``--compare "--ac full"``: a value that starts with "-", which argparse takes for a flag.
    head = [f"--compare={head[i + 1]}" if a == "--compare" and i + 1 < len(head) else a
            for i, a in enumerate(head) if i == 0 or head[i - 1] != "--compare"]
    ns = p.parse_args(head)
    if ns.steps < 1:
        p.error(f"--steps must be at least 1, got {ns.steps}")
    rest = argv[split + 1 :]
    if not rest:
        p.error("name the script after --: python -m fsdp2.estimate [options] -- script.py [script args]")
    return ns, rest[0], rest[1:]


def main(argv: list[str] | None = None) -> int:
    ns, script, args = parse_command(sys.argv[1:] if argv is None else argv)
    if ns.measure:
        return _measure(ns, script, args)
    if ns.compare:
        return _compare(ns, script, args)
    report = estimate(script, args, ns.nproc_per_node * ns.nnodes, ns.rank, ns.nproc_per_node, ns.steps,
                      progress=True)
    sys.stdout.flush()
    print(json.dumps(report) if ns.json else format_report(report), flush=True)
    return 0
