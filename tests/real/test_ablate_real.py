"""The ablation confound check through real Megatron parsers (dry runs on CPU), on every tree given."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path

import launcher_cases as runs
import pytest
import tree_driver
from conftest import REPO, megatron_trees
from sandbox import clean_environ, plugin_part

from megatron_perf_toggles.tools.ablate import confounds, design
from megatron_perf_toggles.tools.ablate import runs as ablate_runs
from megatron_perf_toggles.tools.ablate.design import DEFAULT_TOGGLES, expand
from megatron_perf_toggles.tools.ablate.spec import ExperimentSpec

TREES = megatron_trees()
pytestmark = pytest.mark.real_megatron
# The oldest and the newest tree given, for the checks that need extra dry runs (~8 s each).
PICKED = sorted({TREES[0], TREES[-1]}, key=str) if TREES else []
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
        "--train-iters", "1", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data",
        "--position-embedding-type", "rope", "--no-rope-fusion"]


def _environ(tree):
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(REPO)])
    env["MEGATRON_PERF_TOGGLES_ASSUME"] = "apex,te=2.20.2,cuda"
    return env


def _has_fused_single_qkv_rope(tree) -> bool:
    """The TransformerConfig field exists from core 0.15 on: read from the tree itself."""
    config = tree / "megatron" / "core" / "transformer" / "transformer_config.py"
    return "fused_single_qkv_rope" in config.read_text()


FSDP_ARGS = [*ARGS, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist"]
CANDIDATE_ARGS = [*ARGS, "--use-distributed-optimizer"]
CANDIDATES = ["overlap=--overlap-grad-reduce --overlap-param-gather", "gc=--manual-gc",
              "mask=--no-create-attention-mask-in-dataloader", "alloc=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
TP_ARGS = [*ARGS, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--transformer-impl", "local"]


def _one_at_a_time(tree):
    toggles = tuple(t for t in DEFAULT_TOGGLES if t != "fused_single_qkv_rope" or _has_fused_single_qkv_rope(tree))
    return toggles, expand("one-at-a-time", toggles, [])


def _candidate_arms(words):
    return expand("candidates", DEFAULT_TOGGLES, [], candidates=design.parse_candidates(words, design.known_args()[1]))


def _tp_environ(tree):
    return {**_environ(tree), "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _batches_asked(tree):
    """Every batch of dry runs (arms, Megatron arguments, environment, world) the tests below ask
    of ``tree``: built when the session starts, so the tree's worker runs them with its other suites."""
    asked = [(_one_at_a_time(tree)[1], ARGS, _environ(tree), None)]
    if PICKED and tree == PICKED[-1]:
        tp_arms = _candidate_arms(["overlap=--tp-comm-overlap"])
        asked += [(expand("factorial", ("gradient_accumulation_fusion",), []), FSDP_ARGS, _environ(tree), None),
                  (_candidate_arms(CANDIDATES), CANDIDATE_ARGS, _environ(tree), None),
                  (tp_arms, TP_ARGS, _tp_environ(tree), None), (tp_arms, TP_ARGS, _tp_environ(tree), 2)]
    return asked


def _dry_runs(tree, args, arms, environ, world):
    """The launcher dry run (``dry_run_command``) of every arm and probe of ``arms``, as rank 0 in
    the arm's environment, as cases for the tree's worker, by arm signature."""
    wanted = {a.signature: a for a in [*arms, *(p for ps in design.probe_arms(arms).values() for p in ps)]}
    plugin_env = plugin_part(environ, "CUDA_DEVICE")
    script = str(tree / "pretrain_gpt.py")
    return {signature: {"mode": "launcher", "argv": ablate_runs.dry_run_command(script, args, arm, world)[3:],
                        "env": {**plugin_env, **arm.env, "RANK": "0"}} for signature, arm in wanted.items()}


def _case_name(case):
    return hashlib.sha1(json.dumps(case, sort_keys=True).encode()).hexdigest()[:16]


def _build(tree, work):
    cases = {}
    for arms, args, environ, world in _batches_asked(Path(tree)):
        for case in _dry_runs(Path(tree), args, arms, environ, world).values():
            cases[_case_name(case)] = case
    return [{"tree": tree, "cases": [{"name": name, **case} for name, case in cases.items()]}]


SUITE = tree_driver.SESSION.suite("ablate", _build)


def _one_process_for_all_arms(tree, arms):
    """A resolver for ``resolve_and_check`` (as ``resolve_arm``, ``world`` included, so
    ``runs.planned`` can bind it) whose dry runs ran on the tree's worker with its other suites,
    Megatron imported once (every batch a test asks for is listed in ``_batches_asked``). An arm
    whose dry run failed raises the ConfoundError ``resolve_arm`` would."""
    batches: dict = {}
    lock = threading.Lock()  # resolve_and_check asks for several arms at once, from threads

    def batch(script, args, environ, world):
        with lock:
            if world not in batches:
                assert script == str(tree / "pretrain_gpt.py")
                cases = {signature: {"name": _case_name(case), **case}
                         for signature, case in _dry_runs(tree, args, arms, environ, world).items()}
                done = tree_driver.SESSION.results(SUITE, tree)
                missing = [case["argv"] for case in cases.values() if case["name"] not in done]
                assert not missing, f"dry runs that _batches_asked does not list: {missing}"
                batches[world] = {signature: done[case["name"]] for signature, case in cases.items()}
            return batches[world]

    def resolver(script, args, arm, environ, world=None):
        return runs.arm_record(batch(script, args, environ, world)[arm.signature], arm)

    return resolver


FUSED_ARM = "only:fused_single_qkv_rope"


def _own_process_dry_runs(tree):
    """ablate's own ``resolve_arm`` (a dry-run process per arm) on ``tree``: an arm with a
    difference no toggle makes, and the fused QKV RoPE arm (forced on a tree whose TransformerConfig
    has no field for it). Processes of their own, so a background job beside the workers."""
    script, env = str(tree / "pretrain_gpt.py"), _environ(tree)
    arms = _one_at_a_time(tree)[1]
    found = {"injected": ablate_runs.resolve_arm(script, [*ARGS, "--adam-eps", "1e-5"], arms[1], env)}
    if not _has_fused_single_qkv_rope(tree):
        arm = next(a for a in expand("one-at-a-time", DEFAULT_TOGGLES, []) if a.name == FUSED_ARM)
        found["fused"] = (arm, ablate_runs.resolve_arm(script, ARGS, arm, env))
    return found


# One job per picked tree: a failure on one fails that tree's test alone.
PROCESSES = {tree: tree_driver.SESSION.background(f"ablate-processes-{i}-{tree.name}",
                                                  functools.partial(_own_process_dry_runs, tree))
             for i, tree in enumerate(PICKED)}


@pytest.mark.parametrize("tree", TREES, ids=lambda p: p.name)
def test_each_toggle_can_be_varied_alone(tree):
    """Every arm and probe dry-run in one process for the tree; each single-toggle arm is also its
    own probe: what it derives is allowed."""
    script = str(tree / "pretrain_gpt.py")
    toggles, arms = _one_at_a_time(tree)
    env = _environ(tree)
    resolver = _one_process_for_all_arms(tree, arms)
    records, derived = confounds.resolve_and_check(resolver, script, ARGS, design.design_of("t", arms), env)
    # Megatron keeps grads in fp32 for the reduction exactly when they are not reduced in bf16.
    assert "accumulate_allreduce_grads_in_fp32" in derived["grad_reduce_in_bf16"]
    assert set(derived) == set(toggles)
    if tree in PICKED:
        own = tree_driver.SESSION.outcome(PROCESSES[tree])
        # The same check refuses a difference that no toggle makes.
        with pytest.raises(confounds.ConfoundError) as info:
            confounds.check_confounds(design.design_of("t", arms), [records[0], own["injected"], *records[2:]], derived)
        text = str(info.value)
        assert "adam_eps: all-off=1e-08" in text and "1e-05" in text and "nothing was run" in text
        if "fused" in own:  # forced on a tree without the field, the guard keeps it off
            arm, rec = own["fused"]
            with pytest.raises(confounds.ConfoundError) as info:
                confounds.check_confounds(design.design_of("t", [arms[0], arm]), [records[0], rec], derived)
            assert "fused_single_qkv_rope should be True but is False (guard;" in str(info.value)


@pytest.mark.parametrize("tree", PICKED[-1:], ids=lambda p: p.name)
def test_guard_forced_factorial_is_refused_with_the_guard_reason(tree):
    script = str(tree / "pretrain_gpt.py")
    arms = expand("factorial", ("gradient_accumulation_fusion",), [])
    resolver = _one_process_for_all_arms(tree, arms)
    with pytest.raises(confounds.ConfoundError) as info:
        confounds.resolve_and_check(resolver, script, FSDP_ARGS, design.design_of("t", arms), _environ(tree))
    assert "gradient_accumulation_fusion should be True but is False" in str(info.value)
    assert "--use-torch-fsdp2" in str(info.value)


@pytest.mark.parametrize("tree", PICKED[-1:], ids=lambda p: p.name)
def test_candidates_resolve_through_the_real_parser(tree):
    """The DP-communication candidates on top of the defaults: each arm is its own probe, the
    toggles keep their decisions, and what a candidate derives is reported, not refused."""
    arms = _candidate_arms(CANDIDATES)
    script, env = str(tree / "pretrain_gpt.py"), _environ(tree)
    resolver = _one_process_for_all_arms(tree, arms)
    records, derived = confounds.resolve_and_check(resolver, script, CANDIDATE_ARGS, design.design_of("t", arms), env)
    effective = [r["effective_args"] for r in records]
    assert [e["overlap_grad_reduce"] for e in effective] == [False, True, False, False, False]
    assert [e["overlap_param_gather"] for e in effective] == [False, True, False, False, False]
    assert [e["manual_gc"] for e in effective] == [False, False, True, False, False]
    # a --no- switch stores into a dest of another name; an environment-only arm resolves like the baseline
    assert [e["create_attention_mask_in_dataloader"] for e in effective] == [True, True, True, False, True]
    assert effective[4] == effective[0] and derived["+alloc"] == set()
    assert {"overlap_grad_reduce", "overlap_param_gather"} <= derived["+overlap"]
    assert records[0]["decisions"] == records[2]["decisions"] == records[4]["decisions"]


@pytest.mark.parametrize("tree", PICKED[-1:], ids=lambda p: p.name)
def test_model_parallel_arms_resolve_for_the_launchers_world(tree):
    """Tensor parallelism over two GPUs does not validate in a world of one: the dry runs plan for
    the world the launcher starts, and --tp-comm-overlap (which needs sequence parallelism) resolves."""
    arms = _candidate_arms(["overlap=--tp-comm-overlap"])
    script, environ = str(tree / "pretrain_gpt.py"), _tp_environ(tree)
    with pytest.raises(confounds.ConfoundError, match="world size"):  # planned for one process
        confounds.resolve_and_check(_one_process_for_all_arms(tree, arms), script, TP_ARGS, design.design_of("t", arms),
                                  environ)
    spec = ExperimentSpec(launch="torchrun --nproc-per-node 2")
    resolver, note = ablate_runs.planned(_one_process_for_all_arms(tree, arms), spec), spec.world_words
    records, derived = confounds.resolve_and_check(resolver, script, TP_ARGS, design.design_of("t", arms), environ)
    assert note == "a world of 2 (from --launch)"
    assert [r["effective_args"]["tensor_model_parallel_size"] for r in records] == [2, 2]
    assert [r["effective_args"]["tp_comm_overlap"] for r in records] == [False, True]
    assert derived["+overlap"] == {"tp_comm_overlap"}
