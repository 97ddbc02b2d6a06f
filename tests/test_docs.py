"""The commands the README and ``docs/`` show cannot rot: every command in a ```bash
block is checked here. The install and test commands are the CI script's (``.ci/run``
runs them); ``torchrun ... examples/train.py`` lines have their torchrun and script
arguments parsed (the training itself is ``tests/test_train_example.py``'s);
``python -m fsdp2.estimate`` lines are parsed (``tests/test_estimate.py`` runs it); tool
commands are parsed or run (the ``python tools/...`` ones that run: all in one interpreter).
A command of any other kind fails: check it here."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Any
from unittest import mock

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# The CI script's own steps (``.ci/run``): creating the environment, installing, testing.
CI_STEPS = ("python3 -m venv", ". .venv/bin/activate", "pip install", "python -m pytest")
# Values for the shell variables the multi-node commands use.
SAMPLE_ENV = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def commands(page: pathlib.Path) -> list[str]:
    """The shell commands of ``page``'s bash blocks: continuation lines joined, comments
    dropped, ``&&`` chains split."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.extend(part.strip() for part in line.split("&&"))
    return out


def _load(path: pathlib.Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(path.parent))
    return module


@functools.cache
def _train() -> Any:
    """examples/train.py, loaded once (its ``parse_args`` reads only its arguments and
    ``WORLD_SIZE``)."""
    return _load(ROOT / "examples" / "train.py", "docs_train")


def _check_train_args(args: list[str], world: int) -> argparse.Namespace:
    train = _train()
    with mock.patch.object(sys, "argv", ["train.py", *args]), mock.patch.dict(os.environ, WORLD_SIZE=str(world)):
        return train.parse_args()


# Options that size a run or name its files: the rest (parallelism, checkpointing,
# compile, precision, optimizer, ...) make the configuration a test has to have run.
_SIZES = {"steps", "batch_size", "seq_len", "dim", "layers", "heads", "vocab", "lr", "seed", "microbatches",
          "final_params", "save_every"}
# Documented configurations tests/test_train_example.py does not run, and the test that
# trains that composition instead (at float64 parity with one local model).
COVERED_ELSEWHERE = {frozenset({("hsdp", 2)}): "tests/test_nd_meshes.py"}


@functools.cache
def _defaults() -> dict[str, Any]:
    return vars(_check_train_args([], 1))


@functools.cache
def _tested() -> frozenset:
    import test_train_example

    return frozenset((_configuration(flags, 4), r) for flags, r in test_train_example.tested_flag_sets())


def _configuration(args: list[str], world: int) -> frozenset:
    defaults = _defaults()
    given = vars(_check_train_args(args, world))
    return frozenset((k, v if k != "ckpt_dir" else "set") for k, v in given.items()
                     if k not in _SIZES and v != defaults[k])


def _check_train_run(args: list[str], world: int, restarted: bool) -> None:
    """A documented run of the example: its flags parse at its world size, and some test
    runs its configuration (tests/test_train_example.py, or COVERED_ELSEWHERE)."""
    config = _configuration(args, world)
    if (config, restarted) in _tested():
        return
    elsewhere = COVERED_ELSEWHERE.get(config)
    assert elsewhere is not None and not restarted and (ROOT / elsewhere).exists(), (
        f"the documented example run {args} (restarted: {restarted}) is a configuration no test runs: "
        f"{sorted(config)}; document one of tests/test_train_example.py's or add it there"
    )


def _check_rl_loop(args: list[str], world: int) -> str:
    """examples/rl_loop.py: its flags parse, and tests/test_rl_loop.py runs it at this
    world size with this library (2 ranks: both, 4 ranks: fsdp2)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import rl_loop

    ns = rl_loop.parse_args(args)
    assert world in (2, 4) and (world == 2 or ns.impl == "fsdp2"), (
        f"examples/rl_loop.py {args} at {world} ranks: tests/test_rl_loop.py runs 2 ranks (both libraries) "
        "and 4 (fsdp2); document one of those"
    )
    return "run by tests/test_rl_loop.py"


def _world(nproc: Any, nnodes: Any) -> int:
    return int(str(nproc)) * int(str(nnodes).split(":")[-1])


def _check_launcher(args: list[str], cmd: str) -> str:
    """``fsdp2.patch`` runs: the script tests/test_patch.py launches, as it launches it."""
    assert args == ["tests/_patch_script.py", "--steps", "2"], (
        f"a documented fsdp2.patch run no test makes: {cmd!r}; document tests/test_patch.py's"
    )
    return "run by tests/test_patch.py"


def _words(cmd: str) -> list[str]:
    return shlex.split(re.sub(r"\$([A-Z_]+)", lambda m: SAMPLE_ENV[m.group(1)], cmd))


def _tool_command(words: list[str]) -> tuple[str, ...] | None:
    """The tool run ``check`` makes of a documented ``python tools/...`` command, if it
    runs one: the GPU tools as written, without CUDA (they say so and exit 0), and a
    small instance of bench_deposit.py on the CPU."""
    if words[:2] in (["python", "tools/gpu_check.py"], ["python", "tools/gpu_memory.py"]) and "--cpu" not in words:
        return tuple(words[1:])
    if words[:2] == ["python", "tools/bench_deposit.py"]:
        return (*words[1:], "--dim", "64", "--device", "cpu")
    return None


@functools.cache
def _tool_runs() -> dict[tuple[str, ...], tuple[int, str, str]]:
    """The documented tool runs, all in one interpreter without CUDA (tests/test_gpu_check.py's
    ``run_tools``: one import of torch, not one per command): command -> (exit status,
    output, error output)."""
    from test_gpu_check import run_tools

    tools = (_tool_command(_words(cmd)) for _, cmd in ALL if cmd.startswith("python tools/"))
    runs = list(dict.fromkeys(c for c in tools if c is not None))
    return dict(zip(runs, run_tools([list(c) for c in runs], {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)))


def _tool_run(command: tuple[str, ...]) -> tuple[int, str, str]:
    from test_gpu_check import run_tools

    if command in _tool_runs():
        return _tool_runs()[command]
    return run_tools([list(command)], {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)[0]  # not a documented one


def check(cmd: str) -> str:
    """Check one command; returns how (for the failure message)."""
    if cmd.startswith(CI_STEPS):
        return "ci"
    words = _words(cmd)
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(words[1:])
        if parsed.module and parsed.training_script == "fsdp2.patch":
            return _check_launcher(parsed.training_script_args, cmd)
        if parsed.module and parsed.training_script == "fsdp2.estimate":
            return check(" ".join(["python", "-m", "fsdp2.estimate", *map(shlex.quote, parsed.training_script_args)]))
        world = _world(parsed.nproc_per_node, parsed.nnodes)
        if parsed.training_script == "examples/rl_loop.py":
            return _check_rl_loop(parsed.training_script_args, world)
        assert parsed.training_script == "examples/train.py", cmd
        _check_train_run(parsed.training_script_args, world, int(parsed.max_restarts) > 0)
        return "run by a test"
    if words[:3] == ["python", "-m", "fsdp2.patch"]:
        return _check_launcher(words[3:], cmd)
    if words[:3] == ["python", "-m", "fsdp2.estimate"]:
        from fsdp2.estimate import parse_command

        ns, script, args = parse_command(words[3:])
        if script.endswith("train.py"):
            world = ns.nproc_per_node * ns.nnodes
            _check_train_args(args, world)
            for extra in ns.compare:
                _check_train_args([*args, *shlex.split(extra)], world)
        return "parsed"
    if words[:2] == ["python", "tools/bench.py"]:
        bench = _load(ROOT / "tools" / "bench.py", "docs_bench")
        with mock.patch.object(sys, "argv", words[1:]), mock.patch.object(bench, "bench_speed"), \
                mock.patch.object(bench, "bench_memory"), mock.patch.object(bench, "bench_optim"), \
                mock.patch.object(bench, "bench_host"), mock.patch.object(bench, "bench_estimate"), \
                mock.patch.object(bench, "bench_moe"), mock.patch.object(bench, "bench_quant"):
            bench.main()
        return "parsed"
    command = _tool_command(words)
    if command is not None:  # the GPU tools without CUDA, a small bench_deposit.py
        rc, out, err = _tool_run(command)
        assert rc == 0 and "WRONG" not in out, out + err
        return "ran"
    if words[:2] == ["python", "tools/quant_convergence.py"]:  # minutes of training: its flags parsed
        # (without the plot, whose matplotlib the test environment need not have)
        _load(ROOT / "tools" / "quant_convergence.py", "docs_quant_convergence").parse_args([*words[2:], "--png", ""])
        return "parsed"
    if words[:2] == ["bash", "tools/gpu_session.sh"]:  # no step chosen: its header runs
        with tempfile.TemporaryDirectory() as out:
            done = subprocess.run(["bash", "tools/gpu_session.sh", out], check=False, capture_output=True, text=True,
                                  cwd=ROOT, env=dict(os.environ, ONLY="none", PYTHON=sys.executable,
                                                     CUDA_VISIBLE_DEVICES=""), timeout=120)
        assert done.returncode == 0 and "torch" in done.stdout, done.stdout + done.stderr
        return "ran"
    raise AssertionError(f"a documented command no test checks: {cmd!r} (add it to tests/test_docs.py)")


ALL = [(page, cmd) for page in PAGES for cmd in commands(page)]


@pytest.mark.parametrize("page,cmd", ALL, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(ALL)])
def test_documented_command_is_checked(page: pathlib.Path, cmd: str) -> None:
    check(cmd)


def test_pages_have_commands_and_a_wrong_flag_fails() -> None:
    assert len(ALL) >= 10, ALL
    with pytest.raises(SystemExit):
        check("torchrun --standalone --nproc-per-node 2 examples/train.py --no-such-flag")
    with pytest.raises(AssertionError, match="no test checks"):
        check("rm -rf build")
    with pytest.raises(AssertionError, match="no test runs"):  # parses, but no test trains it
        check("torchrun --standalone --nproc-per-node 2 examples/train.py --bf16 --ac full")


def test_relative_links_resolve() -> None:
    """Every relative link of the README and docs points at a file that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), (page.name, target)
