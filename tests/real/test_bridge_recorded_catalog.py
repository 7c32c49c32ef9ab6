"""The recorded Megatron-Bridge catalogs against the real Bridge.

``frontends/bridge/catalog.py`` records again, under ``BRIDGE_PYTHON`` and each Python of
``BRIDGE_CATALOG_PYTHONS`` (':'-separated: environments with an older Bridge and the megatron-core it
pins, e.g. 0.4.2 and 0.5.1; the fixture Hugging Face configs offline), and the result must equal the
catalog the package ships for that Bridge version; then every recipe that catalog holds is planned
twice, by ``explain --bridge-recipe --json`` with the real Bridge and from the catalog in this
interpreter (which has no Bridge, ``--bridge-version``), and the decisions, the precision, the wgrad
path and the memory plan must be the same.
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
EXTRA = "BRIDGE_CATALOG_PYTHONS"
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
for name, world in json.loads(sys.argv[2]).get(json.load(open(out))["bridge"], {}).items():
    text, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(err):
            code = cli.main(["explain", "--bridge-recipe", name, "--world-size", str(world), "--gpu", "h100", "--json"])
    except SystemExit as stop:  # a refusal: one line, exit 2
        code = stop.code
    plans[name] = json.loads(text.getvalue()) if code == 0 else {"code": code, "said": err.getvalue()[-500:]}
print(json.dumps({"catalog": json.load(open(out)), "plans": plans}))
'''


def _world(args: dict) -> int:
    world = 1
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        world *= int(args.get(dest) or 1)
    return world


def _recorded(version: str) -> dict[str, int]:
    catalog = bridge_catalog.load(version)
    return {name: _world(bridge_catalog.found(name, catalog).args) for name, one in catalog["recipes"].items()
            if "needs" not in one and "why" not in one}


def _pythons() -> list[str]:
    environ = tree_driver.SESSION.environ
    found = [environ.get("BRIDGE_PYTHON", ""), *environ.get(EXTRA, "").split(":")]
    return list(dict.fromkeys(p for p in found if p))


def _one(python: str) -> dict:
    env = clean_environ(tree_driver.SESSION.environ, drop=("PYTHONPYCACHEPREFIX",))
    env.update(PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")  # Bridge's own megatron-core, as recorded
    worlds = {version: _recorded(version) for version in bridge_catalog.versions()}
    with tempfile.TemporaryDirectory(prefix="bridge-catalog-") as scratch:
        proc = subprocess.run([python, "-c", DRIVER, str(REPO), json.dumps(worlds)], capture_output=True,
                              text=True, env=env, timeout=900, cwd=scratch)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise AssertionError(f"the catalog driver failed under {python} ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _real() -> dict[str, dict]:
    """Each Bridge Python's recorded catalog and real plans, by the Bridge version it has."""
    pythons = _pythons()
    if not pythons:
        pytest.skip(f"Megatron-Bridge catalog: {ENABLE}")
    found = {}
    for python in pythons:
        one = _one(python)
        found[one["catalog"]["bridge"]] = one
    return found


RUN = tree_driver.SESSION.background("bridge-catalog", _real, real=False)


def _checked() -> dict[str, dict]:
    """The versions recorded here that the package has a catalog of (a test fails where none is)."""
    real = tree_driver.SESSION.outcome(RUN)
    known = {version: one for version, one in real.items() if version in bridge_catalog.versions()}
    if not known:
        pytest.skip(f"the Bridge Pythons given have Megatron-Bridge {', '.join(real)}, which the package has no catalog of")
    return known


def test_the_shipped_catalog_is_what_the_real_bridge_records():
    checked = _checked()
    print(f"Megatron-Bridge catalogs checked against the real Bridge: {', '.join(sorted(checked))}")
    for version, one in checked.items():
        recorded, shipped = one["catalog"], bridge_catalog.load(version)
        assert recorded["megatron_core"] == shipped["megatron_core"], version
        assert recorded["aliases"] == shipped["aliases"], version
        differing = [name for name in shipped["recipes"] if recorded["recipes"].get(name) != shipped["recipes"][name]]
        assert set(recorded["recipes"]) == set(shipped["recipes"]) and not differing, (version, differing[:5])
        assert recorded["common"] == shipped["common"], version


def _essentials(record: dict) -> dict:
    memory = record.get("memory") or {}
    return {"decisions": {d: (r["value"], r["source"], r["reason"]) for d, r in record["decisions"].items()},
            "precision": record["precision"], "wgrad_path": record["wgrad_path"],
            "memory": (memory.get("stock_peak_mb"), memory.get("peak_memory_delta_mb"), memory.get("planned_peak_mb")),
            "messages": [m["text"] for m in record["messages"]]}


@pytest.mark.skipif(installed("megatron.bridge"), reason="this interpreter has Megatron-Bridge: no catalog plan here")
def test_every_recorded_recipe_plans_from_the_catalog_as_with_bridge(monkeypatch, capsys):
    checked = _checked()
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in clean_environ().items():
        monkeypatch.setenv(name, value)
    for version, one in checked.items():
        real, differing = one["plans"], []
        for name, world in _recorded(version).items():
            code = cli.main(["explain", "--bridge-recipe", name, "--bridge-version", version,
                             "--world-size", str(world), "--gpu", "h100", "--json"])
            ours = json.loads(capsys.readouterr().out)
            assert code == 0 and "code" not in real[name], (version, name, real[name])
            if _essentials(ours) != _essentials(real[name]):
                differing.append(name)
        assert not differing, (f"Bridge {version}: {len(differing)} of {len(real)} recipes plan otherwise from the "
                               f"catalog: {differing[:5]}")
    assert Path(bridge_catalog.__file__).is_file()
