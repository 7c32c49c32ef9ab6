"""The ablation confound check through real Megatron parsers (dry runs on CPU)."""

from __future__ import annotations

import os

import pytest
from conftest import REPO, megatron_trees

from megatron_perf_toggles import ablate
from megatron_perf_toggles.ablate_design import expand

TREES = megatron_trees()
pytestmark = pytest.mark.skipif(not TREES, reason="MEGATRON_LM_TREES is not set: real-Megatron suite skipped")
# The oldest and the newest tree given: enough to cover both parse paths, at ~12 s per dry run.
PICKED = sorted({TREES[0], TREES[-1]}, key=str) if TREES else []
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
        "--train-iters", "1", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data",
        "--position-embedding-type", "rope", "--no-rope-fusion"]


def _environ(tree):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(REPO)])
    env["MEGATRON_PERF_TOGGLES_ASSUME"] = "apex,te=2.20.2,cuda"
    return env


@pytest.mark.parametrize("tree", PICKED, ids=lambda p: p.name)
def test_toggle_only_arms_pass_and_an_injected_difference_is_refused(tree):
    script = str(tree / "pretrain_gpt.py")
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16", "cross_entropy_loss_fusion"), [])
    env = _environ(tree)
    records = ablate.resolve_all(ablate.resolve_arm, script, ARGS, arms, env)
    ablate.check_confounds(arms, records)  # clean: only the toggles (and what they derive) differ
    injected = ablate.resolve_arm(script, [*ARGS, "--adam-eps", "1e-5"], arms[1], env)
    with pytest.raises(ablate.ConfoundError) as info:
        ablate.check_confounds(arms, [records[0], injected, records[2]])
    text = str(info.value)
    assert "adam_eps: all-off=1e-08" in text and "1e-05" in text and "nothing was run" in text


@pytest.mark.parametrize("tree", PICKED[-1:], ids=lambda p: p.name)
def test_guard_forced_factorial_is_refused_with_the_guard_reason(tree):
    script = str(tree / "pretrain_gpt.py")
    fsdp = [*ARGS, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist"]
    arms = expand("factorial", ("gradient_accumulation_fusion",), [])
    records = ablate.resolve_all(ablate.resolve_arm, script, fsdp, arms, _environ(tree))
    with pytest.raises(ablate.ConfoundError) as info:
        ablate.check_confounds(arms, records)
    assert "gradient_accumulation_fusion should be True but is False" in str(info.value)
    assert "--use-torch-fsdp2" in str(info.value)
