"""From a bare venv on a CPU box: ``pip install '.[bridge]'`` is all ``explain --bridge-recipe`` needs.

The package is built into a wheel once, installed with its ``bridge`` extra into a fresh venv
(Python 3.12 where one is found, as Bridge 0.4-0.6 need; else this interpreter) that has nothing
else: no torch, no Megatron, no Bridge, no Transformer Engine; then the issue's command plans
Llama-3-8B for 64 H100s with no network, within a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from sandbox import clean_environ

pytestmark = pytest.mark.own_process
LLAMA = "megatron.bridge.recipes.llama:llama3_8b_pretrain_config"


def _python312() -> str:
    """Python 3.12 as tests/bridge_env.sh finds it, else this interpreter."""
    named = os.environ.get("PYTHON312") or shutil.which("python3.12")
    candidates = [named] if named else []
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(str(p) for p in root.glob("3.12*/bin/python3.12"))
    for python in candidates:
        probe = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
                               capture_output=True, text=True)
        if probe.stdout.strip() == "True":
            return python
    return sys.executable


def test_a_bare_venv_plans_a_bridge_recipe(tmp_path):
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheel"), str(REPO)], capture_output=True, text=True, timeout=300)
    if wheel.returncode != 0:
        pytest.skip(f"cannot build the wheel here (setuptools?): {wheel.stderr[-300:]}")
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}  # nothing of ours
    venv = tmp_path / "venv"
    subprocess.run([_python312(), "-m", "venv", str(venv)], check=True, timeout=300, env=bare)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                              str(tmp_path / "wheel"), "megatron-perf-toggles[bridge]"],
                             capture_output=True, text=True, timeout=300, env=bare)
    assert install.returncode == 0, install.stderr[-2000:]
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True,
                            env=bare)
    assert "megatron-perf-toggles" in {p["name"] for p in json.loads(listed.stdout)}
    assert {p["name"] for p in json.loads(listed.stdout)} <= {"megatron-perf-toggles", "pip", "setuptools"}
    env = clean_environ(bare,
                        HF_HUB_OFFLINE="1", no_proxy="*", http_proxy="http://0.0.0.0:9", https_proxy="http://0.0.0.0:9")
    started = time.monotonic()
    proc = subprocess.run([python, "-m", "megatron_perf_toggles", "explain", "--bridge-recipe", LLAMA,
                           "--world-size", "64", "--gpu", "h100", "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - started < 60
    record = json.loads(proc.stdout)
    assert record["target"]["world_size"] == 64 and record["decisions"]["gradient_accumulation_fusion"]["value"]
