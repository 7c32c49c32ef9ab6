"""The megatron-perf-toggles command: explain, flags, doctor, on a machine without Megatron."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, megatron_trees

from megatron_perf_toggles import cli
from megatron_perf_toggles.capabilities import Capabilities
from megatron_perf_toggles.registry import TOGGLES

PLUGIN_VARS = {t.env for t in TOGGLES} | {"MEGATRON_PERF_TOGGLES", "MEGATRON_PERF_TOGGLES_ASSUME"}


def run_cli(*argv, env=None, timeout=120):
    base = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARS and k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles", *argv], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO, timeout=timeout)


def test_explain_with_no_arguments_works_without_megatron():
    proc = run_cli("explain")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "built-in Llama-3-8B" in out and "precision tag: bf16" in out
    for t in TOGGLES:
        assert t.dest in out
    assert "runs/llama3-8b/tensorboard/bf16" in out


def test_explain_json_with_assumed_machine():
    proc = run_cli("explain", "--json", env={"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"})
    data = json.loads(proc.stdout)
    assert data["decisions"]["gradient_accumulation_fusion"]["value"] is True
    assert data["decisions"]["cross_entropy_fusion_impl"] == {
        "value": "native", "source": "guard",
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
    (["explain", "--megatron", "/nonexistent/megatron"], {}, "cannot import Megatron-LM"),
    (["explain", "--", "--use-torch-fsdp2", "--gradient-accumulation-fusion"],
     {"MEGATRON_PERF_TOGGLES_ASSUME": "apex"}, "--gradient-accumulation-fusion was requested"),
])
def test_bad_input_is_one_line_exit_2(argv, env, words):
    proc = run_cli(*argv, env=env)
    assert proc.returncode == 2
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_recorded_version_is_rejected_by_argparse():
    proc = run_cli("explain", "--megatron-version", "core_v0.1.0")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


# Routing of the originating ROCm train_llama3.sh: GPT_ARGS got gradient accumulation fusion,
# bf16 grad reduce, cross-entropy fusion (+impl) and fused QKV RoPE; EXTRA_ARGS got DDP average.
GPT_BUCKET = {"--gradient-accumulation-fusion", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
              "--cross-entropy-fusion-impl", "te", "--fused-single-qkv-rope"}
EXTRA_BUCKET = {"--ddp-average-in-collective"}


def test_flags_route_like_the_originating_scripts():
    assert set(run_cli("flags", "--group", "gpt").stdout.split()) == GPT_BUCKET
    assert set(run_cli("flags", "--group", "extra").stdout.split()) == EXTRA_BUCKET
    assert set(run_cli("flags").stdout.split()) == GPT_BUCKET | EXTRA_BUCKET


def test_flags_follow_the_environment():
    out = run_cli("flags", env={"GRAD_REDUCE_IN_BF16": "0", "CROSS_ENTROPY_FUSION_IMPL": "native"}).stdout.split()
    assert "--no-grad-reduce-in-bf16" in out and "native" in out and "--grad-reduce-in-bf16" not in out
    assert run_cli("flags", env={"MEGATRON_PERF_TOGGLES": "0"}).stdout.strip() == ""


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

    from megatron_perf_toggles import capabilities

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


@pytest.mark.skipif(not megatron_trees(), reason="MEGATRON_LM_TREES is not set: explain on a real tree skipped")
def test_explain_with_a_real_tree():
    tree = megatron_trees()[-1]
    proc = run_cli("explain", "--megatron", str(tree), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert str(tree.resolve()) in data["megatron"] and data["precision"] == "bf16"


def test_explain_on_the_fork_surface_takes_an_enum_flag():
    proc = run_cli("explain", "--megatron-version", "rocm_fork", "--json", "--", "--bf16", "--attention-backend",
                   "fused", "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["precision"] == "mxfp4"


@pytest.mark.skipif(not megatron_trees(), reason="MEGATRON_LM_TREES is not set: surface recording skipped")
def test_recorded_surfaces_match_the_trees(tmp_path):
    # The packaged surface of each tree is what `surface TREE` records from it now, enum choices
    # included (by the names Megatron's own enum flags accept).
    from megatron_perf_toggles import replay

    for tree in megatron_trees():
        if tree.name not in replay.available():
            continue
        out = tmp_path / f"{tree.name}.json"
        proc = run_cli("surface", str(tree), "--out", str(out), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        fresh = json.loads(out.read_text())
        assert fresh["actions"] == replay.load_surface(tree.name)["actions"], tree.name
        backend = next(a for a in fresh["actions"] if a["dest"] == "attention_backend")
        assert "fused" in backend["choices"] and backend["enum"] == "AttnBackend"
