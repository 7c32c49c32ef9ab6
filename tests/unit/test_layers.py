"""The package's layers import one way: tools -> frontends -> launcher -> runtime -> core, errors at the bottom.

Every import statement counts, the ones inside functions too: a lazy import back up is still a
cycle waiting to happen, and the reason the layering is worth having is that it can be read off
the folders.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = "megatron_perf_toggles"
ROOT = REPO / PACKAGE
# Lower rank = lower layer. The entry points at the top (the public face, ``python -m`` names and
# the name patched checkouts import) may import anything.
RANKS = {"_version": 0, "errors": 0, "core": 1, "runtime": 2, "launcher": 3, "frontends": 4, "tools": 5}
ENTRY_RANK = 6
# What may sit at the top of the package besides the layers: the public face and the names users
# (and patched checkouts) type. A new module here would be ranked as an entry point and could
# import anything, so it has to be added on purpose.
ENTRY_POINTS = {"__init__", "__main__", "hooks", "run", "bridge", "primus", "primus_hook"}  # + the config front ends
# The core decides; reading files, the environment, processes or the clock belongs to the runtime.
IO_MODULES = {"os", "sys", "subprocess", "socket", "shutil", "pathlib", "io", "tempfile", "importlib", "glob",
              "threading", "multiprocessing", "signal", "time", "urllib", "http", "platform", "ctypes"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rank(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package's own __init__
        return ENTRY_RANK
    return RANKS.get(parts[1], ENTRY_RANK)


def _for_checkers(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside ``if TYPE_CHECKING:`` blocks: only type checkers read them."""
    return {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
            and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for stmt in block.body for n in ast.walk(stmt)}


def _imports(path: Path, source: str | None = None, *, run_time_only: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of this package in ``path`` (or ``source``, as if
    it were that file); ``run_time_only`` leaves out those only type checkers read."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    skip = _for_checkers(tree) if run_time_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if module.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:  # ``from . import x`` imports the module x, if there is one
                sub = f"{module}.{alias.name}"
                is_module = (REPO / sub.replace(".", "/")).with_suffix(".py").is_file() or \
                    (REPO / sub.replace(".", "/") / "__init__.py").is_file()
                out.append((node.lineno, sub if is_module else module))
    return out


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_goes_up_a_layer(path: Path) -> None:
    here = _module_name(path)
    upward = [f"line {line}: {module}" for line, module in _imports(path) if _rank(module) > _rank(here)]
    assert not upward, f"{here} imports from a higher layer: {upward}"


@pytest.mark.parametrize("path", sorted((ROOT / "core").rglob("*.py")), ids=lambda p: p.name)
def test_core_imports_only_the_standard_library(path: Path) -> None:
    """The policy stays pure: no torch, Megatron or Transformer Engine, not even lazily."""
    allowed = (set(sys.stdlib_module_names) - IO_MODULES) | {PACKAGE}
    tree = ast.parse(path.read_text())
    # Only type checkers read an ``if TYPE_CHECKING:`` block; there the standard library's typing
    # backport may stand in for what typing has only on newer Pythons. Nothing else is allowed there.
    for_checkers = _for_checkers(tree)
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [n for n in names if not (id(node) in for_checkers and n == "typing_extensions")]
    assert {m.split(".")[0] for m in found} <= allowed, found


def test_the_package_top_holds_only_the_layers_and_the_entry_points() -> None:
    top = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert top == set(RANKS) | ENTRY_POINTS


def test_the_layering_test_sees_an_upward_import() -> None:
    """A test that cannot fail proves nothing: upward imports in a core module are caught, the
    package's ``__init__`` (``from .. import __version__``) included."""
    probe = ROOT / "core" / "registry.py"
    source = "def f():\n    from ..runtime import provider\n    from .. import __version__\n"
    found = [(m, _rank(m)) for _, m in _imports(probe, source)]
    assert found == [(f"{PACKAGE}.runtime.provider", 2), (PACKAGE, ENTRY_RANK)]
    assert all(rank > _rank(_module_name(probe)) for _, rank in found)


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle in ``graph`` (module -> modules it imports), as a path that ends where it
    began; empty where there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def _import_graph() -> dict[str, set[str]]:
    """Every module of the package and what it imports when it runs, function-level (lazy) imports
    included: a lazy import only delays a cycle. Imports only type checkers read are left out."""
    return {_module_name(p): {m for _, m in _imports(p, run_time_only=True)} - {_module_name(p)} for p in MODULES}


def test_no_import_cycle_inside_or_between_wings() -> None:
    cycle = _cycle(_import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_test_sees_a_lazy_cycle() -> None:
    graph = _import_graph()
    a, b = f"{PACKAGE}.runtime.machine.target", f"{PACKAGE}.runtime.machine.capabilities"
    probe = ROOT / "runtime" / "machine" / "target.py"
    lazy = {m for _, m in _imports(probe, "def f():\n    from .capabilities import detect\n", run_time_only=True)}
    assert lazy == {b}
    assert _cycle({**graph, a: graph[a] | lazy, b: graph[b] | {a}})
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .capabilities import detect\n"
    assert not _imports(probe, typed, run_time_only=True)


def test_no_function_is_long_and_modules_stay_small():
    """No function of the package is over 60 lines, without exceptions (a long one is split into
    steps that have names); no module of core/, runtime/, launcher/ or frontends/ (or their folders)
    is over 400 lines."""
    root = REPO / PACKAGE
    long, big = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        wing = path.relative_to(root).parts[0]
        if wing in ("core", "runtime", "launcher", "frontends") and len(lines) > 400:
            big.append(f"{path.relative_to(root)}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert not long, long
    assert not big, big


def test_each_folder_reads_in_one_sitting() -> None:
    """No package folder holds more than 15 modules directly (its ``__init__`` counted): a concern
    that outgrows that gets a folder of its own."""
    crowded = {str(d.relative_to(REPO)): n for d in [ROOT, *ROOT.rglob("*")] if d.is_dir()
               and (n := len(list(d.glob("*.py")))) > 15}
    assert not crowded, crowded


def test_each_config_front_end_lives_in_one_folder() -> None:
    """Every module of Megatron-Bridge's and Primus's front ends is in its framework's folder
    (frontends/bridge/, frontends/primus/), except the names users import or run (at the package
    top, and ``frontends/bridge_catalog.py``, the recorder's documented command), which only
    re-export (no function or class of their own) and sit nowhere deeper than frontends/."""
    stray, thick = [], []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        word = next((w for w in ("bridge", "primus") if w in str(rel)), None)
        if word is None or rel.parts[:2] == ("frontends", word):
            continue
        if len(rel.parts) > 2 or (len(rel.parts) == 2 and rel.parts[0] != "frontends"):
            stray.append(str(rel))
        elif any(isinstance(n, ast.FunctionDef | ast.ClassDef) for n in ast.walk(ast.parse(path.read_text()))):
            thick.append(str(rel))
    assert not stray and not thick, (stray, thick)
