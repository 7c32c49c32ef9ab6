"""docs/contributing.md's recipe for adding a toggle, followed as written in a scratch copy of the
repository: it adds a toggle with a capability the package does not know yet, regenerates the
docs, runs the unit tests there, and counts the hand-written files it had to touch.

``test_adding_a_toggle.py`` shows what the new entries do inside this process; this test shows that
the recipe's files are all a contributor edits: no list of toggles elsewhere in the tests or the
package has to learn the new one by hand. It edits the files the recipe names (read from the page,
so a move of a module moves the recipe with it) and nothing else.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from sandbox import clean_environ

MARK = "<!-- recipe: adding a toggle -->"
SKIP_DIRS = (".git", ".venv", "__pycache__", "*.egg-info", ".mypy_cache", ".ruff_cache", ".pytest_cache",
             "build", "dist")

# Step 1: a capability record and a toggle that needs it (flags, variable and help follow from dest).
CAPABILITY = '''    Capability("te_recipe_kernel", "import:transformer_engine.pytorch.example:recipe_kernel",
               "te>=2.9", "TE {te_version} has no recipe kernel"),
'''
TOGGLE = '''    Toggle(
        dest="fused_recipe_kernel",
        env="FUSED_RECIPE_KERNEL",
        title="fused example kernel",
        kind="bool",
        default=False,
        group="transformer",
        needs=("te_recipe_kernel",),
        help="An example of a fused kernel from Transformer Engine.",
    ),
'''
# Step 2: the guard, declared in its module (above the module's derived GUARDS).
GUARD = '''@guard(moves=("fused_recipe_kernel",))
def recipe_kernel_missing(ctx: Context) -> Iterator[Change]:
    """The recipe kernel goes off where this machine lacks it."""
    need = lacking(ctx, "fused_recipe_kernel") if is_on(ctx.values, "fused_recipe_kernel") else None
    if need:
        yield Change("fused_recipe_kernel", False, f"{need} is missing here",
                     hint="pass --no-fused-recipe-kernel", capability=need)


'''
# Step 3: the toggle's tests (present, missing, and an explicit request where it is missing).
TESTS = '''"""The recipe kernel toggle (written by the contributing recipe's test)."""

import pytest
from conftest import full_caps

from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.errors import CannotHonourError
from {decide} import decide


def test_off_by_default_until_its_admission_record():
    assert decide({{}}, {{}}, read_env({{}}), full_caps()).decisions["fused_recipe_kernel"].value is False


def test_on_where_requested_and_the_kernel_is_present():
    d = decide({{}}, {{"fused_recipe_kernel": True}}, read_env({{}}), full_caps()).decisions["fused_recipe_kernel"]
    assert d.value is True


def test_an_explicit_request_where_it_is_missing_is_refused():
    with pytest.raises(CannotHonourError, match="--fused-recipe-kernel"):
        decide({{}}, {{"fused_recipe_kernel": True}}, read_env({{}}), full_caps(te_recipe_kernel=False))
'''
# Step 4: its row in the registry's contract.
SPEC_ROW = '''    "FUSED_RECIPE_KERNEL": ("fused_recipe_kernel", False, ("--fused-recipe-kernel", "--no-fused-recipe-kernel")),
'''
# Step 5: one line.
CHANGELOG = "- **Fused recipe kernel.** `FUSED_RECIPE_KERNEL` (off by default until its admission record).\n"


def recipe_files(page: str) -> list[str]:
    """The hand-written files the recipe names, one numbered step each (its first path in backticks)."""
    recipe = page.split(MARK, 2)[1]
    steps = [line for line in recipe.splitlines() if line[:2] in {f"{n}." for n in range(1, 10)}]
    return [line.split("`")[1] for line in steps]


def _insert(path: Path, before: str, text: str, after: str = "") -> None:
    """``text`` put in front of the first ``before`` that follows ``after`` (the recipe's edit)."""
    source = path.read_text()
    start = source.index(after) if after else 0
    at = source.index(before, start)
    path.write_text(source[:at] + text + source[at:])


def _follow_recipe(copy: Path, files: list[str]) -> dict[str, Path]:
    """Each step's edit in the scratch copy; the paths it wrote, by step."""
    registry, guards, tests, contract, changelog = (copy / f.replace("<toggle>", "fused_recipe_kernel")
                                                    for f in files)
    _insert(registry, ")\nBY_CAPABILITY", CAPABILITY, after="CAPABILITY_RECORDS")
    _insert(registry, "\n)\n", "\n" + TOGGLE.rstrip("\n"), after="TOGGLES: tuple")
    _insert(guards, "GUARDS = declared_in(globals())", GUARD)
    decide_module = next(p for p in (copy / "megatron_perf_toggles").rglob("decide.py"))
    dotted = ".".join(decide_module.relative_to(copy).with_suffix("").parts)
    tests.write_text(TESTS.format(decide=dotted))
    _insert(contract, "}\n", SPEC_ROW, after="SPEC = {")
    _insert(changelog, "- ", CHANGELOG, after="## Unreleased")
    return {"registry": registry, "guards": guards, "tests": tests, "contract": contract, "changelog": changelog}


def _snapshot(root: Path) -> dict[str, bytes]:
    skip = {".pytest_cache", "__pycache__"}
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(root).parts)}


def _changed(before: dict[str, bytes], after: dict[str, bytes]) -> set[str]:
    return {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}


def _run(copy: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    environ = clean_environ(drop=("MEGATRON_LM_TREES", "PRIMUS_TREES", "BRIDGE_PYTHON"), PYTHONPATH=str(copy))
    return subprocess.run([sys.executable, *argv], cwd=copy, env=environ, capture_output=True, text=True,
                          timeout=900, check=False)


@pytest.mark.own_process
def test_the_recipe_adds_a_toggle_touching_only_its_own_files(tmp_path: Path) -> None:
    files = recipe_files((REPO / "docs" / "contributing.md").read_text())
    assert len(files) == 5, files  # registry, guards, its tests, the registry's contract, changelog
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*SKIP_DIRS))
    pristine = _snapshot(copy)
    _follow_recipe(copy, files)
    written = _snapshot(copy)
    hand_written = _changed(pristine, written)
    assert hand_written == {f.replace("<toggle>", "fused_recipe_kernel") for f in files}, hand_written

    regenerate = _run(copy, "-m", "megatron_perf_toggles.tools.readme_tables", "--write")
    assert regenerate.returncode == 0, regenerate.stderr
    generated = _changed(written, _snapshot(copy))
    assert generated and not generated & hand_written, generated  # the tables learn it; nobody writes them
    assert all(name.endswith(".md") for name in generated), generated

    unit = _run(copy, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not own_process",
                "tests/unit")
    assert unit.returncode == 0, unit.stdout[-6000:] + unit.stderr[-2000:]
    assert "test_fused_recipe_kernel.py" in _run(copy, "-m", "pytest", "--collect-only", "-q",
                                                  "tests/unit/test_fused_recipe_kernel.py").stdout


def _spelled_lists(path: Path, groups: list[set[str]]) -> list[int]:
    """The lines of literal collections (a tuple, list, set or dict written out) in ``path`` that
    name every toggle of one of ``groups``, by dest or by variable."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            items = [*node.keys, *node.values] if isinstance(node, ast.Dict) else node.elts
            words = {n.value for n in items if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            if any(group <= words for group in groups):
                lines.append(node.lineno)
    return lines


def test_one_test_file_spells_out_the_toggles() -> None:
    """The registry's contract (test_registry.py) writes the toggles out, independently of the code;
    every other test derives its lists from the registry (all toggles, or a dense model's), so a
    new toggle needs no edit there."""
    from megatron_perf_toggles.core.registry import TOGGLES

    groups = [{getattr(t, key) for t in TOGGLES if scope in ("any", t.scope)}
              for scope in ("any", "all") for key in ("dest", "env")]
    spelled = {str(p.relative_to(REPO)): lines for p in sorted((REPO / "tests").rglob("*.py"))
               if (lines := _spelled_lists(p, groups))}
    assert list(spelled) == ["tests/unit/test_registry.py"], spelled
