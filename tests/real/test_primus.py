"""The Primus front end against real Primus code: its YAML loader, its shipped defaults, its patch runner.

Primus checkouts come from ``PRIMUS_TREES`` (':'-separated; lay one out with
``tests/export_primus.sh GIT_DIR REF DEST``). Each tree's experiment config is loaded by Primus's
own ``load_primus_config`` in a subprocess (Primus and the plugin share no module names, but each
tree needs its own interpreter), the plugin's ``build_args`` patch runs through Primus's
``run_patches``, and the namespace comes back as JSON. Skipped loudly when no tree is given.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import pytest
import tree_driver
from conftest import REPO

from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.runtime.machine.capabilities import effective_assume
from megatron_perf_toggles.runtime.machine.target import make_target

BF16 = "examples/megatron/configs/MI355X/llama3.1_8B-BF16-pretrain.yaml"
MI355X_BF16 = BF16
MI355X_8 = make_target(8, gpu="mi355x")
MXFP4 = "examples/megatron/configs/MI355X/llama3.1_8B-MXFP4-pretrain.yaml"
# Every toggle of a dense model (the registry's), and the precision setting Primus's FP4 recipes read.
DESTS = (*(t.dest for t in TOGGLES if t.scope == "all"), "first_last_layers_bf16")

# Runs inside the subprocess, with the Primus tree and this repository on sys.path.
DRIVER = r"""
import contextlib, io, json, sys
from pathlib import Path
from types import SimpleNamespace
from primus.core.config.primus_config import load_primus_config, get_module_config
from primus.core.patches import run_patches
from megatron_perf_toggles import primus as plugin
from megatron_perf_toggles.core.facts import Capabilities
from megatron_perf_toggles.frontends import adapter as frontend

case = json.loads(sys.argv[1])
cfg = load_primus_config(Path(case["config"]))
ns = SimpleNamespace(**vars(get_module_config(cfg, "pre_trainer").params))
dests = case["dests"]
for name, value in case.get("set", {}).items():  # what the experiment file would set (a log directory)
    setattr(ns, name, value)
before = {d: getattr(ns, d, None) for d in dests}
caps = Capabilities(megatron=frontend.facts_for_version(case["megatron"]), te_version="2.8", te_fused_qkv_rope=True,
                    te_cross_entropy=True, apex_fused_wgrad=True, device="rocm")
# Through Primus's own patch runner: the registered patch, with the planned machine's capabilities.
plugin.build_args_patch = lambda ctx: plugin.apply_to_namespace(ctx.extra["backend_args"], environ=case["env"],
                                                                 capabilities=caps)
plugin.register()
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out):
        applied = run_patches(backend="megatron", phase="build_args", extra={"backend_args": ns},
                              enabled_ids=[plugin.PATCH_ID], stop_on_error=True)
except Exception as error:
    print(json.dumps({"error": f"{type(error).__name__}: {error}"})); sys.exit(0)
print(json.dumps({"applied": applied, "before": before, "after": {d: getattr(ns, d, None) for d in dests},
                  "tensorboard_dir": getattr(ns, "tensorboard_dir", None),
                  "records": getattr(ns, "perf_toggles", None), "defaults": plugin.primus_defaults()}, default=str))
"""


def primus_trees() -> list[Path]:
    return [Path(p) for p in os.environ.get("PRIMUS_TREES", "").split(os.pathsep) if p.strip()]


TREES = primus_trees()
if not TREES:  # one skip line for the whole suite, not one per test
    pytest.skip("Primus suite: PRIMUS_TREES is not set; lay a tree out with tests/export_primus.sh GIT_DIR REF "
                "DEST and point PRIMUS_TREES at it", allow_module_level=True)


@cache
def run(tree: Path, config: str, megatron: str = "0.18.2", tensorboard: str | None = None, **env: str) -> dict:
    case = {"config": str(tree / config), "dests": DESTS, "megatron": megatron, "env": env,
            "set": {"tensorboard_dir": tensorboard} if tensorboard else {}}
    pythonpath = os.pathsep.join((str(tree), str(REPO)))
    with tempfile.TemporaryDirectory(prefix="primus-case-") as scratch:  # Primus's loader makes ./output there
        proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(case)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": pythonpath}, timeout=300, cwd=scratch)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"Primus driver failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    assert "error" not in result, result.get("error")
    return result


@pytest.fixture(params=TREES, ids=[t.name for t in TREES])
def tree(request) -> Path:
    return request.param


def test_primus_base_defaults_are_off(tree):
    defaults = run(tree, BF16)["defaults"]
    # The facts the issue rests on: Primus ships these off.
    assert defaults["ddp_average_in_collective"] is False and defaults["grad_reduce_in_bf16"] is False
    assert defaults["cross_entropy_loss_fusion"] is False


def test_mi355x_llama3_gets_the_safe_toggles_on(tree):
    r = run(tree, BF16)
    assert r["applied"] == 1
    assert r["before"]["ddp_average_in_collective"] is False and r["before"]["grad_reduce_in_bf16"] is False
    assert r["after"]["ddp_average_in_collective"] is True and r["after"]["grad_reduce_in_bf16"] is True
    assert r["after"]["fused_single_qkv_rope"] is True  # Llama: RoPE without q/k norm
    assert r["records"]["grad_reduce_in_bf16"]["source"] == "default"
    # The experiment's own choice (fusion off) stands, as a configured value.
    assert r["after"]["gradient_accumulation_fusion"] is r["before"]["gradient_accumulation_fusion"] is False
    assert r["records"]["gradient_accumulation_fusion"]["source"] == "config"
    # ns.perf_toggles is the argparse path's record: each toggle with its memory change (None: unknown).
    assert all("peak_memory_delta_mb" in r["records"][d] for d in DESTS if d != "first_last_layers_bf16")


@pytest.mark.parametrize("megatron, expected", [("0.18.2", "native"), ("0.18.0", "te")])
def test_te_cross_entropy_from_the_experiment(tree, megatron, expected):
    r = run(tree, BF16, megatron)
    assert r["before"]["cross_entropy_fusion_impl"] == "te"
    assert r["after"]["cross_entropy_fusion_impl"] == expected


def test_switched_off_leaves_primus_values(tree):
    r = run(tree, BF16, MEGATRON_PERF_TOGGLES="0")
    present = {d for d, v in r["before"].items() if v is not None}  # the rest Primus fills with Megatron's defaults
    assert present >= {"ddp_average_in_collective", "grad_reduce_in_bf16", "cross_entropy_fusion_impl"}
    assert {d: r["after"][d] for d in present} == {d: r["before"][d] for d in present}


def test_switched_off_labels_each_value_by_where_primus_takes_it(tree):
    """Off, a value nobody set is Primus's own default where its YAML files declare one (its base
    trainer turns bf16 gradient reduction off), Megatron's otherwise; one the experiment or model file
    set keeps its YAML key (the config tier). None is called Megatron's default that is Primus's."""
    r = run(tree, BF16, MEGATRON_PERF_TOGGLES="0")
    defaults, records = r["defaults"], r["records"]
    dense = [d for d in DESTS if d in records]  # the MoE toggles of a dense model keep stock's value, not this label
    by_primus = [d for d in dense if d in defaults and records[d]["source"] == "default"]
    assert "grad_reduce_in_bf16" in by_primus and "ddp_average_in_collective" in by_primus
    for dest in by_primus:
        value = str(defaults[dest]).lower()
        assert records[dest]["reason"] == f"MEGATRON_PERF_TOGGLES=0: Primus's default (YAML key {dest}: {value})"
    for dest in (d for d in dense if d not in defaults and records[d]["source"] == "default"):
        assert records[dest]["reason"] == "MEGATRON_PERF_TOGGLES=0: Megatron's own default", dest
    gaf = records["gradient_accumulation_fusion"]  # the experiment's own choice
    assert gaf["source"] == "config" and "YAML key gradient_accumulation_fusion: false" in gaf["reason"]


def test_switched_off_leaves_the_log_directory_as_the_experiment_gives_it(tree):
    assert run(tree, BF16, tensorboard="/tmp/primus-tb")["tensorboard_dir"] == "/tmp/primus-tb/bf16"
    assert run(tree, BF16, tensorboard="/tmp/primus-tb", MEGATRON_PERF_TOGGLES="0")["tensorboard_dir"] == "/tmp/primus-tb"


def test_mxfp4_guard_keeps_the_bf16_gradient_buffer(tree):
    r = run(tree, MXFP4, GRAD_REDUCE_IN_BF16="0")
    assert r["before"]["gradient_accumulation_fusion"] is True
    d = r["records"]["grad_reduce_in_bf16"]
    assert (r["after"]["grad_reduce_in_bf16"], d["source"]) == (True, "guard")
    assert "mxfp4" in d["reason"]
    # mxfp4 trains every layer in FP4 unless selection is asked for.
    assert r["after"]["first_last_layers_bf16"] is False


def test_pth_hook_registers_when_primus_imports_its_patches(tree):
    code = ("import sys, megatron_perf_toggles.primus_hook\n"
            "assert 'primus' not in sys.modules and 'megatron_perf_toggles.primus' not in sys.modules\n"
            "assert 'megatron_perf_toggles.frontends.primus.public' not in sys.modules\n"
            "from primus.core.patches.patch_registry import PatchRegistry\n"
            "p = PatchRegistry.get('megatron_perf_toggles.decisions')\n"
            "import pkgutil, primus.core.patches as m\n"
            "assert m.__loader__.is_package(m.__name__) and pkgutil.get_data(m.__name__, '__init__.py')\n"
            "print(p.backend, p.phase, p.priority)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join((str(tree), str(REPO)))})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["megatron", "build_args", "90"]
    assert "already registered" not in proc.stdout + proc.stderr  # registered once


# --- the whole job on Primus's own code path (tests/primus_driver.py) -----------------------------

JOB_DESTS = ("fused_single_qkv_rope", "grad_reduce_in_bf16", "cross_entropy_loss_fusion")


def _megatron_tree() -> str | None:
    trees = [t for t in tree_driver.SESSION.environ.get("MEGATRON_LM_TREES", "").split(os.pathsep) if t.strip()]
    return next((t for t in trees if Path(t).name == "main"), trees[-1] if trees else None)


def primus_jobs(tree: Path, jobs: list[dict], env: dict | None = None) -> tuple[subprocess.CompletedProcess, list]:
    """Jobs run one after another in one process, as Primus's runtime runs a job (see the driver)."""
    megatron = _megatron_tree()
    if megatron is None:
        pytest.skip("Primus jobs need a Megatron-LM tree: set MEGATRON_LM_TREES")
    pytest.importorskip("loguru", reason="Primus's logger needs loguru (pip install loguru)")
    case = {"megatron": megatron, "jobs": [{"dests": JOB_DESTS, **job, "config": str(tree / job["config"])}
                                           for job in jobs]}
    with tempfile.TemporaryDirectory(prefix="primus-job-") as scratch:  # Primus writes ./output there
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "primus_driver.py"), json.dumps(case)],
                              capture_output=True, text=True, timeout=600, cwd=scratch,
                              env={**tree_driver.SESSION.environ, **(env or {}),
                                   "PYTHONPATH": os.pathsep.join((str(tree), str(REPO)))})
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc, results


def _refusal(tree: Path) -> tuple[subprocess.CompletedProcess, list]:
    return primus_jobs(tree, [{"config": BF16}], env={"GRAD_REDUCE_IN_BF16": "perhaps"})


def test_a_refusal_stops_the_primus_job_at_validate_args_with_one_line(tree):
    # Primus logs and swallows what a build_args patch raises; the refusal must still stop the job,
    # where Primus's own checks do (Megatron's validate_args as Primus wraps it), exit status 2.
    proc, results = tree_driver.SESSION.outcome(JOBS[tree]["refusal"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert results == []  # the job did not get past validation
    ours = [line for line in proc.stderr.splitlines() if "[perf-toggles]" in line]
    assert len(ours) == 1 and ours[0].startswith("[perf-toggles] error: GRAD_REDUCE_IN_BF16='perhaps'"), ours
    assert "EnvValueError" not in proc.stderr  # no traceback of ours (Primus logs its own patches' failures)


EXPLAIN = r"""
import sys
from megatron_perf_toggles.tools import cli
for extra in (["--json"], []):
    code = cli.main(["explain", *sys.argv[1:], *extra])
    print(f"=== exit {code}", flush=True)
"""


def _explain(tree: Path) -> subprocess.CompletedProcess:
    megatron = _megatron_tree()
    if megatron is None:
        pytest.skip("explain --primus-config needs a Megatron-LM tree: set MEGATRON_LM_TREES")
    env = {k: v for k, v in tree_driver.SESSION.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    with tempfile.TemporaryDirectory(prefix="primus-explain-") as scratch:
        return subprocess.run([sys.executable, "-c", EXPLAIN, "--primus-config", str(tree / MI355X_BF16), "--megatron",
                               megatron, "--world-size", "8", "--gpu", "mi355x"], capture_output=True, text=True,
                              timeout=600, cwd=scratch, env={**env, "COLUMNS": "100", "PYTHONPATH": str(REPO)})


def test_explain_primus_config_plans_what_the_patch_decides(tree):
    # An 8-GPU MI355X job planned on this CPU machine, and the same experiment through Primus's own
    # code path where that job runs (the planned stack of an MI355X, as MEGATRON_PERF_TOGGLES_ASSUME
    # names it there; WORLD_SIZE 8).
    proc = tree_driver.SESSION.outcome(JOBS[tree]["explain"])
    record_text, summary, _ = proc.stdout.split("=== exit ")[0], *proc.stdout.split("=== exit ")[1:]
    assert proc.stdout.count("=== exit 0") == 2, proc.stderr[-3000:]
    record = json.loads(record_text)
    lines = summary.splitlines()[1:]
    assert len(lines) <= 50 and max(len(line) for line in lines) <= 100, summary
    assert "world 8 (--world-size 8), mi355x" in summary
    patched = job_results(tree)[1][3]
    assert record["decisions"] == patched["records"]  # value, source, reason and memory, toggle by toggle
    assert record["decisions"]["grad_reduce_in_bf16"]["value"] is True
    # Reasons in Primus's words: the YAML keys, not Megatron's flags.
    reason = record["decisions"]["cross_entropy_fusion_impl"]["reason"]
    assert "YAML key cross_entropy_loss_fusion" in reason and "--" not in reason
    assert "YAML key gradient_accumulation_fusion: false" in record["decisions"]["gradient_accumulation_fusion"]["reason"]


# Primus 26.4 and 26.5 (main and the v26.3-v26.5.1 tags) pin Megatron-LM main of 2026-03-06 (facts of Primus's history).
PINNED = {"26.4": "d3528a21301db2d12e92912b3ec025dc8a2ed4d6", "26.5": "d3528a21301db2d12e92912b3ec025dc8a2ed4d6"}


def _offline(tree: Path) -> list[subprocess.CompletedProcess]:
    """explain --primus-config with no Megatron-LM anywhere (the checkout has no third_party/), on the
    surface of Primus's pin and, in a second process, on main's (``--megatron-version main``)."""
    env = {k: v for k, v in tree_driver.SESSION.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    env.update(PYTHONPATH=os.pathsep.join((str(tree), str(REPO))))
    argv = [sys.executable, "-m", "megatron_perf_toggles", "explain", "--primus-config", str(tree / MI355X_BF16),
            "--world-size", "8", "--gpu", "mi355x", "--json"]
    with tempfile.TemporaryDirectory(prefix="primus-offline-") as scratch:
        return [subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=600, cwd=scratch, env=env)
                for extra in ([], ["--megatron-version", "main"])]


def test_without_megatron_primus_plans_on_the_surface_of_the_megatron_it_pins(tree):
    from megatron_perf_toggles.tools.surfaces import replay

    text = (tree / "primus" / "__init__.py").read_text()
    version = next((v for v in PINNED if f'__version__ = "{v}"' in text), None)
    if version is None or (tree / "third_party" / "Megatron-LM" / "megatron").is_dir():
        pytest.skip(f"{tree.name}: a Primus whose pin is no fixture here, or a checkout with its Megatron-LM")
    pinned, on_main = tree_driver.SESSION.outcome(JOBS[tree]["offline"])
    assert pinned.returncode == 0 and on_main.returncode == 0, (pinned.stderr + on_main.stderr)[-3000:]
    name = next(n for n in replay.available() if replay.load_surface(n).get("commit") == PINNED[version])
    record, main = json.loads(pinned.stdout), json.loads(on_main.stdout)
    assert f"recorded surface {name!r}" in record["megatron"] and "the commit Primus pins" in record["megatron"]
    assert "recorded surface 'main'" in main["megatron"]
    # The difference matters: main asserts that TE's cross-entropy fusion is off (stability), the pin
    # does not, so the experiment's own `cross_entropy_fusion_impl: te` stands on the pin only.
    facts = {n: replay.load_surface(n)["facts"]["asserts_te_cross_entropy"] for n in (name, "main")}
    assert facts == {name: False, "main": True}
    ours, theirs = record["decisions"]["cross_entropy_fusion_impl"], main["decisions"]["cross_entropy_fusion_impl"]
    assert (ours["value"], ours["source"]) == ("te", "config") and "YAML key cross_entropy_fusion_impl" in ours["reason"]
    assert (theirs["value"], theirs["source"]) == ("native", "guard")


def job_results(tree: Path) -> tuple[subprocess.CompletedProcess, tuple]:
    return tree_driver.SESSION.outcome(JOBS[tree]["jobs"])


def _jobs(tree: Path) -> tuple[subprocess.CompletedProcess, tuple]:
    """Primus's code path, four jobs in one process (each started as a fresh process would be)."""
    assume = {"MEGATRON_PERF_TOGGLES_ASSUME": "te=2.8,rocm"}  # the planned machine's TE: fused RoPE on
    planned = {"WORLD_SIZE": "8", "MEGATRON_PERF_TOGGLES_ASSUME": effective_assume(None, MI355X_8)}
    proc, results = primus_jobs(tree, [
        {"config": BF16, "env": assume, "overrides": {"save": "checkpoints"}, "rank_check": True},  # saves under Primus's output
        # The next launch loads what the first saved (iteration 100), with one toggle changed.
        {"config": BF16, "resume": 100, "env": {**assume, "CROSS_ENTROPY_LOSS_FUSION": "0"},
         "overrides": {"save": "checkpoints"}},
        # Gated attention set after the plan (no guard saw it): Megatron's TransformerConfig rejects
        # fused single-QKV RoPE with it, and the net backs the plugin default off.
        {"config": BF16, "env": assume, "transformer_config": True,
         "late": {"attention_output_gate": True, "apply_rope_fusion": False}},
        # The 8-GPU MI355X job explain plans (test_explain_primus_config_plans_what_the_patch_decides).
        {"config": MI355X_BF16, "env": planned},
    ])
    assert proc.returncode == 0 and len(results) == 4, proc.stderr[-3000:]
    return proc, tuple(results)


def test_primus_job_resume_history_rank_check_and_safety_net(tree):
    _, (first, resumed, late, _) = job_results(tree)
    assert not [m for m in first["messages"] if m.startswith("resuming from")]
    warning = [m for m in resumed["messages"] if m.startswith("resuming from")]
    assert warning and "cross_entropy_loss_fusion on -> off" in warning[0]
    assert first["fingerprint"]["toggles"] == {d: r["value"] for d, r in first["records"].items()}
    assert first["rank_check"] == {"armed": True, "checked": True}
    assert late["planned"]["fused_single_qkv_rope"] is True
    d = late["records"]["fused_single_qkv_rope"]
    assert (d["value"], d["source"]) == (False, "guard") and "TransformerConfig rejected the plugin default" in d["reason"]


# The three processes start with the session's workers, beside the unit tests (tests/tree_driver.py).
JOBS = {tree: {name: tree_driver.SESSION.background(f"primus-{name}-{tree.name}", functools.partial(job, tree),
                                                    real=False)
               for name, job in (("jobs", _jobs), ("refusal", _refusal), ("explain", _explain), ("offline", _offline))}
        for tree in TREES}
