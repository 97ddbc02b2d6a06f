"""The package keeps its shape: no import circle inside ``fsdp2/`` (``TYPE_CHECKING`` and
function-level imports count: a two-way dependency goes through an argument or a small
Protocol, see CONTRIBUTING.md), no module-level mutable registry without a comment
saying why it must be process-wide (``# process-wide: ...`` right above it), and no import
of torch's FSDP (``torch.distributed.fsdp``, ``torch.distributed._composable.fsdp``)
outside ``fsdp2/patch.py``, where each such line ends ``# rebind only``: fsdp2 is written
on torch's public pieces, not its FSDP."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fsdp2"
MUTABLE_CALLS = {
    "dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet",
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # ``from . import optim``
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    # A package's __init__ runs when any of its modules is imported: not an edge back.
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles() -> None:
    graph = _graph()
    assert "fsdp2.bucket.bucket" in graph and graph["fsdp2.bucket.bucket"], "the import graph was not read"
    assert _cycles(graph) == []


def test_the_circle_check_can_fail() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The layers, bottom first (CONTRIBUTING.md's table): a module imports only from its own
# layer or those below. The face's helpers and the public modules sit at the root.
LAYERS = [
    ["fsdp2._compat"],
    ["fsdp2.api"],
    ["fsdp2.comm"],
    ["fsdp2.params"],
    ["fsdp2.bucket", "fsdp2.optim"],
    ["fsdp2.runtime"],
    ["fsdp2._validate", "fsdp2._placement", "fsdp2._classes", "fsdp2._module",
     "fsdp2.fully_shard", "fsdp2.pipelining"],
    ["fsdp2.memory", "fsdp2.weights"],
    ["fsdp2.planning"],
    ["fsdp2"],
    ["fsdp2.estimate", "fsdp2.patch"],
]


def _layer_of(module: str) -> int:
    """The layer of the longest prefix of ``module`` named in ``LAYERS``."""
    best = (-1, -1)
    for i, names in enumerate(LAYERS):
        for name in names:
            if module == name or module.startswith(name + "."):
                best = max(best, (len(name), i))
    if best[1] < 0:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it there and to CONTRIBUTING.md")
    return best[1]


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in graph.items() for d in deps if _layer_of(d) > _layer_of(m))


def test_layers_import_downward_only() -> None:
    assert _upward(_graph()) == []


def test_the_layer_check_can_fail() -> None:
    assert _upward({"fsdp2.comm.mesh": {"fsdp2.bucket.gather", "fsdp2.api"}}) == [("fsdp2.comm.mesh", "fsdp2.bucket.gather")]


def test_each_folder_says_what_lives_there_and_the_map_names_it() -> None:
    """Each folder's ``__init__`` opens with a docstring, and CONTRIBUTING.md's layer
    table and docs/design.md's walk through a step name the same folders."""
    root = PACKAGE.parent
    contributing, design = (root / "CONTRIBUTING.md").read_text(), (root / "docs" / "design.md").read_text()
    folders = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    assert folders, "no folder found"
    for folder in folders:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        name = str(folder.relative_to(PACKAGE)) + "/"
        assert doc, f"fsdp2/{name}__init__.py has no docstring saying what lives there"
        assert f"`{name}`" in contributing, f"CONTRIBUTING.md's layer table does not name `{name}`"
        if folder.parent == PACKAGE:
            assert f"`{name}`" in design, f"docs/design.md does not name `{name}`"


def _registries(source: str) -> list[tuple[int, str, bool]]:
    """(line, name, justified) of each module-level mutable container."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
        if isinstance(value, ast.Call):
            func = value.func
            mutable = mutable or (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in MUTABLE_CALLS
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if not mutable or names == ["__all__"]:
            continue
        above = []  # the comment block right above
        i = node.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#"):
            above.append(lines[i])
            i -= 1
        out.append((node.lineno, ",".join(names), any("process-wide:" in c for c in above)))
    return out


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_level_registries_say_why(path: pathlib.Path) -> None:
    unjustified = [(line, name) for line, name, ok in _registries(path.read_text()) if not ok]
    assert unjustified == [], f"{path.name}: module-level mutable state without '# process-wide: why' above it"


def test_the_registry_check_can_fail() -> None:
    source = "A = {}\n# process-wide: one per process\nB: list = []\nC = (1, 2)\n__all__ = ['x']\n"
    assert _registries(source) == [(1, "A", False), (3, "B", True)]


TORCH_FSDP = re.compile(r"^torch\.distributed\.(fsdp|_composable\.fsdp)(\.|$)")


def _torch_fsdp_imports(relative: str, source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of torch's FSDP not allowed in ``relative``: anywhere
    but patch.py, and there without ``# rebind only`` at the end of the statement."""
    lines = source.splitlines()
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            modules = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        else:
            continue
        for module in modules:
            allowed = relative == "patch.py" and lines[node.end_lineno - 1].rstrip().endswith("# rebind only")
            if TORCH_FSDP.match(module) and not allowed:
                bad.append((node.lineno, module))
    return bad


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_torch_fsdp_imports(path: pathlib.Path) -> None:
    bad = _torch_fsdp_imports(str(path.relative_to(PACKAGE)), path.read_text())
    assert bad == [], f"{path.name} imports torch's FSDP (only fsdp2/patch.py may, '# rebind only'): {bad}"


def test_the_torch_fsdp_check_can_fail() -> None:
    source = (
        "import torch.distributed.fsdp as a  # rebind only\n"
        "from torch.distributed.fsdp._fully_shard import _fsdp_api\n"
        "from torch.distributed._composable.fsdp import (\n    fully_shard,\n)  # rebind only\n"
        "import importlib\nimportlib.import_module('torch.distributed.fsdp')\n"
        "import torch.distributed.fsdpx, torch.distributed.tensor\n"
    )
    assert _torch_fsdp_imports("patch.py", source) == [(2, "torch.distributed.fsdp._fully_shard"), (7, "torch.distributed.fsdp")]
    assert [line for line, _ in _torch_fsdp_imports("_state.py", source)] == [1, 2, 3, 7]
