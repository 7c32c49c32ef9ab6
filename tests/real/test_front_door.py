"""The front door: planning with no torch, the planned stack, the launch environment, the dry run's
one-screen summary, failing fast, a patched checkout planning as the launcher does, Megatron's
bare assertions, and ablate leaving out what a guard turns off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import launcher_cases as runs
import pytest
import tree_driver
from conftest import REPO, megatron_trees
from sandbox import clean_environ

from megatron_perf_toggles.core import launch_env
from megatron_perf_toggles.core.facts import PLANNED_STACKS, parse_assume
from megatron_perf_toggles.launcher.dry_run import assertion_site
from megatron_perf_toggles.runtime.machine import target as planned
from megatron_perf_toggles.runtime.machine.capabilities import for_plan
from megatron_perf_toggles.tools.llama3_8b import LLAMA3_8B_BF16
from megatron_perf_toggles.tools.planning import guarded_off

TREES_SKIP = "MEGATRON_LM_TREES is not set: set it to Megatron-LM checkouts (':'-separated) to run this"


def _env(**extra: str) -> dict[str, str]:
    env = clean_environ()
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _layout(tp: int, pp: int) -> list[str]:
    args = list(LLAMA3_8B_BF16)
    args[args.index("--tensor-model-parallel-size") + 1] = str(tp)
    args[args.index("--pipeline-model-parallel-size") + 1] = str(pp)
    return args


# --- a plan for another machine rests on its family's planned stack ---------------------------------


@pytest.mark.parametrize(("gpu", "vendor"), [("h100", "cuda"), ("mi355x", "rocm")])
def test_a_plan_for_another_gpu_rests_on_its_planned_stack(gpu: str, vendor: str) -> None:
    stack = parse_assume(PLANNED_STACKS[vendor])
    job = planned.make_target(world_size=64, gpu=gpu)
    with planned.stand_ins(job):
        caps = for_plan(None, target=job)
    assert caps.device == vendor and caps.te_version == stack["te_version"]
    assert caps.te_fused_qkv_rope and caps.wgrad_fallback and not caps.apex_fused_wgrad
    assert bool(caps.aiter_version) == (vendor == "rocm")
    assert caps.stack.startswith({"cuda": "NVIDIA: ", "rocm": "AMD: "}[vendor])
    from megatron_perf_toggles.launcher.summary import _stack

    assert "MEGATRON_PERF_TOGGLES_ASSUME" in _stack(caps)  # the dry run names the variable that changes it


def test_the_variable_changes_only_what_it_names_on_top_of_the_stack() -> None:
    job = planned.make_target(gpu="h100")
    with planned.stand_ins(job):
        caps = for_plan("apex,te=2.1", target=job)
    assert caps.apex_fused_wgrad and caps.te_version == "2.1" and not caps.te_fused_qkv_rope
    assert caps.wgrad_fallback  # from the stack: the variable did not name it


def test_a_plan_for_this_machine_keeps_what_is_detected_here() -> None:
    caps = for_plan(None)  # no target: this machine
    assert caps.stack == ""


def test_explain_runs_where_torch_cannot_be_imported() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_perf_toggles.tools.cli import main\n"
            "sys.exit(main(['explain']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    rope = next(line for line in done.stdout.splitlines() if line.startswith("fused_single_qkv_rope"))
    assert " on " in rope  # planned stack: TE with the kernel, not "Transformer Engine is not installed"
    # One header line names the planned stack; nothing of this machine's software (torch or not).
    stack = [line for line in done.stdout.splitlines() if line.startswith("Stack:")]
    assert len(stack) == 1 and "Transformer Engine" in stack[0]
    assert "torch" not in done.stdout.split("\n\n")[0].replace("torch wgrad fallback", "")


# --- the launch environment -------------------------------------------------------------------------


def test_model_parallelism_before_blackwell_needs_one_connection() -> None:
    args = {"tensor_model_parallel_size": 8, "context_parallel_size": 1}
    assert [v.name for v in launch_env.needed(args, 9, "2.20")] == ["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert launch_env.needed(args, 10, "2.20") == []  # Blackwell dropped the requirement
    assert launch_env.needed({**args, "use_megatron_fsdp": True}, 9, None) == []  # FSDP wants more, not one
    assert launch_env.needed({"tensor_model_parallel_size": 1, "context_parallel_size": 2}, None, None)


def test_other_variables_megatron_checks() -> None:
    assert [v.name for v in launch_env.needed({"deterministic_mode": True}, 9, None)] == ["NCCL_ALGO"]
    offload = {"fine_grained_activation_offloading": True}
    assert [v.name for v in launch_env.needed(offload, 9, "2.10")] == ["NVTE_CPU_OFFLOAD_V1"]
    assert launch_env.needed(offload, 9, "2.9") == []


def test_a_value_the_user_set_is_theirs() -> None:
    needed = launch_env.needed({"tensor_model_parallel_size": 2, "deterministic_mode": True}, 9, None)
    missing = launch_env.missing(needed, {"CUDA_DEVICE_MAX_CONNECTIONS": "4", "NCCL_ALGO": "Bogus"})
    assert [v.name for v in missing] == ["NCCL_ALGO"]  # a refused NCCL_ALGO is replaced for the plan


def test_arch_major() -> None:
    assert [launch_env.arch_major_of(a) for a in ("sm_90", "sm_100", "gfx942", None)] == [9, 10, 9, None]


# --- Megatron's bare assertions ------------------------------------------------------------------------


def test_a_bare_assert_is_reported_with_file_line_and_source() -> None:
    def check(world: int) -> None:
        assert world % 8 == 0

    with pytest.raises(AssertionError) as info:
        check(3)
    site = assertion_site(info.value)
    line = check.__code__.co_firstlineno + 1
    assert site == f"{__file__}:{line}: assert world % 8 == 0"


# --- failing fast -------------------------------------------------------------------------------------


@pytest.fixture
def megatron_that_must_not_load(tmp_path: Path) -> Path:
    """A ``megatron`` package that leaves a mark when imported, and a training script that imports it."""
    pkg = tmp_path / "megatron"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    (tmp_path / "train.py").write_text("import megatron\n")
    return tmp_path


@pytest.mark.parametrize("env", [
    {"FUSED_SINGLE_QKV_ROPE": "maybe"},
    {"MEGATRON_PERF_TOGGLES_PROFILE": "/no/such/profile.json"},
    {"MEGATRON_PERF_TOGGLES_PLAN": "64:h10"},
    {"MEGATRON_PERF_TOGGLES_PLAN": "sixty:h100"},
    {"MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT": "loud"},
    {"MEGATRON_PERF_TOGGLES_ASSUME": "tensorrt"},
], ids=lambda e: next(iter(e)))
def test_a_bad_setting_fails_before_megatron_is_imported(megatron_that_must_not_load: Path,
                                                         env: dict[str, str]) -> None:
    root = megatron_that_must_not_load
    full = _env(**env)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), str(root)])
    done = subprocess.run([sys.executable, "-m", "megatron_perf_toggles.run", "--dry-run", "train.py"], cwd=root,
                          env=full, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("[perf-toggles] error: ")
    assert not (root / "imported").exists()


@pytest.mark.parametrize("argv", [["--world-size", "0"], ["--gpu", "h10"]])
def test_a_bad_target_fails_before_megatron_is_imported(megatron_that_must_not_load: Path, argv: list[str]) -> None:
    root = megatron_that_must_not_load
    done = subprocess.run([sys.executable, "-m", "megatron_perf_toggles.run", "--dry-run", *argv, "train.py"],
                          cwd=root, env={**_env(), "PYTHONPATH": os.pathsep.join([str(REPO), str(root)])},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not (root / "imported").exists()


def test_plan_variable() -> None:
    assert planned.parse_plan("64:h100") == (64, "h100")
    assert planned.parse_plan("8") == (8, None) and planned.parse_plan(":mi355x") == (None, "mi355x")
    target = planned.from_environment({"MEGATRON_PERF_TOGGLES_PLAN": "64:mi355x"})
    assert target.world_size == 64 and target.gpu is not None and target.gpu.vendor == "rocm"
    assert "MEGATRON_PERF_TOGGLES_PLAN" in target.gpu_source


# --- ablate leaves out what a guard turns off ---------------------------------------------------------------


def test_guarded_toggles_are_found_before_any_dry_run(tmp_path: Path) -> None:
    script = tmp_path / "pretrain_gpt.py"  # not a checkout: planned against the recorded main surface
    script.write_text("")
    toggles = ("gradient_accumulation_fusion", "fused_single_qkv_rope")
    off = guarded_off(toggles, str(script), [*LLAMA3_8B_BF16, "--qk-layernorm"], None)
    assert list(off) == ["fused_single_qkv_rope"] and "--qk-layernorm" in off["fused_single_qkv_rope"]
    assert guarded_off(toggles, str(script), LLAMA3_8B_BF16, None) == {}


def test_ablate_dry_run_leaves_the_guarded_toggle_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_perf_toggles.tools.ablate import command as ablate

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    seen: list[dict[str, bool]] = []

    def resolver(script: str, args: list[str], arm: object, environ: dict[str, str], world: int | None = None):
        toggles = dict(arm.pinned)  # type: ignore[attr-defined]
        seen.append(toggles)
        return {"decisions": {d: {"value": v, "source": "env", "reason": ""} for d, v in toggles.items()},
                "effective_args": {**toggles, "train_iters": 10}}

    code = ablate.main(["--design", "headline", "--dry-run", "--out", str(tmp_path / "out"), str(script),
                        *LLAMA3_8B_BF16, "--qk-layernorm"], resolver=resolver)
    assert code == 0
    err = capsys.readouterr().err
    assert "left out fused_single_qkv_rope" in err and "--qk-layernorm" in err
    assert seen and all("fused_single_qkv_rope" not in arm for arm in seen)


# --- real Megatron: the done-when runs ---------------------------------------------------------------------


def _tree_params() -> list:
    trees = megatron_trees()
    return [pytest.param(str(t), id=t.name) for t in trees] or [
        pytest.param(None, id="no-trees", marks=pytest.mark.skip(reason=TREES_SKIP))]


def _has_fused_field(tree: str) -> bool:
    source = Path(tree, "megatron", "core", "transformer", "transformer_config.py").read_text()
    return "fused_single_qkv_rope" in source


def _check_summary(code: int, stdout: str, stderr: str, tree: str) -> None:
    assert code == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert len(lines) <= 60, stdout
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in stdout  # listed as launch environment
    assert any(line.startswith("stack:") and "planned" in line for line in lines)
    rope = next(line for line in lines if line.strip().startswith("fused_single_qkv_rope "))
    assert (" on " in rope) == _has_fused_field(tree), rope  # on under the planned stack, where Megatron has it
    record = json.loads(Path(next(line.split(": ", 1)[1] for line in lines
                                  if line.startswith("full record (JSON): "))).read_text())
    assert record["target"]["world_size"] == 64
    # the layout planned (TP 8 x PP 4 of 64 ranks), on the screen and in the record
    assert any(line.startswith("layout:") and "TP 8, PP 4, CP 1, EP 1, DP 2 (world 64)" in line for line in lines), stdout
    assert (record["layout"]["tp"], record["layout"]["pp"], record["layout"]["dp"]) == (8, 4, 2)
    # each decision's memory change, as the record has it (issue: every plan shows memory)
    assert any(line.split() == ["toggle", "value", "source", "peak", "memory", "reason"] for line in lines)
    # each row is its toggle's share of the planned peak's change, and the shares add up to it; PP 4:
    # the first stage peaks, so the cross entropy's logits (the last stage's) change nothing there,
    # and its row says where its own change is
    memory = record["memory"]
    shares = [d["peak_memory_delta_mb"] for d in record["decisions"].values() if d.get("peak_memory_delta_mb")]
    assert sum(shares) == pytest.approx(memory["planned_peak_mb"] - memory["stock_peak_mb"], abs=1), memory
    assert memory["planned_peak_at"].startswith("on the first pipeline stage"), memory
    ce = next(line for line in lines if line.strip().startswith("cross_entropy_loss_fusion "))
    assert record["decisions"]["cross_entropy_loss_fusion"]["peak_memory_delta_mb"] == 0
    assert "no change in peak memory (its " in ce and " is on the last stage)" in ce, ce
    assert any(line.strip().startswith("memory: stock's estimated peak") for line in lines)


# No variables set: the plugin's own are not in a worker's environment; these go too.
SUMMARY = {"unset": ["CUDA_DEVICE_MAX_CONNECTIONS", "MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT"]}


def _build(tree: str, work: Path) -> list[dict]:
    """On each tree's worker (tests/tree_driver.py): the 64-rank plan through the launcher, and
    through a patched checkout (the launcher suite's patched copy), once well and once with a bad value."""
    script = str(runs.patched(tree) / "pretrain_gpt.py")
    patched = {**SUMMARY, "mode": "script", "env": {"MEGATRON_PERF_TOGGLES_DRY_RUN": "1",
               "MEGATRON_PERF_TOGGLES_PLAN": "64:h100"},
               "argv": [script, "--extra-args-provider", "megatron_perf_toggles", *_layout(8, 4)]}
    return [
        {"tree": tree, "cases": [{**SUMMARY, "name": "cpu-plan", "mode": "launcher",
                                  "argv": ["--dry-run", "--world-size", "64", "--gpu", "h100",
                                           f"{tree}/pretrain_gpt.py", *_layout(8, 4)]}]},
        {"tree": str(runs.patched(tree)), "cases": [
            {**patched, "name": "patched-plan"},
            {**patched, "name": "patched-bad", "env": {**patched["env"], "FUSED_SINGLE_QKV_ROPE": "maybe"}}]},
    ]


SUITE = tree_driver.SESSION.suite("front_door", _build)


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", _tree_params())
def test_a_64_rank_h100_plan_from_a_cpu_machine(tree: str) -> None:
    r = tree_driver.SESSION.results(SUITE, tree)["cpu-plan"]
    assert r["error"] is None, r["error"]
    _check_summary(r["code"], r["stdout"], r["stderr"], tree)


def _processes_of_their_own(tree: str) -> dict[str, subprocess.CompletedProcess[str]]:
    """The README's dry run, a patched checkout's ``python pretrain_gpt.py`` (well, then with a bad
    value) and ``ablate --design headline --dry-run``, each as users run them: processes of their
    own, nothing set. A background job (tests/tree_driver.py): they run beside the unit tests."""
    work = tree_driver.SESSION.tempdir("ptt-front-door-")
    env = {k: v for k, v in tree_driver.driver_env().items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    plain = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), tree])}

    def run(argv: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=work, env=environ, capture_output=True, text=True, timeout=600)

    copy = runs.patched(tree)
    patched_env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(copy)]), "MEGATRON_PERF_TOGGLES_DRY_RUN": "1",
                   "MEGATRON_PERF_TOGGLES_PLAN": "64:h100"}
    patched_argv = [sys.executable, str(copy / "pretrain_gpt.py"), "--extra-args-provider", "megatron_perf_toggles",
                    *_layout(8, 4)]
    return {
        "readme": run([sys.executable, "-m", "megatron_perf_toggles.run", "--dry-run", "--world-size", "64", "--gpu",
                       "h100", f"{tree}/pretrain_gpt.py", *_layout(8, 4)], plain),
        "patched": run(patched_argv, patched_env),
        "patched-bad": run(patched_argv, {**patched_env, "FUSED_SINGLE_QKV_ROPE": "maybe"}),
        "ablate": run([sys.executable, "-m", "megatron_perf_toggles", "ablate", "--design", "headline", "--dry-run",
                       "--out", str(work / "out"), f"{tree}/pretrain_gpt.py", *_layout(1, 1), "--qk-layernorm"], plain),
    }


NEWEST = [str(t) for t in megatron_trees()[-1:]]
PROCESSES = tree_driver.SESSION.background("front-door-processes", lambda: _processes_of_their_own(NEWEST[0])) if NEWEST else ""


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", _tree_params()[-1:])
def test_the_entry_points_as_processes_of_their_own(tree: str) -> None:
    """On the newest tree, as users run them (the per-tree tests run the same on the trees' workers)."""
    found = tree_driver.SESSION.outcome(PROCESSES)
    for name in ("readme", "patched"):
        _check_summary(found[name].returncode, found[name].stdout, found[name].stderr, tree)
    bad = found["patched-bad"]
    errors = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and errors and errors == [line for line in errors if line.startswith("[perf-toggles] error: ")]
    ablate = found["ablate"]
    assert ablate.returncode == 0, ablate.stderr[-3000:]
    assert "[ablate] left out fused_single_qkv_rope: a guard turns it off for this model (--qk-layernorm" in ablate.stderr
    assert "all-on (" not in ablate.stdout and "FUSED_SINGLE_QKV_ROPE" not in ablate.stdout


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", _tree_params())
def test_a_patched_checkout_plans_a_64_rank_h100_job(tree: str) -> None:
    found = tree_driver.SESSION.results(SUITE, tree)
    done, bad = found["patched-plan"], found["patched-bad"]
    assert done["error"] is None and bad["error"] is None, done["error"] or bad["error"]
    _check_summary(done["code"], done["stdout"], done["stderr"], tree)
    errors = bad["stderr"].strip().splitlines()
    assert bad["code"] == 2 and errors and errors == [line for line in errors if line.startswith("[perf-toggles] error: ")]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", _tree_params()[-1:])
def test_ablate_headline_dry_run_on_a_qk_layernorm_model(tree: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``ablate --design headline --dry-run`` as its ``main``, each arm's dry run on the tree's worker."""
    from megatron_perf_toggles.tools.ablate import command as ablate

    code = ablate.main(["--design", "headline", "--dry-run", "--out", str(tmp_path / "out"), f"{tree}/pretrain_gpt.py",
                        *_layout(1, 1), "--qk-layernorm"], resolver=runs.arm_resolver(tree))
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "[ablate] left out fused_single_qkv_rope: a guard turns it off for this model (--qk-layernorm" in err
    assert "all-on (" not in out and "FUSED_SINGLE_QKV_ROPE" not in out


def test_explain_lists_the_launch_environment_as_the_dry_run_does() -> None:
    tp8 = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "explain", "--json", "--world-size", "32", "--",
                          *_layout(8, 4)], capture_output=True, text=True, env=_env(), timeout=120)
    assert tp8.returncode == 0, tp8.stderr
    names = [v["name"] for v in json.loads(tp8.stdout)["launch_environment"]]
    assert names == ["CUDA_DEVICE_MAX_CONNECTIONS"]
    b200 = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "explain", "--json", "--gpu", "b200",
                           "--world-size", "32", "--", *_layout(8, 4)], capture_output=True, text=True, env=_env(),
                          timeout=120)
    assert json.loads(b200.stdout)["launch_environment"] == []  # Blackwell dropped the requirement


def test_a_rejection_for_a_world_of_one_says_how_to_name_the_job() -> None:
    from megatron_perf_toggles.launcher.dry_run import _rejection

    text = str(_rejection(AssertionError("world size (1) is not divisible by 8"), None, "/tmp/x/megatron.log"))
    assert "Megatron's output: /tmp/x/megatron.log" in text and "--world-size N or MEGATRON_PERF_TOGGLES_PLAN" in text
    planned_job = planned.make_target(world_size=64, gpu="h100")
    assert "--world-size N" not in str(_rejection(AssertionError("world size (64) is not divisible"), planned_job, None))


def test_the_first_screen_fits_and_warns_of_nothing() -> None:
    """A newcomer's first command, with no torch to import: the built-in example fits the GPU it plans
    for, so no warning; at most 31 lines of at most 100 columns (30 until the plan's layout line,
    which every plan shows since issue 50)."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "from megatron_perf_toggles.tools.cli import main\n"
            "sys.exit(main(['explain']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**_env(), "COLUMNS": "100"}, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 31 and max(map(len, lines)) <= 100, done.stdout
    assert "warning" not in done.stdout.lower() and not done.stderr.strip(), done.stdout + done.stderr
    assert "stock fits, plan fits" in done.stdout
