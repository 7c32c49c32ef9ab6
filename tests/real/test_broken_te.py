"""A plan for another machine does not depend on this machine's Transformer Engine.

``pip install transformer-engine`` alone leaves an empty meta package whose import raises ("Found
empty `transformer-engine` meta package installed"). Megatron imports Transformer Engine where it
is installed, so every way of planning a checkout for another GPU stopped there. Here each one
runs as its own process with that package first on the path (tests/support/broken_te.py): the
launcher's dry run, a patched checkout's, ``explain --megatron`` and ``flags --megatron``; each
plans as on a machine without Transformer Engine. The Megatron-Bridge recipe is tests/real/test_bridge.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import broken_te
import launcher_cases as runs
import pytest
from conftest import REPO, megatron_trees
from sandbox import clean_environ

from megatron_perf_toggles.tools.llama3_8b import LLAMA3_8B_EXAMPLE

pytestmark = [pytest.mark.real_megatron, pytest.mark.own_process]
NEWEST = [pytest.param(str(t), id=t.name) for t in megatron_trees()[-1:]] or [pytest.param(None, id="no-trees")]
PLAN = ["--world-size", "8", "--gpu", "h100"]


def _run(argv: list[str], tmp_path: Path, tree: str, **env: str) -> subprocess.CompletedProcess[str]:
    where = broken_te.meta_package(tmp_path / "site")
    environ = clean_environ({k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                            PYTHONPATH=os.pathsep.join([str(where), str(REPO), tree]), **env)
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("tree", NEWEST)
def test_the_meta_package_stops_megatron_here(tree: str, tmp_path: Path) -> None:
    """The premise: with the meta package first on the path, importing Transformer Engine raises."""
    done = _run(["-c", "import transformer_engine"], tmp_path, tree)
    assert done.returncode != 0 and broken_te.MESSAGE.split(".")[0] in done.stderr


@pytest.mark.parametrize("tree", NEWEST)
def test_a_dry_run_for_another_gpu_plans_past_it(tree: str, tmp_path: Path) -> None:
    done = _run(["-m", "megatron_perf_toggles.run", "--dry-run", "--json", *PLAN, f"{tree}/pretrain_gpt.py",
                 *LLAMA3_8B_EXAMPLE], tmp_path, tree)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert record["target"]["gpu"]["name"] == "h100" and record["capabilities"]["te_version"] == "2.20"


@pytest.mark.parametrize("tree", NEWEST)
def test_explain_and_flags_on_the_checkout_plan_past_it(tree: str, tmp_path: Path) -> None:
    explain = _run(["-m", "megatron_perf_toggles", "explain", "--megatron", tree, "--json", *PLAN], tmp_path, tree)
    assert explain.returncode == 0, explain.stderr[-3000:]
    assert json.loads(explain.stdout)["layout"]["tp"] == 2  # the built-in example's TP 2
    flags = _run(["-m", "megatron_perf_toggles", "flags", "--megatron", tree, *PLAN], tmp_path, tree)
    assert flags.returncode == 0 and "--grad-reduce-in-bf16" in flags.stdout, flags.stderr[-3000:]


@pytest.mark.parametrize("tree", NEWEST)
def test_a_patched_checkouts_dry_run_for_another_gpu_plans_past_it(tree: str, tmp_path: Path) -> None:
    copy = runs.patched(tree)
    done = _run([str(copy / "pretrain_gpt.py"), "--extra-args-provider", "megatron_perf_toggles",
                 *LLAMA3_8B_EXAMPLE], tmp_path, str(copy), MEGATRON_PERF_TOGGLES_DRY_RUN="1",
                MEGATRON_PERF_TOGGLES_PLAN="8:h100", MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT="json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["target"]["world_size"] == 8
