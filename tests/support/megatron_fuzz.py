"""Seeded random command lines that combine flags interacting with the toggles and with each other.

``generate(seed, count, option_strings, workdir)`` is pure (standard-library ``random``): the same
seed, count and parser give the same samples, so a failure is reproduced from the seed alone.
Only flags the tree's parser knows are used (each feature is dropped, whole, where one of its
flags is missing; where a tree spells a feature differently the known spelling is chosen).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

Words = list[str]
BASE = [
    "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "256",
    "--max-position-embeddings", "256", "--micro-batch-size", "1", "--global-batch-size", "64", "--lr", "1e-4",
    "--train-iters", "10", "--eval-iters", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "1024",
]
DETERMINISM_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


class Sample:
    """Words and environment under construction, with the parallel sizes the features chose."""

    def __init__(self, rng: random.Random, known: set[str]) -> None:
        self.rng = rng
        self.known = known
        self.words: Words = []
        self.env: dict[str, str] = {}
        self.sizes = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": None}
        self.moe = False
        self.features: list[str] = []

    def has(self, *flags: str) -> bool:
        return all(f in self.known for f in flags)

    def add(self, feature: str, *words: str) -> bool:
        """Add ``words`` if every flag among them is known; returns whether they were added."""
        flags = [w for w in words if w.startswith("--")]
        if not self.has(*flags):
            return False
        self.words.extend(words)
        self.features.append(feature)
        return True

    def first_known(self, *flags: str) -> str | None:
        return next((f for f in flags if f in self.known), None)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p


# --- features: each adds its flags with some probability ------------------------------------------


def precision(s: Sample) -> None:
    choice = s.rng.choice(["bf16", "bf16", "bf16", "fp16", "fp32"])
    if choice != "fp32":
        s.add(choice, f"--{choice}")
    if choice == "bf16" and s.chance(0.25):
        recipe = s.rng.choice(["delayed", "tensorwise", "mxfp8", "blockwise"])
        s.add(f"fp8-{recipe}", "--fp8-format", s.rng.choice(["hybrid", "e4m3"]), "--fp8-recipe", recipe)
        if s.chance(0.3):
            s.add("fp8-param-gather", "--fp8-param-gather")
    elif choice == "bf16" and s.chance(0.15):
        s.add("nvfp4", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4")


def determinism(s: Sample) -> None:
    if s.chance(0.3) and s.add("deterministic-mode", "--deterministic-mode"):
        if s.chance(0.85):
            s.env.update(DETERMINISM_ENV)


def parallel(s: Sample) -> None:
    s.sizes["tp"] = s.rng.choice([1, 1, 2, 4])
    s.sizes["pp"] = s.rng.choice([1, 1, 2, 4])
    s.sizes["cp"] = s.rng.choice([1, 1, 1, 2])
    for key, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                      ("cp", "--context-parallel-size")):
        if s.sizes[key] > 1 and not s.add(f"{key}{s.sizes[key]}", flag, str(s.sizes[key])):
            s.sizes[key] = 1
    if s.sizes["tp"] > 1 and s.chance(0.6):
        s.add("sequence-parallel", "--sequence-parallel")
        if s.chance(0.3):
            s.add("tp-comm-overlap", "--tp-comm-overlap")
    if s.sizes["pp"] > 1 and s.chance(0.35):
        vpp = s.first_known("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank")
        if vpp:
            s.add("virtual-pipeline", vpp, "1" if "layers" in vpp else "2")
    if s.sizes["pp"] > 1 and s.chance(0.25):
        s.add("defer-embedding-wgrad-compute", "--defer-embedding-wgrad-compute")
    if s.chance(0.7):
        s.env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"


def moe(s: Sample) -> None:
    if not s.chance(0.35):
        return
    experts = s.rng.choice([4, 8])
    if not s.add("moe", "--num-experts", str(experts), "--moe-router-topk", "2"):
        return
    s.moe = True
    s.sizes["ep"] = s.rng.choice([1, 2, 4])
    if s.sizes["ep"] > 1:
        s.add(f"ep{s.sizes['ep']}", "--expert-model-parallel-size", str(s.sizes["ep"]))
    if s.sizes["tp"] > 1 and s.chance(0.5):
        s.sizes["etp"] = 1
        s.add("etp1", "--expert-tensor-parallel-size", "1")
    if s.chance(0.6):
        s.add("moe-grouped-gemm", "--moe-grouped-gemm")
    if s.chance(0.6):
        dispatcher = s.rng.choice(["alltoall", "allgather", "flex"])
        s.add(f"dispatcher-{dispatcher}", "--moe-token-dispatcher-type", dispatcher)
        if dispatcher == "flex" and s.chance(0.5):
            backend = s.rng.choice(["deepep", "hybridep"])
            s.add(f"flex-{backend}", "--moe-flex-dispatcher-backend", backend)
    if s.chance(0.3):
        s.add("moe-shared-expert", "--moe-shared-expert-intermediate-size", "256")
    if s.chance(0.3):
        s.add("moe-permute-fusion", "--moe-permute-fusion")
    if s.chance(0.25):
        s.add("delay-wgrad-compute", "--delay-wgrad-compute")
        if s.chance(0.5):
            s.add("overlap-moe-ep-comm", "--overlap-moe-expert-parallel-comm")
    moe_router(s)
    moe_experts(s)


def moe_router(s: Sample) -> None:
    """The router options the fused router is judged against (issue 36)."""
    if s.chance(0.3):
        score = s.rng.choice(["sigmoid", "softmax", "sqrtsoftplus"])
        s.add(f"router-score-{score}", "--moe-router-score-function", score)
    if s.chance(0.2):
        s.add("router-group-limited", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1")
    if s.chance(0.15):
        s.add("router-force-load-balancing", "--moe-router-force-load-balancing")
    if s.chance(0.2):
        balancing = s.rng.choice(["aux_loss", "seq_aux_loss", "sinkhorn", "none", "quantile_balancing"])
        s.add(f"router-balancing-{balancing}", "--moe-router-load-balancing-type", balancing)
    if s.chance(0.15):
        s.add("router-expert-bias", "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid")
    if s.chance(0.1):
        s.add("routing-replay", "--moe-enable-routing-replay")
    if s.chance(0.15):
        s.add("moe-router-fusion", "--moe-router-fusion")


def moe_experts(s: Sample) -> None:
    """The expert options grouped GEMM is judged against: biases, the legacy path, the op fuser, recompute."""
    if s.chance(0.4):
        s.add("moe-disable-bias-linear", "--disable-bias-linear")
    elif s.chance(0.3):
        s.add("no-bias-dropout-fusion", "--no-bias-dropout-fusion")
    if s.chance(0.1):
        s.add("legacy-grouped-gemm", "--moe-use-legacy-grouped-gemm")
    if s.chance(0.1):
        s.add("te-op-fuser", "--use-transformer-engine-op-fuser")
    if s.chance(0.1):
        s.add("recompute-moe-act", "--recompute-granularity", "selective", "--recompute-modules", "moe_act")
    if s.chance(0.05):
        s.add("batch-invariant", "--batch-invariant-mode")


def attention(s: Sample) -> None:
    if s.chance(0.25):
        s.add("qk-layernorm", "--qk-layernorm")
    if s.chance(0.2):
        s.add("mla", "--multi-latent-attention", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "32",
              "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32")
    if s.chance(0.25):
        s.add("gqa", "--group-query-attention", "--num-query-groups", "4")
    position = s.rng.choice(["rope", "rope", "rope", "learned_absolute", "none"])
    s.add(f"position-{position}", "--position-embedding-type", position)
    if position == "rope" and s.chance(0.3):
        s.add("no-rope-fusion", "--no-rope-fusion")
    if s.chance(0.15):
        s.add("local-impl", "--transformer-impl", "local")
    if s.chance(0.3):
        s.add("swiglu", "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear")
    if s.chance(0.3):
        s.add("untie", "--untie-embeddings-and-output-weights")


def data_parallel(s: Sample) -> None:
    roll = s.rng.random()
    if roll < 0.15:
        s.add("torch-fsdp2", "--use-torch-fsdp2", "--ckpt-format", "torch_dist")
        if s.chance(0.5):
            s.add("untie", "--untie-embeddings-and-output-weights")
    elif roll < 0.3:
        fsdp = s.first_known("--use-megatron-fsdp", "--use-custom-fsdp")
        if fsdp and s.add("megatron-fsdp", fsdp, "--use-distributed-optimizer"):
            strategy = s.rng.choice(["no_shard", "optim", "optim_grads", "optim_grads_params"])
            s.add(f"sharding-{strategy}", "--data-parallel-sharding-strategy", strategy)
            fmt = "fsdp_dtensor" if s.chance(0.7) else "torch_dist"
            s.add(f"ckpt-{fmt}", "--ckpt-format", fmt)
    elif roll < 0.7:
        s.add("distributed-optimizer", "--use-distributed-optimizer")
        if s.chance(0.6):
            s.add("overlap-grad-reduce", "--overlap-grad-reduce")
            if s.chance(0.6):
                s.add("overlap-param-gather", "--overlap-param-gather")
        if s.chance(0.25):
            s.add("precision-aware-optimizer", "--use-precision-aware-optimizer")
            if s.chance(0.5):
                s.add("main-grads-bf16", "--main-grads-dtype", "bf16")
    elif s.chance(0.5):
        s.add("overlap-grad-reduce", "--overlap-grad-reduce")


def training(s: Sample) -> None:
    if s.chance(0.25):
        s.add("per-token-loss", "--calculate-per-token-loss")
    if s.chance(0.2):
        s.add("accumulate-allreduce-fp32", "--accumulate-allreduce-grads-in-fp32")
    if s.chance(0.2):
        granularity = s.rng.choice(["full", "selective"])
        if granularity == "full":
            s.add("recompute-full", "--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1")
        else:
            s.add("recompute-selective", "--recompute-granularity", "selective")
    if s.chance(0.15):
        s.add("mtp", "--mtp-num-layers", "1")
    if s.chance(0.15):
        cuda_graph = s.rng.choice(["impl-local", "impl-te", "enable", "external"])
        if cuda_graph.startswith("impl"):
            s.add(f"cuda-graph-{cuda_graph}", "--cuda-graph-impl", "local" if cuda_graph == "impl-local" else "transformer_engine")
        elif cuda_graph == "enable":
            s.add("enable-cuda-graph", "--enable-cuda-graph")
        else:
            s.add("external-cuda-graph", "--external-cuda-graph")
    if s.chance(0.2):
        s.add("no-grad-accum-fusion", "--no-gradient-accumulation-fusion")


def explicit_toggles(s: Sample) -> None:
    """Explicit toggle flags, only in the forms stock Megatron's parser knows (so stock can parse)."""
    from megatron_perf_toggles.core.registry import TOGGLES

    for toggle in TOGGLES:
        if not s.chance(0.12):
            continue
        value: Any = s.rng.choice(list(toggle.choices)) if toggle.kind == "choice" else s.rng.choice([True, False])
        words = toggle.flag_for(value)
        if words[0] in s.words:
            continue
        s.add(f"explicit-{toggle.dest}={value}", *words)


def logging_dirs(s: Sample, workdir: str, index: int) -> list[str]:
    dirs = []
    if s.chance(0.5):
        tb = f"{workdir}/s{index}/tb"
        s.add("tensorboard-dir", "--tensorboard-dir", tb)
        dirs.append(tb)
    if s.chance(0.3):
        save = f"{workdir}/s{index}/ckpt"
        s.add("save", "--save", save, "--save-interval", "5")
        dirs.append(save)
    return dirs


FEATURES: tuple[Callable[[Sample], None], ...] = (precision, determinism, parallel, moe, attention, data_parallel,
                                                   training, explicit_toggles)


def world_size(s: Sample, rng: random.Random) -> int:
    tp, pp, cp, ep = s.sizes["tp"], s.sizes["pp"], s.sizes["cp"], s.sizes["ep"]
    etp = s.sizes["etp"] or tp
    return math.lcm(tp * pp * cp, etp * ep * pp) * rng.choice([1, 2])


def generate(seed: int, count: int, option_strings: list[str], workdir: str) -> list[dict[str, Any]]:
    """``count`` samples for a parser with ``option_strings``; sample i uses seed ``seed * 100003 + i``."""
    known = set(option_strings)
    samples = []
    for index in range(count):
        rng = random.Random(seed * 100003 + index)
        s = Sample(rng, known)
        for feature in FEATURES:
            feature(s)
        dirs = logging_dirs(s, workdir, index)
        env = {**s.env, "WORLD_SIZE": str(world_size(s, rng)), "RANK": "0", "LOCAL_RANK": "0"}
        samples.append({"id": f"seed{seed}#{index}", "argv": [*BASE, *s.words], "env": env, "dirs": dirs,
                        "features": s.features, "modes": ["A", "B", "C1", "C2"]})
    return samples
