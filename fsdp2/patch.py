"""Run code written for torch's ``fully_shard`` on fsdp2, unchanged: the launcher.

    python -m fsdp2.patch train.py --its --args          # like: python train.py --its --args
    python -m fsdp2.patch -m package.module --args       # like: python -m package.module --args
    torchrun --nproc-per-node 8 -m fsdp2.patch train.py  # each rank runs it patched

or in-process, before the code that shards a model::

    import fsdp2.patch
    fsdp2.patch.apply()                  # idempotent; fsdp2.patch.undo() restores torch's
    with fsdp2.patch.applied(): ...      # undone on exit (unless it was applied before)

While applied, torch's ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``,
``OffloadPolicy``, ``CPUOffloadPolicy``, ``UnshardHandle``, ``register_fsdp_forward_method``,
``share_comm_ctx``, ``DataParallelMeshDims``, ``GradientReductionHandle`` (torch 2.15) and
``torch.distributed.pipelining.PipelineStage`` (before torch 2.15; on 2.15 torch's own stage
and schedules get fsdp2's ``FSDPModule`` instead, see ``PIPELINE_MODULES``)
are fsdp2's (``fsdp2.pipelining.PipelineStage`` for the stage), wherever a module bound
them: torch's namespaces (``torch.distributed.fsdp``, ``torch.distributed.pipelining``, the
deprecated ``torch.distributed._composable.fsdp``, ...) and every module imported before
(``from torch.distributed.fsdp import fully_shard`` in accelerate, transformers,
torchtitan, the script). ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` then holds for
fsdp2's modules.

torch's own implementation keeps torch's objects: a ``torch.*`` module whose own functions
read a name keeps it (``_fully_shard._fully_shard``, ``pipelining.stage``'s and
``pipelining.schedules``' internals). So a module torch's ``fully_shard`` sharded before
``apply`` still trains (though it is no longer an instance of the rebound ``FSDPModule``:
apply before sharding), and torch's pipeline code treats fsdp2's modules as plain modules,
which ``fsdp2.pipelining.PipelineStage`` relies on. A stage built another way (a subclass of
torch's ``_PipelineStageBase``, ``build_stage``) still needs ``fsdp2.pipelining.adapt_stage``.

``undo()`` puts back every binding ``apply`` changed, and torch's own in torch's modules
imported while applied; other modules imported while applied keep the fsdp2 objects they
imported. This is the one module of fsdp2 that imports torch's FSDP
modules, and only to rebind their names.
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

from ._compat import stage_drives_fsdp_publicly

__all__ = ["Patch", "applied", "apply", "is_applied", "main", "undo"]

# torch's public fully_shard names (2.13's, and 2.15's GradientReductionHandle), rebound
# where the installed torch has them.
FSDP_NAMES = (
    "fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
    "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx", "DataParallelMeshDims",
    "GradientReductionHandle",
)
# torch 2.15's pipelining drives FSDP modules through public methods only: there torch's
# own stage and schedules are given fsdp2's names too, and drive fsdp2's modules
# (``_compat.stage_drives_fsdp_publicly``). Before 2.15 they reach into torch's FSDP
# internals: they keep torch's names, and torch's PipelineStage becomes fsdp2's.
PIPELINE_MODULES = ("torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules")
PIPELINE_NAMES = ("FSDPModule", "UnshardHandle", "GradientReductionHandle")
USAGE = "usage: python -m fsdp2.patch SCRIPT [ARGS...] | python -m fsdp2.patch -m MODULE [ARGS...]"


class Patch:
    """The bindings one ``apply`` changed: ``(module, name, torch's object)`` each."""

    def __init__(self, swaps: dict[int, tuple[Any, Any]]) -> None:
        self.swaps = swaps  # id(torch's object) -> (torch's object, fsdp2's)
        self.bound: list[tuple[types.ModuleType, str, Any]] = []
        self.modules_before = set(sys.modules)
        self.is_active = True

    def rebind(self) -> list[str]:
        """Rebind every module attribute that is one of torch's objects; returns the modules changed."""
        changed: list[str] = []
        for name, module in list(sys.modules.items()):
            names = _bindings(module, name, self.swaps)
            for attr, theirs in names:
                setattr(module, attr, self.swaps[id(theirs)][1])
                self.bound.append((module, attr, theirs))
            if names:
                changed.append(name)
        return changed

    def undo(self) -> None:
        """Put torch's objects back where ``apply`` replaced them (a no-op the second time)."""
        global _ACTIVE
        ours_of = {id(t): o for t, o in self.swaps.values()}
        for module, attr, theirs in reversed(self.bound):
            if getattr(module, attr, None) is ours_of[id(theirs)]:  # not rebound by someone since
                setattr(module, attr, theirs)
        self.bound.clear()
        ours = {id(o): t for t, o in self.swaps.values()}
        for name in set(sys.modules) - self.modules_before:  # torch modules imported while applied
            module = sys.modules.get(name)
            if isinstance(module, types.ModuleType) and (name == "torch" or name.startswith("torch.")):
                for attr, value in list(vars(module).items()):
                    if id(value) in ours:
                        setattr(module, attr, ours[id(value)])
        self.is_active = False
        if _ACTIVE is self:
            _ACTIVE = None


# process-wide: torch's module attributes are process-wide, so is the patch of them.
_ACTIVE: Patch | None = None
_LOCK = threading.Lock()
_OPEN = 0  # ``applied()`` blocks open now
_OWNED = False  # the open blocks applied the patch (it was not applied before them)


def apply() -> Patch:
    """Make torch's fully_shard names resolve to fsdp2's (see the module doc). Idempotent:
    applied again, it rebinds what modules imported since then bound, and returns the
    same ``Patch``. Rank 0 (``RANK`` unset or 0) says once on stderr what it replaced."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.rebind()
        return _ACTIVE
    patch = Patch(_swaps())
    _ACTIVE = patch  # before rebinding: undo() reaches whatever a failing rebind changed
    try:
        changed = patch.rebind()
    except BaseException:
        patch.undo()
        raise
    if os.environ.get("RANK", "0") == "0":
        _announce(patch, changed)
    return patch


def undo() -> None:
    """Restore torch's names (a no-op when not applied)."""
    if _ACTIVE is not None:
        _ACTIVE.undo()


def is_applied() -> bool:
    return _ACTIVE is not None


@contextlib.contextmanager
def applied() -> Iterator[Patch]:
    """``apply()`` for a ``with`` block: undone when the last open block exits (blocks
    nest, also across threads, e.g. one rank per thread), unless it was applied before."""
    global _OPEN, _OWNED
    with _LOCK:
        if _OPEN == 0:
            _OWNED = _ACTIVE is None
        patch = apply()
        _OPEN += 1
    try:
        yield patch
    finally:
        with _LOCK:
            _OPEN -= 1
            if _OPEN == 0 and _OWNED:
                patch.undo()


def _swaps() -> dict[int, tuple[Any, Any]]:
    import torch.distributed.fsdp as theirs  # rebind only
    import torch.distributed.pipelining as torch_pipelining

    import fsdp2
    from fsdp2 import pipelining  # imported before the rebind: it subclasses torch's stage

    pairs = [(getattr(theirs, n), getattr(fsdp2, n)) for n in FSDP_NAMES if hasattr(theirs, n)]
    if not stage_drives_fsdp_publicly():
        pairs.append((torch_pipelining.PipelineStage, pipelining.PipelineStage))
    return {id(t): (t, o) for t, o in pairs}


def _bindings(module: Any, name: str, swaps: dict[int, tuple[Any, Any]]) -> list[tuple[str, Any]]:
    """``(attribute, torch's object)`` of ``module`` to rebind: none in fsdp2 itself, and
    in torch's modules none that the module's own code reads (torch's implementation)."""
    if name == "fsdp2" or name.startswith("fsdp2.") or not isinstance(module, types.ModuleType):
        return []
    try:
        found = [(k, v) for k, v in vars(module).items() if id(v) in swaps and swaps[id(v)][0] is v]
    except Exception:  # noqa: BLE001 - a lazy or proxy module that refuses vars()
        return []
    if found and (name == "torch" or name.startswith("torch.")):
        if not _public_torch(name):
            return []  # torch's private modules stay torch's (dynamo's guards read them by path)
        read = _names_read(module)
        if name in PIPELINE_MODULES and stage_drives_fsdp_publicly():
            read -= set(PIPELINE_NAMES)
        found = [(k, v) for k, v in found if k not in read]
    return found


# Private paths torch documents for these names (deprecated, still imported by clients).
PRIVATE_PUBLIC = ("torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")


def _public_torch(name: str) -> bool:
    return name in PRIVATE_PUBLIC or not any(part.startswith("_") for part in name.split("."))


def _names_read(module: types.ModuleType) -> set[str]:
    """Every global or attribute name loaded by code written in ``module``'s file (a
    superset of the globals it reads: a name kept by mistake only keeps torch's). Code is
    told by its file, not ``__module__``: torch sets that to the public namespace."""
    names: set[str] = set()
    path = getattr(module, "__file__", None)
    todo: list[Any] = list(vars(module).values())
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.CodeType):
            if obj.co_filename == path:
                names.update(obj.co_names)
                # ``globals()["fully_shard"]`` and ``getattr(mod, "fully_shard")`` read by string.
                names.update(c for c in obj.co_consts if isinstance(c, str) and c.isidentifier())
                todo.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, types.FunctionType):
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            todo.extend([obj.__code__, getattr(obj, "__wrapped__", None), *cells])
        elif isinstance(obj, (staticmethod, classmethod, types.MethodType)):
            todo.append(obj.__func__)
        elif isinstance(obj, (functools.partial, functools.cached_property)):
            todo.append(obj.func)
        elif isinstance(obj, functools._lru_cache_wrapper):
            todo.append(obj.__wrapped__)
        elif isinstance(obj, property):
            todo.extend((obj.fget, obj.fset, obj.fdel))
        elif isinstance(obj, type) and str(getattr(obj, "__module__", "")).startswith("torch"):
            todo.extend(vars(obj).values())
    return names


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _announce(patch: Patch, changed: list[str]) -> None:
    names = sorted({getattr(t, "__name__", "?") for t, _ in patch.swaps.values()})
    shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    print(
        f"fsdp2.patch: torch's {', '.join(names)} now resolve to fsdp2's "
        f"({len(patch.bound)} bindings in {len(changed)} modules: {shown}); "
        "torch's own implementation keeps torch's",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m fsdp2.patch SCRIPT ARGS`` / ``-m MODULE ARGS``: apply, then run it as
    ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python`` would set them."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        raise SystemExit(0 if args else 2)
    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit(f"fsdp2.patch: -m expects a module name after it, got nothing\n{USAGE}")
        apply()
        sys.argv = args[1:]  # argv[0] becomes the module's file, as under python -m
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    if args[0].startswith("-"):
        raise SystemExit(f"fsdp2.patch: unknown option {args[0]!r}; expected a script path or -m MODULE\n{USAGE}")
    if not os.path.exists(args[0]):
        raise SystemExit(f"fsdp2.patch: no script at {args[0]!r} (cwd {os.getcwd()})\n{USAGE}")
    apply()  # fsdp2 imported while sys.path still holds the launcher's entries
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    # The state lives in the module ``import fsdp2.patch`` gives, not in this __main__ copy.
    from fsdp2.patch import main as _main

    _main()
