"""An experiment flows forward through seven stages, one module each (tools/ablate/): no module imports
one of a later stage, read from every import statement, the ones inside functions too.

1 spec (options to a checked spec), 2 design (its arms), 3 runs (each run's command and environment,
resolved through the dry run once; confounds.py and loss/common_start.py are its parts), 4 schedule,
5 execution (each run measured once), 6 analysis (loss/loss_test.py and loss/pool.py are its parts),
7 report. Below them the libraries every stage may use (stats.py, loss/equivalence.py); above them the
drivers, which call the stages in order (ablate's command, the re-analysis of a finished directory
and its pooling over sessions, tune's phases).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO
from test_layers import _imports, _module_name

PACKAGE = "megatron_perf_toggles.tools.ablate"
ABLATE = REPO / "megatron_perf_toggles" / "tools" / "ablate"
TOOLS = REPO / "megatron_perf_toggles" / "tools"
LIBRARY, DRIVER = 0, 8
STAGES = {"stats": LIBRARY, "loss": LIBRARY, "loss.equivalence": LIBRARY,
          "spec": 1, "design": 2, "runs": 3, "confounds": 3, "loss.common_start": 3, "schedule": 4,
          "execution": 5, "analysis": 6, "loss.loss_test": 6, "loss.pool": 6, "report": 7,
          "": DRIVER, "command": DRIVER, "reanalyse": DRIVER}
MODULES = sorted(ABLATE.rglob("*.py"))


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE).lstrip(".")


def _stage(module: str) -> int:
    return STAGES[_short(module)]


def test_every_module_has_its_stage() -> None:
    """A new module is placed on purpose: as a stage's, a library or a driver."""
    assert sorted(_short(_module_name(p)) for p in MODULES) == sorted(STAGES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ABLATE)))
def test_no_module_imports_a_later_stage(path: Path) -> None:
    here = _module_name(path)
    later = [f"line {line}: {module}" for line, module in _imports(path, run_time_only=True)
             if module.startswith(PACKAGE + ".") and _stage(module) > _stage(here)]
    assert not later, f"{_short(here)} (stage {_stage(here)}) imports a later stage: {later}"


def test_the_stage_test_sees_a_later_import() -> None:
    """A test that cannot fail proves nothing: an import of a later stage, even inside a function,
    is caught."""
    probe = ABLATE / "runs.py"
    found = [m for _, m in _imports(probe, "def f():\n    from .analysis import compare\n    from . import stats\n")]
    assert found == [f"{PACKAGE}.analysis", f"{PACKAGE}.stats"]
    assert [_stage(m) > _stage(_module_name(probe)) for m in found] == [True, False]


STAGE_CALLS = ("spec.checked", "design.designed", "runs.resolved", "schedule.scheduled", "execution.executed",
               "analysis.analysed", "report.reported")


def test_ablate_calls_the_stages_in_order_each_once() -> None:
    """ablate's command is the pipeline written out: each stage called by name, once, in order."""
    tree = ast.parse((ABLATE / "command.py").read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "run_ablation")
    calls = [ast.unparse(n.func) for n in ast.walk(body) if isinstance(n, ast.Call)]
    staged = [c for c in calls if c in STAGE_CALLS]
    assert staged == list(STAGE_CALLS)
    assert sorted(staged, key=lambda c: next(n.lineno for n in ast.walk(body) if isinstance(n, ast.Call)
                                             and ast.unparse(n.func) == c)) == list(STAGE_CALLS)


def test_no_folder_of_the_tools_holds_more_than_twelve_modules() -> None:
    """Each folder under tools/ (its ``__init__`` counted) reads in one sitting."""
    crowded = {str(d.relative_to(TOOLS)): n for d in [TOOLS, *TOOLS.rglob("*")] if d.is_dir()
               and (n := len(list(d.glob("*.py")))) > 12}
    assert not crowded, crowded
