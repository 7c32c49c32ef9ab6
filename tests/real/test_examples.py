"""examples/llama/train_llama3.sh: real use through the launcher (printed commands; dry runs on real trees)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, megatron_trees
from sandbox import clean_environ

SCRIPT = REPO / "examples" / "llama" / "train_llama3.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not available")


def run(env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    base = clean_environ()
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=timeout,
                          env={**base, "PYTHON": sys.executable, "MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT": "json", **env})


@pytest.mark.parametrize("env, words", [
    ({}, []),
    ({"TE_FP8": "1"}, ["--fp8-recipe delayed", "--fp8-format hybrid"]),
    ({"TE_FP8": "1", "TE_FP8_RECIPE": "tensorwise"}, ["--fp8-recipe tensorwise"]),
    ({"TE_FP8": "1", "TE_FP8_RECIPE": "mxfp8"}, ["--fp8-recipe mxfp8", "--fp8-format e4m3"]),
    ({"TE_FP4": "1"}, ["--fp4-format e2m1", "--fp4-recipe nvfp4"]),
    ({"TE_FP4": "1", "TE_FP4_RECIPE": "mxfp4"}, ["--fp4-recipe mxfp4"]),
])
@pytest.mark.parametrize("size, layers", [("8", "32"), ("70", "80")])
def test_printed_command_goes_through_the_launcher(env, words, size, layers):
    proc = run({"MEGATRON_LM": "/opt/Megatron-LM", "PRINT_ONLY": "1", "MODEL_SIZE": size, "GPUS_PER_NODE": "8", **env})
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout
    assert cmd.startswith("torchrun --nproc_per_node 8") and "-m megatron_perf_toggles.run /opt/Megatron-LM/pretrain_gpt.py" in cmd
    assert f"--num-layers {layers}" in cmd
    for w in words:
        assert w in cmd
    for toggle_flag in ("--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--fused-single-qkv-rope"):
        assert toggle_flag not in cmd  # the plugin decides the toggles from their variables


@pytest.mark.parametrize("env, words", [
    ({"MODEL_SIZE": "13"}, "MODEL_SIZE must be 8 or 70"),
    ({"TE_FP8": "1", "TE_FP8_RECIPE": "int4"}, "TE_FP8_RECIPE must be"),
    ({"TE_FP4": "1", "TE_FP4_RECIPE": "int4"}, "TE_FP4_RECIPE must be"),
    ({"TE_FP8": "yes"}, "TE_FP8 must be 0 or 1"),
    ({"TE_FP8": "1", "TE_FP4": "1"}, "choose one precision"),
])
def test_bad_choices_are_one_line_exit_2(env, words):
    proc = run({"MEGATRON_LM": "/opt/Megatron-LM", "PRINT_ONLY": "1", "GPUS_PER_NODE": "8", **env})
    assert proc.returncode == 2 and words in proc.stderr


@pytest.mark.real_megatron
@pytest.mark.own_process
@pytest.mark.parametrize("env, tag", [({"MODEL_SIZE": "8", "TE_FP8": "1"}, "fp8"), ({"MODEL_SIZE": "70"}, "bf16")])
def test_dry_run_on_the_newest_tree(env, tag):
    tree = megatron_trees()[-1]
    proc = run({"MEGATRON_LM": str(tree), "PYTHONPATH": str(REPO), "DRY_RUN": "1", "TP": "1", "GPUS_PER_NODE": "8",
                "TIME_STAMP": "ts", "MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20.2,cuda", **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    # The example's default LOG_DIR carries the tag already: the plugin keeps it as it is.
    assert record["precision"] == tag and record["log_dirs"]["tensorboard_dir"].endswith(f"/{tag}/ts")
    assert record["decisions"]["grad_reduce_in_bf16"]["value"] is True


@pytest.mark.real_megatron
@pytest.mark.own_process
@pytest.mark.parametrize("env, world, dp", [
    ({"TP": "2"}, 8, 4),  # the README's TP=2 DRY_RUN=1 line, on a machine without GPUs
    ({"MODEL_SIZE": "70", "TP": "8", "PP": "4", "NNODES": "8", "NUM_LAYERS": "8", "GPU": "mi355x"}, 64, 2),
])
def test_dry_run_plans_the_whole_layout(env, world, dp):
    tree = megatron_trees()[-1]
    proc = run({"MEGATRON_LM": str(tree), "PYTHONPATH": str(REPO), "DRY_RUN": "1", **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    args = record["effective_args"]
    assert (args["world_size"], args["data_parallel_size"]) == (world, dp)
    assert args["tensor_model_parallel_size"] == int(env["TP"])
    if "GPU" in env:
        assert record["target"]["gpu"]["arch"] == "gfx950" and record["target"]["gpu_source"] == "--gpu mi355x"
