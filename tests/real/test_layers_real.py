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
    assert "layer_wgrad, 4 per micro-batch" in out and "output_wgrad, 1 per micro-batch" in out
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


CONFIGS = """
import sys
from megatron_perf_toggles.runtime.machine.target import make_target
from megatron_perf_toggles.tools.planning import validated_arguments
from megatron_perf_toggles.tools.layers import design, gpu_build
from megatron_perf_toggles.tools.layers.shard import one_gpu_args, shard_of, unit_changes
from megatron_perf_toggles.core.registry import TOGGLES
stock = {t.dest: False for t in TOGGLES if t.kind == "bool"}
tree, world, words = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
plan, label, ns = validated_arguments(tree, words, make_target(world_size=world, gpu="h100"))
args = vars(ns)
shard = shard_of(args)
one = one_gpu_args(args, shard)
sys.path.insert(0, tree)
for row in design.rows(plan, args, shard):
    if row.measured:
        # every toggle off (a fused arm's config wants Transformer Engine, which a CPU machine has not)
        config = gpu_build.config_for(one, **{**stock, **unit_changes(row.unit.name, shard)})
        print(row.toggle.dest, row.unit.name, config.num_moe_experts)
"""
DEEPSEEK_LIKE = [*MOE[:MOE.index("--num-experts")], "--num-experts", "16", "--moe-router-topk", "4",
                 "--moe-router-num-groups", "8", "--moe-router-group-topk", "2", "--moe-router-score-function",
                 "sigmoid", "--moe-router-enable-expert-bias", "--moe-shared-expert-intermediate-size", "1024",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--mock-data", "--train-iters", "10",
                 "--lr", "1e-4", "--transformer-impl", "transformer_engine", "--position-embedding-type", "rope",
                 "--disable-bias-linear", "--no-rope-fusion", "--expert-model-parallel-size", "4",
                 "--moe-token-dispatcher-type", "alltoall", "--no-gradient-accumulation-fusion"]


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_every_measured_units_config_builds_from_a_real_command_line():
    """Each unit's TransformerConfig (its stock arm), from a DeepSeek-like command line (group-limited
    routing over 8 groups, a shared expert, EP 4: 4 local experts): what a GPU run builds first, checked on a CPU."""
    trees = megatron_trees()
    if not trees:
        pytest.skip("MEGATRON_LM_TREES is unset")
    env = {**clean_environ(drop=("PYTHONPATH",)), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", CONFIGS, str(trees[-1]), "4", *DEEPSEEK_LIKE], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    built = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.strip()}
    assert built["moe_router_fusion"] == ["router", "16"] and built["moe_grouped_gemm"] == ["moe_layer", "4"]
    assert built["moe_permute_fusion"] == ["dispatcher", "16"] and built["cross_entropy_loss_fusion"][1] == "None"


OUTPUT_LAYER = """
import socket, sys
import torch, torch.distributed as dist
from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.runtime import wgrad_fallback
from megatron_perf_toggles.runtime.machine.target import make_target
from megatron_perf_toggles.tools.layers import design, gpu_build, gpu_units
from megatron_perf_toggles.tools.layers.shard import one_gpu_args, shard_of
from megatron_perf_toggles.tools.planning import validated_run
tree, words = sys.argv[1], sys.argv[2:]
plan, caps, label, ns = validated_run(tree, words, make_target(world_size=2, gpu="h100"))
args = vars(ns)
shard = shard_of(args)
row = next(r for r in design.rows(plan, args, shard) if r.unit.name == "output_wgrad")
# a run on a machine without a GPU would not install it (the fallback is only assumed there)
print("installed", wgrad_fallback.install_for(plan.wgrad_path, caps.is_assumed("wgrad_fallback")) or "none")
sys.path.insert(0, tree)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
# the GPU placement stood in for by the CPU; the builder and Megatron's layer are what run
gpu_build.on_gpu = lambda module, config: module.bfloat16() if config.bf16 else module
gpu_build.randn = lambda shape, gen, requires_grad=False: torch.randn(
    *shape, dtype=torch.bfloat16, generator=gen).requires_grad_(requires_grad)
gpu_build.generator = lambda seed: torch.Generator().manual_seed(seed)
gpu_build.seeded = lambda seed: torch.manual_seed(seed)
modules, fused = [], []
keep = gpu_build.with_main_grads
gpu_build.with_main_grads = lambda m, step, bf16: (modules.append(m), keep(m, step, bf16))[1]
wgrad_fallback.activate()  # its CPU path, for this test
accumulate = wgrad_fallback._accumulate
wgrad_fallback._accumulate = lambda x, dy, g: (fused.append(list(g.shape)), accumulate(x, dy, g))[1]
one = {**one_gpu_args(args, shard), "use_cpu_initialization": True}
job = gpu_units.Job(one, shard, BY_DEST["gradient_accumulation_fusion"], 1, design.bf16_main_grads(plan))
pair = gpu_units.output_wgrad(job)
pair.stock()
by_stock = len(fused)
pair.toggle()
stock, toggle = (m.weight.main_grad for m in modules)
print("row", row.status, row.per_microbatch)
print("fused", by_stock, fused)
print("main_grad", str(stock.dtype), pair.same_weights, bool(torch.allclose(stock, toggle, rtol=2e-2, atol=1e-2)),
      bool(stock.abs().sum() > 0))
print("note", pair.note)
"""
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--bf16",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--mock-data", "--train-iters", "10", "--lr",
         "1e-4", "--tensor-model-parallel-size", "2"]


@pytest.mark.real_megatron
@pytest.mark.own_process
@pytest.mark.parametrize("tree", sorted({*megatron_trees()[:1], *megatron_trees()[-1:]}) or [None],
                         ids=lambda t: t.name if t else "none")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_output_layer_unit_builds_megatrons_layer_and_both_arms_fill_main_grad_alike(tree, tied):
    """The output_wgrad builder on a CPU, through the tree's own ColumnParallelLinear at TP 2 (the vocabulary
    1000 padded to 1024, half of it on a rank): the stock arm leaves its weight gradient to be added into
    main_grad, the fused arm hands it to the plugin's fallback as Megatron's fused path does, and the two
    main_grad buffers (bf16: the plan reduces in bf16) come out alike. Tied embeddings change nothing in it."""
    if tree is None:
        pytest.skip("MEGATRON_LM_TREES is unset")
    env = {**clean_environ(drop=("PYTHONPATH",)), "PYTHONPATH": str(REPO)}
    words = [*SMALL, *([] if tied else ["--untie-embeddings-and-output-weights"])]
    done = subprocess.run([sys.executable, "-c", OUTPUT_LAYER, str(tree), *words], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    said = {line.split()[0]: line.split(None, 1)[1] for line in done.stdout.splitlines() if line.strip()}
    assert said["installed"] == "none"  # assumed for a planned H100, and it cannot run on this CPU
    assert said["row"] == "measure 1"
    assert said["fused"] == "0 [[512, 64]]"  # stock: none; fused: one, into the rank's slice
    assert said["main_grad"] == "torch.bfloat16 True True True"
    assert "vocabulary slice 512" in said["note"] and "fallback" in said["note"]
