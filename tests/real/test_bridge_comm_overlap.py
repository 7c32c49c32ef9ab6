"""The Bridge front end reads ``cfg.comm_overlap`` and checks the recipe's layout against the planned world.

Megatron-Bridge's GPT-3 175B recipe asks for deferred embedding wgrad in ``cfg.comm_overlap``,
which Bridge copies onto the model only in ``runtime_config_update``. Where fused wgrad cannot
run, the plan must not turn gradient-accumulation fusion off behind it (Bridge's validation then
fails): it refuses in one line naming the field, as the argparse path refuses
``--defer-embedding-wgrad-compute``. On the H100's planned stack the fallback keeps it on. Its
TP 4 x PP 8 layout on ``--world-size 8`` is one line, exit 2. Runs under ``BRIDGE_PYTHON`` as
tests/real/test_bridge.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import tree_driver
from conftest import REPO, last_line
from sandbox import clean_environ

from megatron_perf_toggles.runtime.machine.capabilities import effective_assume
from megatron_perf_toggles.runtime.machine.target import make_target

GPT175 = "megatron.bridge.recipes.gpt.gpt3_175b.gpt3_175b_pretrain_config"
H100_STACK = str(effective_assume(None, make_target(32, gpu="h100")))
CASES = [
    {"recipe": GPT175, "env": {"WORLD_SIZE": "32", "MEGATRON_PERF_TOGGLES_ASSUME": "none"}},
    {"recipe": GPT175, "env": {"WORLD_SIZE": "32", "MEGATRON_PERF_TOGGLES_ASSUME": H100_STACK}},
]
ENABLE = "set BRIDGE_PYTHON to a Python 3.12 with megatron-bridge installed (tests/bridge_env.sh builds one)"


def _env(environ: dict[str, str]) -> dict[str, str]:
    named = environ.get("BRIDGE_MEGATRON_TREE")
    trees = [Path(t) for t in tree_driver.trees()]
    tree = Path(named) if named else next((t for t in trees if t.name == "main"), trees[-1] if trees else None)
    env = clean_environ(environ, drop=("PYTHONPYCACHEPREFIX",))
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(tree) if tree else "", str(REPO)) if p),
               PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _runs() -> dict:
    environ = tree_driver.SESSION.environ
    python = environ.get("BRIDGE_PYTHON")
    if not python:
        pytest.skip(f"Megatron-Bridge suite: {ENABLE}")
    env = _env(environ)
    with tempfile.TemporaryDirectory(prefix="bridge-overlap-") as scratch:
        cases = subprocess.run([python, str(REPO / "tests" / "bridge_driver.py")], input=json.dumps(CASES),
                               capture_output=True, text=True, env=env, timeout=600, cwd=scratch)
        explain = subprocess.run([python, "-m", "megatron_perf_toggles", "explain", "--bridge-recipe",
                                  GPT175.replace(".gpt3_175b.", ".gpt3_175b:"), "--world-size", "8", "--gpu", "h100"],
                                 capture_output=True, text=True, env=env, timeout=600, cwd=scratch)
    if cases.returncode != 0 or not cases.stdout.strip():
        pytest.fail(f"bridge driver failed ({cases.returncode}): {cases.stderr[-3000:]}")
    out = json.loads(cases.stdout)
    if "import_error" in out:
        pytest.skip(f"Megatron-Bridge does not import under {python}: {last_line(out['import_error'])}")
    return {"cases": out["results"], "explain": {"code": explain.returncode, "stdout": explain.stdout,
                                                 "stderr": explain.stderr}}


RUNS = tree_driver.SESSION.background("bridge-comm-overlap", _runs, real=False)


def test_deferred_embedding_wgrad_in_comm_overlap_keeps_fusion_or_refuses_in_one_line():
    no_kernel, h100 = tree_driver.SESSION.outcome(RUNS)["cases"]
    assert "crash" not in no_kernel and "crash" not in h100, (no_kernel, h100)
    # Nothing computes fused wgrad: the field that needs it is named, one line, no silent change.
    assert no_kernel["error"].startswith("DependencyError: cfg.comm_overlap.defer_embedding_wgrad_compute needs "
                                         "gradient_accumulation_fusion on"), no_kernel
    assert "\n" not in no_kernel["error"]
    # The H100's planned stack: the torch fallback keeps fusion on, as deferral needs.
    assert h100["decisions"]["gradient_accumulation_fusion"]["value"] is True, h100
    assert h100["after"]["model.gradient_accumulation_fusion"] is True


def test_the_175b_recipe_on_eight_gpus_is_one_line():
    explain = tree_driver.SESSION.outcome(RUNS)["explain"]
    said = [line for line in explain["stderr"].splitlines() if line.strip()]
    assert explain["code"] == 2 and explain["stdout"] == "", explain
    assert len(said) == 1 and "world size 8 is not divisible by TP x PP x CP = 32 (4 x 8 x 1)" in said[0], said
