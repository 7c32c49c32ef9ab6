"""Every test that needs a real Megatron-LM tree says so with the ``real_megatron`` marker, so
``-m "not real_megatron"`` runs the fast set and a run without trees skips them for one reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO, SESSION_STARTED, megatron_trees

# What a test reaches real trees through: the trees themselves, or parameters made from them.
TREE_NAMES = {"TREES", "TREE_PARAMS", "EXPLAIN_MATRIX", "PICKED", "megatron_trees", "_tree_params", "SESSION"}


def _marked(decorators: list[ast.expr]) -> bool:
    return any("real_megatron" in ast.unparse(d) or ast.unparse(d) == "needs_trees" for d in decorators)


def _unmarked_tree_tests(source: str) -> list[str]:
    tree = ast.parse(source)
    module_marked = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                        and "real_megatron" in ast.unparse(n.value) for n in tree.body)
    if module_marked:
        return []
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names |= {n.id for d in node.decorator_list for n in ast.walk(d) if isinstance(n, ast.Name)}
        if names & TREE_NAMES and not _marked(node.decorator_list):
            found.append(node.name)
    return found


def test_every_real_tree_test_is_marked():
    unmarked = {path.name: names for path in sorted((REPO / "tests").rglob("test_*.py"))
                if (names := _unmarked_tree_tests(path.read_text()))}
    assert not unmarked, f"tests that reach real trees without @pytest.mark.real_megatron: {unmarked}"


def test_the_marker_check_sees_an_unmarked_tree_test():
    source = ("import pytest\n@pytest.mark.parametrize('tree', TREE_PARAMS)\ndef test_a(tree):\n    pass\n"
              "@pytest.mark.real_megatron\n@pytest.mark.parametrize('tree', TREE_PARAMS)\ndef test_b(tree):\n    pass\n"
              "def test_c():\n    assert 1\n")
    assert _unmarked_tree_tests(source) == ["test_a"]
    assert _unmarked_tree_tests("import pytest\npytestmark = pytest.mark.real_megatron\n" + source) == []
    assert Path(__file__).name == "test_markers.py"


class _Item:
    def __init__(self, stem: str, *markers: str) -> None:
        self.path = Path(f"/repo/tests/{stem}.py")
        self.markers = set(markers)

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None


def test_processes_first_then_units_then_waiting_then_real_tree_results():
    from conftest import _order

    items = [_Item("test_a", "real_megatron"), _Item("test_b"), _Item("test_jobs"),
             _Item("test_c", "real_megatron", "own_process"), _Item("test_d", "own_process")]
    items.sort(key=lambda item: _order(item, {"test_jobs"}))
    assert [i.path.stem for i in items] == ["test_c", "test_d", "test_b", "test_jobs", "test_a"]


def test_the_heaviest_trees_start_first():
    import tree_driver

    session = tree_driver.Session()
    session.suite("light", lambda tree, work: [], owners=["x"])
    session.suite("sized", lambda tree, work: [], owners=["x"], weight=lambda tree: {"b": 3, "c": 5}.get(tree, 0))
    session.suite("flat", lambda tree, work: [], owners=["x"], weight=lambda tree: 1)
    assert session._heaviest_first(["a", "b", "c", "d"]) == ["c", "b", "a", "d"]


_ASKED = "import sys; print(sys.pycache_prefix, sys.dont_write_bytecode)"


def test_started_processes_share_the_sessions_bytecode_directory():
    """Processes the tests start compile a module once per session, into the session's directory:
    both ways a test starts one (the session's environment, or the tree driver's)."""
    import os
    import subprocess
    import sys

    import tree_driver

    made = os.environ.get("PYTHONPYCACHEPREFIX")
    assert made and Path(made).is_dir() and "PYTHONDONTWRITEBYTECODE" not in os.environ
    assert sys.pycache_prefix == made and not sys.dont_write_bytecode
    for env in (None, tree_driver.driver_env()):
        seen = subprocess.run([sys.executable, "-c", _ASKED], env=env, capture_output=True, text=True, timeout=60)
        assert seen.stdout.split() == [made, "False"], seen.stdout + seen.stderr


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", megatron_trees(), ids=lambda t: t.name)
def test_no_bytecode_is_written_into_a_tree(tree):
    """A tree's worker compiled the tree (into the session's directory), and this session wrote no
    bytecode into it (older files, from a run outside the tests, are not this session's)."""
    import os
    import sys

    import tree_driver

    found = tree_driver.SESSION.run(tree, [{"name": "bytecode", "kind": "wgrad_sites"}])  # imports Megatron
    assert "driver_error" not in found["bytecode"], found["bytecode"]["driver_error"]
    mirror = Path(os.environ["PYTHONPYCACHEPREFIX"]) / tree.resolve().relative_to(tree.resolve().anchor) / "megatron"
    assert list(mirror.rglob(f"*.{sys.implementation.cache_tag}.pyc"))
    written = []
    for where, dirs, files in os.walk(tree):
        dirs[:] = [d for d in dirs if d != ".git"]
        if os.path.basename(where) == "__pycache__":
            written += [f for f in files if os.path.getmtime(os.path.join(where, f)) >= SESSION_STARTED - 1]
    assert not written, f"this session wrote bytecode into {tree}: {written[:5]}"
