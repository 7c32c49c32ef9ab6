"""The tests come in three layers, and one sandbox keeps the plugin's variables out of what they run.

- ``tests/unit``: pure and fast, no Megatron tree, no front end;
- ``tests/real``: against real Megatron-LM trees (``MEGATRON_LM_TREES``) and the front ends;
- ``tests/support``: the drivers, cases and helpers both import by name (``conftest.py`` puts the
  folder on ``sys.path``), never collected as tests.
"""

from __future__ import annotations

import ast

from conftest import REPO
from sandbox import clean_environ, plugin_vars

from megatron_perf_toggles.core.registry import SETTINGS, TOGGLES

TESTS = REPO / "tests"
# The front ends' tests are the front-end redesign's (issue 34): real-layer by what they run.
FRONT_ENDS = {"test_bridge.py", "test_primus.py", "test_frontends.py", "test_frontend_corpus.py",
              "test_bridge_comm_overlap.py", "test_bridge_recorded_catalog.py", "test_bare_venv.py"}


def _names(path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute | ast.Name)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}


def test_every_test_module_is_in_a_layer() -> None:
    stray = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                   if p.parent.name not in ("unit", "real"))
    assert not stray, stray
    assert not list((TESTS / "support").glob("test_*.py"))


def test_unit_tests_reach_no_tree_and_no_front_end() -> None:
    for path in sorted((TESTS / "unit").glob("test_*.py")):
        names = _names(path)
        drives = any(n.startswith("tree_driver.SESSION") for n in names)
        assert not drives, f"{path.name} drives Megatron trees: it belongs in tests/real"
        decorators = [d for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)
                      for d in n.decorator_list]
        marked = [ast.unparse(d) for d in decorators if "real_megatron" in ast.unparse(d)]
        assert not marked, f"{path.name} has real-tree tests: tests/real"


def test_real_tests_are_real() -> None:
    for path in sorted((TESTS / "real").glob("test_*.py")):
        text = path.read_text()
        assert path.name in FRONT_ENDS or "real_megatron" in text, f"{path.name} needs no tree: tests/unit"


def test_the_sandbox_leaves_out_every_variable_the_registry_declares() -> None:
    declared = {t.env for t in TOGGLES} | {s.env for s in SETTINGS}
    assert plugin_vars() == declared
    environ = {**dict.fromkeys(declared, "1"), "PATH": "/bin", "KEEP": "x", "DROP": "y",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert clean_environ(environ, drop=("DROP",), EXTRA="z") == {"PATH": "/bin", "KEEP": "x", "EXTRA": "z"}


def test_no_test_keeps_a_list_of_the_plugins_variables_of_its_own() -> None:
    """A prefix or a set of the plugin's variables outside the sandbox would miss the next one."""
    own = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name in FRONT_ENDS | {"sandbox.py", "test_test_layers.py"}:
            continue
        text = path.read_text()
        for needle in ('startswith("MEGATRON_PERF', "startswith(('MEGATRON_PERF", 'startswith(("MEGATRON_PERF',
                       "PLUGIN_VAR"):
            if needle in text:
                own.append(f"{path.relative_to(TESTS)}: {needle}")
    assert not own, own
