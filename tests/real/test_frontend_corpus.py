"""The config front ends' corpus: every Megatron-Bridge recipe that builds on CPU and every Primus
example experiment (MI300X, MI355X), through the plugin, with the checks each corpus script lists.

One process per front end (tests/support/bridge_corpus.py under the Bridge interpreter,
tests/support/primus_corpus.py with a Primus tree and a Megatron-LM tree), started beside the unit tests.
The counts (held, could not be built) are printed in the test summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tree_driver
from conftest import REPO

CORPUS_KEY = "front-end corpus"


def _bridge() -> dict:
    environ = tree_driver.SESSION.environ
    python = environ.get("BRIDGE_PYTHON")
    if not python:
        pytest.skip("Megatron-Bridge corpus: set BRIDGE_PYTHON to a Python 3.12 with megatron-bridge installed")
    trees = [Path(t) for t in tree_driver.trees()]
    tree = next((t for t in trees if t.name == "main"), trees[-1] if trees else None)
    env = {k: v for k, v in environ.items() if not k.startswith(("MEGATRON_PERF_TOGGLES", "FP4_", "PYTHONPYCACHE"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (str(tree) if tree else "", str(REPO)) if p),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([python, str(REPO / "tests" / "support" / "bridge_corpus.py")], capture_output=True, text=True,
                          env=env, timeout=900)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the Bridge corpus did not run ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _primus() -> dict:
    environ = tree_driver.SESSION.environ
    primus = [p for p in environ.get("PRIMUS_TREES", "").split(os.pathsep) if p.strip()]
    trees = [Path(t) for t in tree_driver.trees()]
    megatron = next((t for t in trees if t.name == "main"), trees[-1] if trees else None)
    if not primus or megatron is None:
        pytest.skip("Primus corpus: set PRIMUS_TREES (tests/export_primus.sh) and MEGATRON_LM_TREES")
    env = {k: v for k, v in environ.items() if not k.startswith(("MEGATRON_PERF_TOGGLES", "FP4_"))}
    env["PYTHONPATH"] = os.pathsep.join((primus[0], str(REPO)))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "primus_corpus.py"), primus[0], str(megatron)],
                          capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the Primus corpus did not run ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


BRIDGE = tree_driver.SESSION.background("bridge-corpus", _bridge, real=False)
PRIMUS = tree_driver.SESSION.background("primus-corpus", _primus, real=False)


def _held(results: dict, what: str, record_property) -> list[str]:
    built = {k: r for k, r in results.items() if r["built"]}
    failed = [f"{k}: {'; '.join(r['failed'])}" for k, r in built.items() if r["failed"]]
    validated = sum(1 for r in built.values() if r.get("validated"))
    record_property(CORPUS_KEY, f"{what}: {len(built) - len(failed)} of {len(built)} built held "
                                f"({validated} pass the front end's own validation without and with the plugin), "
                                f"{len(results) - len(built)} could not be built here")
    return failed


def test_every_bridge_recipe_that_builds_on_cpu_holds(record_property):
    results = tree_driver.SESSION.outcome(BRIDGE)
    failed = _held(results, "Megatron-Bridge recipes", record_property)
    assert not failed, "\n".join(failed)
    assert sum(r["built"] for r in results.values()) >= 20  # the corpus is real: the CPU-buildable recipes ran


def test_every_primus_example_experiment_holds(record_property):
    results = tree_driver.SESSION.outcome(PRIMUS)
    failed = _held(results, "Primus MI300X/MI355X experiments", record_property)
    assert not failed, "\n".join(failed)
    assert any("MI300X" in k for k in results) and any("MI355X" in k for k in results)
    assert sum(r["built"] for r in results.values()) >= 100
