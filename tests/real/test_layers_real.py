"""The layer-level check against real Megatron-LM trees, on a CPU: ``layers --check --megatron TREE``
plans through the tree's own parse and validate and lists what a GPU run would build, on every
supported version; the namespace it builds from keeps Megatron's own types."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, megatron_trees
from sandbox import clean_environ

MOE = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
       "--max-position-embeddings", "2048", "--micro-batch-size", "2", "--global-batch-size", "16", "--bf16",
       "--num-experts", "16", "--moe-router-topk", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
       "--mock-data", "--train-iters", "10", "--lr", "1e-4", "--transformer-impl", "transformer_engine",
       "--position-embedding-type", "rope", "--disable-bias-linear", "--no-rope-fusion",
       "--expert-model-parallel-size", "2"]


def _run(*words: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**clean_environ(drop=("PYTHONPATH",)), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles", *words], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout, check=False)


@pytest.mark.real_megatron
@pytest.mark.own_process
# the oldest and the newest tree: the planning path itself runs on every tree in the dry-run suites
@pytest.mark.parametrize("tree", sorted({*megatron_trees()[:1], *megatron_trees()[-1:]}) or [None],
                         ids=lambda t: t.name if t else "none")
def test_check_plans_through_the_trees_own_parser(tree):
    if tree is None:
        pytest.skip("MEGATRON_LM_TREES is unset")
    done = _run("layers", "--check", "--megatron", str(tree), "--step-ms", "300", "--", *MOE)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert f"at {tree.resolve()}" in out and "parse and validate" in out
    assert "EP 2: one rank's shard" in out and "local experts 8 of 16" in out
    assert "moe_grouped_gemm" in out and "moe_layer, 4 per micro-batch" in out
    assert "needs 2 or more ranks" in out and "not timed: --check" in out


VALIDATED = """
import sys, torch
from megatron_perf_toggles.runtime.machine.target import make_target
from megatron_perf_toggles.tools.planning import validated_arguments
plan, label, ns = validated_arguments(sys.argv[1], sys.argv[2:], make_target(world_size=2, gpu="h100"))
print(ns.params_dtype is torch.bfloat16, ns.expert_model_parallel_size, ns.world_size, plan.precision)
"""


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_the_validated_namespace_keeps_megatrons_types():
    trees = megatron_trees()
    if not trees:
        pytest.skip("MEGATRON_LM_TREES is unset")
    env = {**clean_environ(drop=("PYTHONPATH",)), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", VALIDATED, str(trees[-1]), *MOE], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "2", "2", "bf16"]
