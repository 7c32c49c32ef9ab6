"""From a bare venv on a CPU box: ``pip install '.[bridge]'`` / ``'.[primus]'`` is all explain needs.

The package is built into a wheel, installed with its ``bridge`` extra into a fresh venv (Python
3.12 where one is found, as Bridge 0.4-0.6 need; else this interpreter) that has nothing else: no
torch, no Megatron, no Bridge, no Transformer Engine; then the issue's command plans Llama-3-8B
for 64 H100s with no network, within a minute. With the ``primus`` extra (loguru and PyYAML, from
the package registry: skipped, saying so, where it cannot be reached) and a Primus checkout on
PYTHONPATH without its Megatron submodule, an MI355X experiment plans for 8 GPUs the same way, on
the recorded surface of Megatron.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, last_line
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


def _setuptools_here() -> bool:
    """Whether this interpreter has the build backend pyproject.toml names (setuptools >= 61): a
    Python 3.12 venv has no setuptools unless something installs it (the test extra does)."""
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(p) for p in version.split(".")[:1] if p.isdigit()) >= (61,)


def _wheel(tmp_path: Path) -> Path:
    """The package built into a wheel. With setuptools here, without pip's build isolation (no
    network needed), so a failure is the package's and fails the test; without it, in pip's
    isolated build environment, which fetches setuptools from the package index: where that cannot
    be reached the test is skipped, saying so."""
    out = tmp_path / "wheel"
    offline = _setuptools_here()
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            *(["--no-build-isolation"] if offline else []), "-w", str(out), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    if wheel.returncode != 0 and not offline:
        pytest.skip("cannot build the wheel here: this Python has no setuptools>=61 (pip install -e '.[test]' "
                    f"installs it), and pip's isolated build could not get it: {last_line(wheel.stderr)}")
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    return out


def _bare_venv(tmp_path: Path, extra: str) -> tuple[str, dict[str, str]]:
    """A fresh venv with the package and ``extra``'s dependencies alone; its python and a clean environment."""
    wheel = _wheel(tmp_path)
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}  # nothing of ours
    venv = tmp_path / "venv"
    subprocess.run([_python312(), "-m", "venv", str(venv)], check=True, timeout=300, env=bare)
    python = str(venv / "bin" / "python")
    offline = ["--no-index"] if extra == "bridge" else []  # the bridge extra needs nothing from the registry
    install = subprocess.run([python, "-m", "pip", "install", "-q", *offline, "--find-links", str(wheel),
                              f"megatron-perf-toggles[{extra}]"], capture_output=True, text=True, timeout=300, env=bare)
    if install.returncode != 0 and not offline:
        pytest.skip(f"the package registry is not reachable for the {extra} extra: {last_line(install.stderr)}")
    assert install.returncode == 0, install.stderr[-2000:]
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True,
                            env=bare)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "megatron-perf-toggles" in names and not names & {"torch", "megatron-core", "megatron-bridge"}, names
    return python, bare


def test_a_bare_venv_plans_a_bridge_recipe(tmp_path):
    python, bare = _bare_venv(tmp_path, "bridge")
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


def test_a_bare_venv_plans_a_primus_experiment(tmp_path):
    trees = [t for t in os.environ.get("PRIMUS_TREES", "").split(os.pathsep) if t]
    if not trees:
        pytest.skip("set PRIMUS_TREES to a Primus checkout (tests/export_primus.sh lays one out)")
    root = Path(trees[-1])
    config = root / "examples" / "megatron" / "configs" / "MI355X" / "llama3.1_8B-BF16-pretrain.yaml"
    python, bare = _bare_venv(tmp_path, "primus")
    env = clean_environ(bare, HF_HUB_OFFLINE="1", PYTHONPATH=str(root), http_proxy="http://0.0.0.0:9",
                        https_proxy="http://0.0.0.0:9")
    started = time.monotonic()
    proc = subprocess.run([python, "-m", "megatron_perf_toggles", "explain", "--primus-config", str(config),
                           "--world-size", "8", "--gpu", "mi355x", "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - started < 60
    record = json.loads(proc.stdout)
    assert "recorded surface" in record["megatron"] and record["target"]["gpu"]["arch"] == "gfx950"
    assert "the commit Primus pins" in record["megatron"]  # its pin's surface, not the newest recorded one
    assert record["decisions"]["grad_reduce_in_bf16"]["value"] is True  # the plugin's default, as Primus leaves it
