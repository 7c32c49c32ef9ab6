"""The test session accounts for every skip: each skipped test is counted once under its reason,
whole and on one line, and a real-Megatron test without trees says why (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NO_TREES, REPO
from sandbox import clean_environ

pytestmark = pytest.mark.own_process

# A conftest that is the suite's own (its hooks, loaded from tests/conftest.py), for a scratch session.
SCRATCH_CONFTEST = f'''
import importlib.util, sys
sys.path.insert(0, {str(REPO / "tests")!r})
spec = importlib.util.spec_from_file_location("ptt_suite_conftest", {str(REPO / "tests" / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
globals().update({{k: v for k, v in vars(suite).items() if k.startswith("pytest_")}})
'''

SCRATCH_TESTS = '''
import pytest

@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", [])
def test_on_every_tree(tree):
    pass

@pytest.mark.real_megatron
def test_on_a_tree():
    pass

def test_a_tool_that_failed():
    pytest.skip("cannot build it here:\\n  File \\"<frozen importlib._bootstrap>\\", line 488\\nModuleNotFoundError: x")

@pytest.mark.parametrize("n", [1, 2])
def test_twice(n):
    pytest.skip("no GPU here")

def test_runs():
    pass
'''


def test_every_skip_is_counted_once_under_its_whole_reason(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(SCRATCH_CONFTEST)
    (tmp_path / "test_scratch.py").write_text(SCRATCH_TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=clean_environ(drop=("MEGATRON_LM_TREES",)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.split("skipped tests", 1)[1].splitlines()[1:]
    assert summary[0] == "5 skipped, for 3 reason(s):" and "1 passed, 5 skipped" in done.stdout
    counted = dict(line.strip().split("  ", 1)[::-1] for line in summary[1:4])
    assert counted == {
        NO_TREES: "2",  # the test over the trees says why it has none, not "got empty parameter set"
        "no GPU here": "2",
        'cannot build it here: File "<frozen importlib._bootstrap>", line 488 ModuleNotFoundError: x': "1",
    }, summary
