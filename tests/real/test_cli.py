"""The megatron-perf-toggles command: explain, flags, doctor, on a machine without Megatron."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tree_driver
from conftest import REPO, megatron_trees
from sandbox import clean_environ

from megatron_perf_toggles.core.facts import Capabilities
from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.tools import cli


def run_cli(*argv, env=None, timeout=120):
    base = clean_environ(drop=("PYTHONPATH", "COLUMNS"))
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles", *argv], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO, timeout=timeout)


@pytest.mark.parametrize("columns", [60, 80, 100, 132])
def test_explain_fits_the_terminal_and_a_pipe_gets_whole_lines(columns):
    """Every line fits COLUMNS (a terminal's width), doctor's too; each reason is all there, word
    for word. Piped (no COLUMNS, not a terminal), each toggle's reason stays on its row's line."""
    wrapped = run_cli("explain", env={"COLUMNS": str(columns)}).stdout
    whole = run_cli("explain").stdout
    assert max(map(len, wrapped.splitlines())) <= columns
    doctor = run_cli("doctor", env={"COLUMNS": str(columns)}).stdout
    assert "Toggles on this machine" in doctor and max(map(len, doctor.splitlines())) <= columns
    def words(text):  # the table's rule lines are as wide as their column; a wrapped comment repeats its '#'
        return [w for w in text.split() if w.strip("-") and w != "#"]

    assert words(wrapped) == words(whole)
    rows = {line.split()[0]: line for line in whole.splitlines() if line.split() and line.split()[0] in
            {t.dest for t in TOGGLES}}
    assert rows and all(line.rstrip().endswith(("off", "stands in", "validate_args)")) for line in rows.values())


def test_a_wrapped_launch_environment_line_pastes_into_a_shell():
    out = run_cli("explain", "--world-size", "2", "--", "--num-layers", "2", "--tensor-model-parallel-size", "2",
                  "--sequence-parallel", env={"COLUMNS": "60"}).stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("launch environment: export"))
    assert out[at].endswith("=1") and out[at + 1].startswith("    # ") and len(out[at]) <= 60
    tail = [line for line in out[at + 1:] if not line.startswith("launch environment")]
    assert all(line.lstrip().startswith("#") for line in tail[:2])


def test_tables_wrap_their_last_column_beside_or_under_the_others():
    rows = [["a_toggle", "on", "word " * 40], ["b", "off", "short"]]
    for width in (12, 40, 70, 200):
        text = cli._table(rows, ["toggle", "value", "reason"], width)
        assert max(map(len, text.splitlines())) <= max(width, len("a_toggle"))  # a word is not broken
        assert text.split().count("word") == 40 and "short" in text.split()
    assert len(cli._table(rows, ["toggle", "value", "reason"]).splitlines()) == 4  # no width: one line a row
    beside, under = (cli._table(rows, ["toggle", "value", "reason"], w).splitlines() for w in (80, 40))
    assert beside[2].startswith("a_toggle") and beside[2].split()[2] == "word"
    assert under[3] == "a_toggle  on" and under[4].startswith(cli.UNDER_INDENT + "word")


def test_explain_with_no_arguments_works_without_megatron():
    proc = run_cli("explain")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "built-in Llama-3-8B" in out and "precision tag: bf16" in out
    for t in TOGGLES:  # a dense model: the MoE toggles are not in the table, and nothing says why
        assert (t.dest in out) is (t.scope == "all"), t.dest
    assert "mixture-of-experts" not in out
    assert "runs/llama3-8b/tensorboard/bf16" in out


MOE_LINE = ["--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear", "--bf16", "--num-layers", "4",
            "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "512", "--max-position-embeddings",
            "512", "--micro-batch-size", "1", "--global-batch-size", "8"]


def test_explain_lists_the_moe_toggles_for_a_moe_model_and_says_one_line_for_a_dense_one():
    out = run_cli("explain", "--megatron-version", "main", "--", *MOE_LINE).stdout
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.startswith("moe_")}
    # this small model routes 0.5 Mi elements a micro-batch: permute fusion is off there by the measured rule
    assert rows == {"moe_grouped_gemm": ["on", "default"], "moe_router_fusion": ["on", "default"],
                    "moe_permute_fusion": ["off", "guard"]}
    verbose = run_cli("explain", "--verbose").stdout
    said = [line for line in verbose.splitlines() if "moe_" in line]
    assert len(said) == 1 and said[0].startswith("MoE toggles: not a mixture-of-experts model"), said


def test_explain_json_with_assumed_machine():
    proc = run_cli("explain", "--json", env={"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"})
    data = json.loads(proc.stdout)
    assert data["decisions"]["gradient_accumulation_fusion"]["value"] is True
    assert data["decisions"]["cross_entropy_fusion_impl"] == {
        "value": "native", "source": "guard", "peak_memory_delta_mb": 0.0,
        "reason": "Megatron 0.20.0 rejects the te impl with --cross-entropy-loss-fusion (stability assertion in validate_args)"}
    assert data["capabilities"]["assumed"]


def test_explain_own_command_line_and_recorded_version():
    proc = run_cli("explain", "--megatron-version", "core_v0.13.0", "--", "--bf16", "--fp8-format", "hybrid",
                   "--fp8-recipe", "tensorwise", "--tensorboard-dir", "/x/tb", env={"DDP_AVERAGE_IN_COLLECTIVE": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "precision tag: fp8_tensorwise" in proc.stdout and "/x/tb/fp8_tensorwise" in proc.stdout
    assert "DDP_AVERAGE_IN_COLLECTIVE=0" in proc.stdout
    assert "no fused_single_qkv_rope field" in proc.stdout


@pytest.mark.parametrize("argv, env, words", [
    (["explain"], {"GRAD_REDUCE_IN_BF16": "maybe"}, "GRAD_REDUCE_IN_BF16='maybe'"),
    (["explain"], {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,quantum"}, "unknown entry 'quantum'"),
    (["explain", "--megatron", "/nonexistent/megatron"], {}, "not a Megatron-LM checkout"),
    (["explain", "--", "--use-torch-fsdp2", "--gradient-accumulation-fusion"],
     {"MEGATRON_PERF_TOGGLES_ASSUME": "apex"}, "--gradient-accumulation-fusion was requested"),
])
def test_bad_input_is_one_line_exit_2(argv, env, words):
    proc = run_cli(*argv, env=env)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr


def _one_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("[perf-toggles] error:"), proc.stderr
    return lines[0]


def test_unknown_recorded_version_is_one_line_with_a_suggestion():
    line = _one_line(run_cli("explain", "--megatron-version", "core_v0.19"))
    assert "invalid choice" in line and "did you mean 'core_v0.19.0'" in line


def test_unknown_subcommand_is_one_line_with_a_suggestion():
    assert "did you mean 'explain'" in _one_line(run_cli("explian"))


def test_doctor_with_a_missing_checkout_is_one_line():
    assert "/nonexistent" in _one_line(run_cli("doctor", "--megatron", "/nonexistent"))


def test_surface_errors_carry_the_prefix_and_help_names_the_command():
    assert "not a Megatron-LM checkout" in _one_line(run_cli("surface", "/nonexistent"))
    _one_line(run_cli("surface"))  # missing TREE
    assert run_cli("surface", "--help").stdout.startswith("usage: megatron-perf-toggles surface")


def test_contradicting_flags_are_one_line():
    line = _one_line(run_cli("explain", "--", "--grad-reduce-in-bf16", "--no-grad-reduce-in-bf16"))
    assert "--grad-reduce-in-bf16 and --no-grad-reduce-in-bf16" in line


def test_explain_reports_torch_where_it_is_installed_and_where_facts_came_from():
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here")
    data = json.loads(run_cli("explain", "--json", "--gpu", "h200").stdout)
    assert data["capabilities"]["torch_version"]  # not "no torch"
    assert data["capabilities"]["device"] == "cuda" and data["capabilities"]["gpu_arch"] == "sm_90"
    sources = "\n".join(data["sources"])
    assert "recorded surface 'main'" in sources and "planned: --gpu h200" in sources
    # No GPU here: the plan is for an H100 and its planned stack, the variable on top of it.
    out = run_cli("explain", "--verbose", env={"MEGATRON_PERF_TOGGLES_ASSUME": "te=2.12"}).stdout
    assert "Transformer Engine: 2.12 (assumed" in out and "APEX fused wgrad: no (planned stack)" in out
    assert "Transformer Engine: 2.12" not in run_cli("explain", env={"MEGATRON_PERF_TOGGLES_ASSUME": "te=2.12"}).stdout


# Runs the command as ``python -m megatron_perf_toggles`` does, then notes in a file whether Megatron
# or torch was imported on the way (stdout and stderr stay the command's own).
IMPORT_PROBE = """import json, os, runpy, sys
out = sys.argv.pop(1)
if os.environ.pop("PROBE_AS_IF_GPU_NODES", ""):  # as on a GPU machine: torch is asked about the GPU
    import megatron_perf_toggles.runtime.machine.probe as probe
    probe.no_gpu_here = lambda: False
sys.argv[0] = "megatron-perf-toggles"
code = 0
try:
    runpy.run_module("megatron_perf_toggles", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
open(out, "w").write(json.dumps({"imported": [m for m in ("megatron", "torch") if m in sys.modules], "exit": code}))
sys.exit(code)
"""


def run_probed(tmp_path, *argv, env=None, path=()):
    out = tmp_path / f"probe-{len(list(tmp_path.iterdir()))}.json"
    base = clean_environ(drop=("PYTHONPATH",))
    pythonpath = os.pathsep.join([str(REPO), *map(str, path)])
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE, str(out), *argv], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": pythonpath, **(env or {})}, cwd=REPO, timeout=120)
    return proc, json.loads(out.read_text())


@pytest.mark.parametrize(("argv", "words"), [
    (["explain", "--megatron", "/nonexistent/megatron"], "not a Megatron-LM checkout"),
    (["explain", "--megatron", "/nonexistent/megatron", "--world-size", "64"], "not a Megatron-LM checkout"),
    (["doctor", "--megatron", "/nonexistent/megatron"], "not a Megatron-LM checkout"),
    (["flags", "--megatron", "/nonexistent/megatron"], "not a Megatron-LM checkout"),
    (["explain", "--", "--grad-reduce-in-bf16", "--no-grad-reduce-in-bf16"], "are both on the command line"),
    (["flags", "--", "--no-cross-entropy-loss-fusion", "--cross-entropy-loss-fusion"], "are both on the command line"),
])
@pytest.mark.parametrize("gpu_nodes", ["", "1"])
def test_bad_input_is_refused_before_torch_is_imported(tmp_path, argv, words, gpu_nodes):
    """Every bad input is one line within a second: importing torch alone takes about 2 s, so a
    path that is no checkout or a contradicting command line is refused first, on a GPU machine too."""
    proc, seen = run_probed(tmp_path, *argv, env={"PROBE_AS_IF_GPU_NODES": gpu_nodes})
    assert words in _one_line(proc)
    assert seen == {"imported": [], "exit": 2}


def test_planning_where_no_gpu_can_be_visible_reads_torch_without_importing_it(tmp_path):
    torch_version = pytest.importorskip("torch").__version__
    from megatron_perf_toggles.runtime.machine.probe import GPU_SIGNS

    if any(os.path.exists(sign) for sign in GPU_SIGNS):
        pytest.skip("a GPU driver is here: torch is asked")
    for argv in (["explain", "--json"], ["explain", "--json", "--gpu", "h200"]):
        proc, seen = run_probed(tmp_path, *argv)
        assert seen == {"imported": [], "exit": 0}, proc.stderr
        caps = json.loads(proc.stdout)["capabilities"]
        assert caps["torch_version"] == torch_version  # what an import says
    assert caps["device"] == "cuda" and caps["gpu_arch"] == "sm_90"  # the planned H200
    proc, seen = run_probed(tmp_path, "flags")
    assert seen == {"imported": [], "exit": 0} and proc.stdout.split(), proc.stderr


def test_doctor_imports_torch_and_says_when_it_does_not_import(tmp_path):
    """doctor diagnoses this machine: it imports torch as a run would, where a plan may read its
    build file instead, and a torch that is installed but breaks at import is named."""
    pytest.importorskip("torch")
    proc, seen = run_probed(tmp_path, "doctor")
    assert seen["exit"] == 0 and "torch" in seen["imported"], proc.stderr
    assert "does not import" not in proc.stdout
    broken = tmp_path / "path" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared object file')\n")
    (broken / "version.py").write_text("__version__ = '2.9.0+cpu'\ncuda = None\nhip = None\n")
    proc, seen = run_probed(tmp_path, "doctor", path=[broken.parent])
    assert seen["exit"] == 0, proc.stderr
    assert "torch is installed but does not import" in proc.stdout


def test_a_plan_on_a_recorded_surface_leaves_the_megatron_on_the_path_alone(tmp_path):
    """A training container has Megatron on PYTHONPATH; explain on a recorded surface must not
    import it (seconds, and its warnings on stderr) for facts the surface replaces."""
    found = tmp_path / "path"
    (found / "megatron" / "training").mkdir(parents=True)
    (found / "megatron" / "__init__.py").write_text("import warnings\nwarnings.warn('megatron was imported')\n")
    (found / "megatron" / "training" / "__init__.py").write_text("")
    (found / "megatron" / "training" / "arguments.py").write_text("")
    contradiction = ["explain", "--", "--grad-reduce-in-bf16", "--no-grad-reduce-in-bf16"]
    for argv in (["explain"], ["flags", "--megatron-version", "core_v0.18.0"], contradiction):
        proc, seen = run_probed(tmp_path, *argv, path=[found])
        assert "megatron" not in seen["imported"] and "megatron was imported" not in proc.stderr, proc.stderr
    assert "are both on the command line" in _one_line(proc)  # the bad input's one line, alone on stderr


def test_explain_plans_a_world_on_a_recorded_surface_too():
    """No checkout is needed to plan a world: the memory model shards the optimizer over its DP."""
    def weights(world: str) -> float:
        proc = run_cli("explain", "--json", "--world-size", world, "--", *SURFACE_MODEL)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["memory"]["stock_parts_mb"]["weights_and_optimizer"]

    assert weights("64") / weights("8") == pytest.approx((6 + 12 / 64) / (6 + 12 / 8), rel=1e-4)  # parts in 0.1 MB
    assert "did you mean 'h100'" in _one_line(run_cli("explain", "--gpu", "h10"))
    # A world the model-parallel size does not divide is one line, as Megatron's own check would be.
    line = _one_line(run_cli("explain", "--world-size", "6", "--", *SURFACE_MODEL, "--tensor-model-parallel-size", "4"))
    assert "world size 6 is not divisible by TP x PP x CP = 4" in line


SURFACE_MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
                 "--max-position-embeddings", "1024", "--micro-batch-size", "1", "--vocab-size", "32000", "--bf16",
                 "--use-distributed-optimizer"]


# Routing of the originating ROCm train_llama3.sh: GPT_ARGS got gradient accumulation fusion,
# bf16 grad reduce, cross-entropy fusion (+impl) and fused QKV RoPE; EXTRA_ARGS got DDP average.
# Gradient accumulation fusion is on by Megatron's own default, so it needs no flag; upstream has
# no --fused-single-qkv-rope (a TransformerConfig field only), so a stock launch cannot take it.
GPT_BUCKET = {"--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"}
EXTRA_BUCKET = {"--ddp-average-in-collective"}
CAPABLE = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"}
NO_TE_ASSERT = ("--megatron-version", "core_v0.18.0")  # has the field, no te cross-entropy assertion


def test_flags_route_like_the_originating_scripts():
    assert set(run_cli("flags", "--group", "gpt", *NO_TE_ASSERT, env=CAPABLE).stdout.split()) == GPT_BUCKET
    assert set(run_cli("flags", "--group", "extra", *NO_TE_ASSERT, env=CAPABLE).stdout.split()) == EXTRA_BUCKET
    assert set(run_cli("flags", *NO_TE_ASSERT, env=CAPABLE).stdout.split()) == GPT_BUCKET | EXTRA_BUCKET


def test_flags_follow_the_environment():
    out = run_cli("flags", *NO_TE_ASSERT, env={**CAPABLE, "GRAD_REDUCE_IN_BF16": "0",
                                               "CROSS_ENTROPY_FUSION_IMPL": "native"}).stdout.split()
    assert "native" in out and "--grad-reduce-in-bf16" not in out
    assert run_cli("flags", env={"MEGATRON_PERF_TOGGLES": "0"}).stdout.strip() == ""


@pytest.mark.parametrize("version, env, refused", [
    # main asserts against the te impl with fusion; 0.13 has no TE kernel here and no RoPE field.
    ("main", CAPABLE, ["--cross-entropy-fusion-impl"]),
    ("core_v0.13.0", {"MEGATRON_PERF_TOGGLES_ASSUME": "none"}, ["--cross-entropy-fusion-impl", "--fused-single-qkv-rope"]),
])
def test_flags_leave_out_what_the_target_would_refuse(version, env, refused):
    proc = run_cli("flags", "--megatron-version", version, env=env)
    assert proc.returncode == 0, proc.stderr
    for flag in refused:
        assert flag not in proc.stdout.split()
        assert any(line.startswith(f"# {flag}") and "left out:" in line for line in proc.stderr.splitlines())
    # What is printed, pasted into a launch, is accepted: no refusal of an explicit request.
    explain = run_cli("explain", "--megatron-version", version, "--", *proc.stdout.split(), env=env)
    assert explain.returncode == 0, explain.stderr


def test_doctor_reports_every_section():
    proc = run_cli("doctor")
    assert proc.returncode == 0, proc.stderr
    for heading in ("Megatron-LM:", "torch:", "GPU architecture:", "Transformer Engine:", "APEX fused wgrad:",
                    "aiter (AMD):", "Toggles on this machine"):
        assert heading in proc.stdout
    data = json.loads(run_cli("doctor", "--json").stdout)
    assert set(data["toggles_here"]) == {t.dest for t in TOGGLES}


def test_doctor_with_nothing_installed(monkeypatch, capsys):
    import importlib.util

    from megatron_perf_toggles.runtime.machine import capabilities

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    monkeypatch.setattr(capabilities, "_dist_version", lambda *names: None)
    for name in ("torch", "transformer_engine"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    caps = capabilities.detect(deep=True)
    assert isinstance(caps, Capabilities)
    assert (caps.te_version, caps.apex_fused_wgrad, caps.torch_version, caps.aiter_version) == (None, False, None, None)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "not installed" in out and "Megatron-LM:        not importable" in out


def test_help_explains_commands_and_env_vars():
    out = run_cli("--help").stdout
    for word in ("explain", "flags", "doctor", "patch", "GRAD_REDUCE_IN_BF16", "MEGATRON_PERF_TOGGLES_ASSUME"):
        assert word in out


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_explain_with_a_real_tree():
    tree = megatron_trees()[-1]
    proc = run_cli("explain", "--megatron", str(tree), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert str(tree.resolve()) in data["megatron"] and data["precision"] == "bf16"


SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "32", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "128", "--mock-data", "--bf16"]
PLAN_IN_PROCESS = """
import sys, typing
from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES
from megatron_perf_toggles.tools import cli
override, path = getattr(typing, "override", None), list(sys.path)
cli.plan_command_line(sys.argv[2:], tree=sys.argv[1])
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(["flags", "--megatron", sys.argv[1]]) == 0
import megatron.training.arguments as arguments
print(PROCESS_CHANGES.labels, hasattr(arguments.validate_args, "__wrapped__"), getattr(typing, "override", None) is override,
      sys.path == path)
"""


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_planning_on_a_real_tree_leaves_the_process_as_it_was():
    """explain --megatron hooks Megatron's parse path and installs the safety net as a launch does,
    flags --megatron imports the tree; afterwards nothing of either is left: no recorded change,
    validate_args unwrapped, shims and sys.path entries gone."""
    tree = megatron_trees()[-1]
    proc = subprocess.run([sys.executable, "-c", PLAN_IN_PROCESS, str(tree), *SMALL_MODEL], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.12.0,cuda"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[] False True True"


def test_explain_on_the_fork_surface_takes_an_enum_flag():
    proc = run_cli("explain", "--megatron-version", "rocm_fork", "--json", "--", "--bf16", "--attention-backend",
                   "fused", "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["precision"] == "mxfp4"


def _surface_cases(tree: str, work: Path) -> list[dict]:
    """``surface TREE`` (the command line's ``main``) on each tree's worker (tests/tree_driver.py)."""
    from megatron_perf_toggles.tools.surfaces import replay

    if Path(tree).name not in replay.available():
        return []
    return [{"tree": tree, "cases": [{"name": "surface", "mode": "cli",
                                      "argv": ["surface", tree, "--out", str(work / "surface.json")]}]}]


SURFACES = tree_driver.SESSION.suite("surfaces", _surface_cases)


@pytest.mark.real_megatron
def test_recorded_surfaces_match_the_trees():
    # The packaged surface of each tree is what `surface TREE` records from it now, enum choices
    # included (by the names Megatron's own enum flags accept).
    from megatron_perf_toggles.tools.surfaces import replay

    checked = 0
    for tree in megatron_trees():
        if tree.name not in replay.available():
            continue
        result = tree_driver.SESSION.results(SURFACES, str(tree))["surface"]
        assert result["error"] is None and result["code"] == 0, (result["code"], result["error"] or result["stderr"][-600:])
        fresh = json.loads(Path(result["argv"][-1]).read_text())
        assert fresh["actions"] == replay.load_surface(tree.name)["actions"], tree.name
        backend = next(a for a in fresh["actions"] if a["dest"] == "attention_backend")
        assert "fused" in backend["choices"] and backend["enum"] == "AttnBackend"
        checked += 1
    if not checked:
        pytest.skip("no tree in MEGATRON_LM_TREES has a recorded surface to compare with")
