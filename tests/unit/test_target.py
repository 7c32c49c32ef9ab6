"""What a dry run plans for: the GPU table, the world options, and stand-ins that are always undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO
from sandbox import clean_environ

from megatron_perf_toggles.errors import PerfTogglesError
from megatron_perf_toggles.runtime.machine import target

torch = pytest.importorskip("torch", reason="torch is not installed: device stand-ins not testable")


@pytest.mark.parametrize("name, vendor, arch, capability", [
    ("h100", "cuda", "sm_90", (9, 0)), ("B200", "cuda", "sm_100", (10, 0)), ("mi300x", "rocm", "gfx942", (9, 4)),
    ("sm_89", "cuda", "sm_89", (8, 9)), ("sm_120", "cuda", "sm_120", (12, 0)), ("gfx950", "rocm", "gfx950", (9, 5)),
])
def test_gpu_names_and_arches(name, vendor, arch, capability):
    gpu = target.gpu_named(name)
    assert (gpu.vendor, gpu.arch, gpu.capability) == (vendor, arch, capability)


def test_unknown_gpu_suggests_one():
    with pytest.raises(PerfTogglesError, match="did you mean 'mi355x'"):
        target.gpu_named("mi355")


@pytest.mark.parametrize("kwargs, size, per_node", [
    ({"world_size": 128}, 128, None), ({"nnodes": 16, "nproc_per_node": 8}, 128, 8), ({"nproc_per_node": 4}, 4, 4),
])
def test_world_options(kwargs, size, per_node):
    t = target.make_target(**kwargs, gpu="h100")
    assert (t.world_size, t.per_node) == (size, per_node)


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "at least 1"), ({"nnodes": 2}, "needs --nproc-per-node"),
    ({"world_size": 8, "nnodes": 2, "nproc_per_node": 8}, "contradicts"),
])
def test_bad_world_options(kwargs, words):
    with pytest.raises(PerfTogglesError, match=words):
        target.make_target(**kwargs)


def test_no_visible_gpu_plans_for_a_named_default_and_says_so():
    t = target.make_target(world_size=8, gpu_visible=False)
    assert t.gpu is not None and t.gpu.name == "h100" and "no GPU visible" in t.gpu_source
    assert target.make_target(gpu_visible=False, assumed_device="rocm").gpu.name == "mi300x"
    assert target.make_target(world_size=8, gpu_visible=True).gpu is None  # a GPU box: the real one


def test_stand_ins_answer_device_queries_and_are_undone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "5")
    before = {n: getattr(torch.cuda, n) for n in ("is_available", "get_device_capability", "get_device_properties")}
    versions = (torch.version.cuda, torch.version.hip)
    planned = target.make_target(nnodes=2, nproc_per_node=8, gpu="mi355x")
    with pytest.raises(SystemExit):  # a dry run ends in SystemExit: the stand-ins must still go
        with target.stand_ins(planned):
            assert torch.cuda.is_available() and torch.cuda.device_count() == 8
            assert torch.cuda.get_device_capability() == (9, 5)
            assert torch.cuda.get_device_properties(0).gcnArchName == "gfx950"
            assert torch.version.hip and torch.version.cuda is None
            assert (os.environ["WORLD_SIZE"], os.environ["RANK"]) == ("16", "0")
            raise SystemExit(0)
    assert all(getattr(torch.cuda, n) is fn for n, fn in before.items())
    assert (torch.version.cuda, torch.version.hip) == versions
    assert "WORLD_SIZE" not in os.environ and os.environ["RANK"] == "5"


def _launch(*argv, cwd):
    env = clean_environ()
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles.run", *argv], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=120)


def _one_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("[perf-toggles] error:"), proc.stderr
    return lines[0]


def test_launcher_refuses_a_shell_script_in_one_line(tmp_path):
    (tmp_path / "train.sh").write_text("#!/bin/bash\nset -e\ntorchrun pretrain_gpt.py $ARGS\n")
    line = _one_line(_launch("--dry-run", "train.sh", cwd=tmp_path))
    assert "not a Python script" in line and "bash" in line


def test_launcher_plan_options_need_a_dry_run(tmp_path):
    (tmp_path / "train.py").write_text("print('trained')\n")
    assert "add --dry-run" in _one_line(_launch("--world-size", "8", "train.py", cwd=tmp_path))
    assert "did you mean 'h200'" in _one_line(_launch("--dry-run", "--gpu", "h20", "train.py", cwd=tmp_path))


def test_launcher_one_line_when_the_tree_breaks_at_import(tmp_path):
    """As a tree that compiles GPU code at import does on a GPU build of torch without a GPU."""
    pkg = tmp_path / "megatron" / "training"
    pkg.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text("import torch\n[][0]  # as a load_inline without a device does\n")
    (tmp_path / "train.py").write_text("print('trained')\n")
    line = _one_line(_launch("--dry-run", "train.py", cwd=tmp_path))
    assert "IndexError" in line and "arguments.py:2" in line


@pytest.mark.parametrize(("platform", "nodes", "expected"), [
    ("linux", [], True),  # a laptop or CI runner: no GPU can be visible
    ("linux", ["/dev/dri", "/dev/null"], True),  # a display's GPU is not one torch can use
    ("linux", ["/dev/nvidiactl", "/dev/nvidia0"], False),  # NVIDIA's driver: ask torch
    ("linux", ["/proc/driver/nvidia"], False),  # its driver loaded, the nodes not made yet
    ("linux", ["/sys/module/nvgpu"], False),  # a Jetson's integrated GPU
    ("linux", ["/usr/bin/nvidia-modprobe"], False),  # a server whose driver loads when CUDA first asks
    ("linux", ["/dev/dxg"], False),  # WSL's GPU bridge
    ("linux", ["/dev/kfd", "/dev/dri"], False),  # ROCm
    ("linux", ["/sys/module/amdgpu"], False),
    ("darwin", [], False),  # another system: torch answers
])
def test_no_gpu_here_only_where_no_sign_of_a_gpu_driver_is(monkeypatch, platform, nodes, expected):
    from megatron_perf_toggles.runtime.machine import probe

    asked = []

    def exists(path):
        asked.append(path)
        return path in nodes

    monkeypatch.setattr(sys, "platform", platform)
    monkeypatch.setattr(os.path, "exists", exists)
    assert probe.no_gpu_here() is expected
    assert platform == "linux" or not asked


def test_no_gpu_driver_means_no_visible_gpu_without_importing_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")
    from megatron_perf_toggles.runtime.machine import probe

    monkeypatch.setattr(probe, "no_gpu_here", lambda: True)
    monkeypatch.setattr(target, "torch_module", lambda import_it=True: pytest.fail("torch was asked"))
    assert target._visible_gpu() is False
    assert "no GPU visible" in target.make_target(world_size=8).gpu_source
    assert "torch" not in sys.modules
    # a torch this process already has is asked, whatever the drivers say
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(target, "torch_module", lambda import_it=True: sys.modules["torch"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert target._visible_gpu() is True


def test_the_build_file_says_what_an_import_of_torch_says():
    from megatron_perf_toggles.runtime.machine import probe

    build = probe.torch_build()
    assert build == {"__version__": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip}


def test_a_build_file_that_is_not_plain_assignments_is_no_answer(tmp_path, monkeypatch):
    from importlib.machinery import ModuleSpec

    from megatron_perf_toggles.runtime.machine import probe

    package = tmp_path / "torch"
    package.mkdir()
    spec = ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(probe.importlib.util, "find_spec", lambda name: spec)
    (package / "version.py").write_text("__version__ = '9.1.0'\ncuda: str = '13.0'\nhip = None\n")
    assert probe.torch_build() == {"__version__": "9.1.0", "cuda": "13.0", "hip": None}
    (package / "version.py").write_text("__version__ = compute()\n")
    assert probe.torch_build() is None
    (package / "version.py").write_text("cuda = None\n")  # no version: not the file we know
    assert probe.torch_build() is None
    (package / "version.py").unlink()
    assert probe.torch_build() is None


@pytest.mark.parametrize(("entry", "says", "never"), [
    ("explain", "--gpu picks another", "MEGATRON_PERF_TOGGLES_PLAN"),
    ("launcher", "--gpu NAME before the script (or MEGATRON_PERF_TOGGLES_PLAN=:NAME) picks another", None),
    ("script", "MEGATRON_PERF_TOGGLES_PLAN=:NAME picks another", "--gpu"),
])
def test_no_visible_gpu_says_how_this_command_names_one(entry, says, never):
    """A torchrun launch or a patched checkout has no --gpu of its own: the plan said "--gpu picks
    another" there too; each command now says its own way."""
    planned = target.make_target(gpu_visible=False, entry=entry)
    assert planned.gpu_source == f"no GPU visible here; {says}"
    assert never is None or never not in planned.gpu_source
    assert target.from_environment({}, entry).gpu_source.endswith(says) or target._visible_gpu()


def test_a_world_torchrun_set_is_changed_with_torchrun():
    launch = target.make_target(gpu="h100", entry="launcher")
    assert launch.how_world({"WORLD_SIZE": "16"}) == "torchrun's --nnodes x --nproc-per-node"
    assert launch.how_world({}) == "--world-size N"
    assert target.make_target(world_size=16, gpu="h100", entry="launcher").how_world({"WORLD_SIZE": "16"}) == (
        "--world-size N")
    assert target.make_target(gpu="h100", entry="script").how_world({}) == "MEGATRON_PERF_TOGGLES_PLAN=N:GPU"
