"""The recorded Megatron-Bridge catalog against the real Bridge.

``frontends/bridge/catalog.py`` records again, under ``BRIDGE_PYTHON`` (Bridge's own megatron-core,
the fixture Hugging Face configs offline), and the result must equal the catalog the package ships
for that Bridge version; then every recipe the catalog holds is planned twice, by
``explain --bridge-recipe --json`` with the real Bridge and from the catalog in this interpreter
(which has no Bridge), and the decisions, the precision, the wgrad path and the memory plan must
be the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import tree_driver
from conftest import REPO
from sandbox import clean_environ

from megatron_perf_toggles.frontends.bridge import catalog as bridge_catalog
from megatron_perf_toggles.runtime.machine.probe import installed
from megatron_perf_toggles.tools import cli

ENABLE = "set BRIDGE_PYTHON to a Python 3.12 with megatron-bridge installed (tests/bridge_env.sh builds one)"
DRIVER = r'''
import contextlib, io, json, os, sys, tempfile
sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import bridge_driver
bridge_driver._offline_hf_cache(tempfile.mkdtemp())
from megatron_perf_toggles.frontends.bridge import catalog as bridge_catalog
from megatron_perf_toggles.tools import cli
out = os.path.join(tempfile.mkdtemp(), "catalog.json")
with contextlib.redirect_stdout(io.StringIO()):
    bridge_catalog.main(["--out", out])
plans = {}
for name, world in json.loads(sys.argv[2]).items():
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = cli.main(["explain", "--bridge-recipe", name, "--world-size", str(world), "--gpu", "h100", "--json"])
    plans[name] = json.loads(text.getvalue()) if code == 0 else {"code": code}
print(json.dumps({"catalog": json.load(open(out)), "plans": plans}))
'''


def _world(args: dict) -> int:
    world = 1
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        world *= int(args.get(dest) or 1)
    return world


def _recorded() -> dict[str, int]:
    catalog = bridge_catalog.load()
    return {name: _world(bridge_catalog.found(name, catalog).args) for name, one in catalog["recipes"].items()
            if "needs" not in one and "why" not in one}


def _real() -> dict:
    environ = tree_driver.SESSION.environ
    python = environ.get("BRIDGE_PYTHON")
    if not python:
        pytest.skip(f"Megatron-Bridge catalog: {ENABLE}")
    env = clean_environ(environ, drop=("PYTHONPYCACHEPREFIX",))
    env.update(PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")  # Bridge's own megatron-core, as recorded
    with tempfile.TemporaryDirectory(prefix="bridge-catalog-") as scratch:
        proc = subprocess.run([python, "-c", DRIVER, str(REPO), json.dumps(_recorded())], capture_output=True,
                              text=True, env=env, timeout=900, cwd=scratch)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"the catalog driver failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


RUN = tree_driver.SESSION.background("bridge-catalog", _real, real=False)


def test_the_shipped_catalog_is_what_the_real_bridge_records():
    recorded = tree_driver.SESSION.outcome(RUN)["catalog"]
    if recorded["bridge"] not in bridge_catalog.versions():
        pytest.skip(f"BRIDGE_PYTHON has Megatron-Bridge {recorded['bridge']}, which the package has no catalog of")
    shipped = bridge_catalog.load(recorded["bridge"])
    assert recorded["megatron_core"] == shipped["megatron_core"]
    assert recorded["aliases"] == shipped["aliases"]
    differing = [name for name in shipped["recipes"] if recorded["recipes"].get(name) != shipped["recipes"][name]]
    assert set(recorded["recipes"]) == set(shipped["recipes"]) and not differing, differing[:5]
    assert recorded["common"] == shipped["common"]


def _essentials(record: dict) -> dict:
    memory = record.get("memory") or {}
    return {"decisions": {d: (r["value"], r["source"], r["reason"]) for d, r in record["decisions"].items()},
            "precision": record["precision"], "wgrad_path": record["wgrad_path"],
            "memory": (memory.get("stock_peak_mb"), memory.get("peak_memory_delta_mb"), memory.get("planned_peak_mb")),
            "messages": [m["text"] for m in record["messages"]]}


@pytest.mark.skipif(installed("megatron.bridge"), reason="this interpreter has Megatron-Bridge: no catalog plan here")
def test_every_recorded_recipe_plans_from_the_catalog_as_with_bridge(monkeypatch, capsys):
    real = tree_driver.SESSION.outcome(RUN)["plans"]
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in clean_environ().items():
        monkeypatch.setenv(name, value)
    differing = []
    for name, world in _recorded().items():
        code = cli.main(["explain", "--bridge-recipe", name, "--world-size", str(world), "--gpu", "h100", "--json"])
        ours = json.loads(capsys.readouterr().out)
        assert code == 0 and "code" not in real[name], (name, real[name])
        if _essentials(ours) != _essentials(real[name]):
            differing.append(name)
    assert not differing, f"{len(differing)} of {len(real)} recipes plan otherwise from the catalog: {differing[:5]}"
    assert Path(bridge_catalog.__file__).is_file()
