"""Router and permute fusion over the MoE shapes users run: where each is faster, where slower.

Each shape is one layer-level measurement (``megatron-perf-toggles layers``' units ``router`` and
``dispatcher``): the module built from Megatron's own config, stock and fused, timed forward and
backward with the arms interleaved, a 95 % interval each. One base command line is planned once
through the checkout's parse and validate; each shape changes only the MoE sizes it varies (experts,
top-k, hidden size, tokens per micro-batch, score function, dispatcher), so the grid costs no
planning per shape. EP 1 on one GPU: the rule it gives covers these shapes and says so.

The grid is priced before it runs (the first shape's seconds x the shapes left, against
--budget-s), and results are written after every shape, so a later call resumes where one stopped:

    python bench/moe_sweep.py --megatron PATH --out DIR [--budget-s 300] [--blocks 30]
    python bench/moe_sweep.py --out DIR --print-grid        # the grid, no GPU
    python bench/moe_sweep.py --out DIR --plot              # DIR/sweep.png from DIR/sweep.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

BASE = dict(num_experts=64, moe_router_topk=6, hidden_size=2048, tokens=8192, score="sigmoid", dispatcher="alltoall")
VARY: dict[str, list[Any]] = {
    "num_experts": [8, 16, 32, 128, 256],
    "moe_router_topk": [1, 2, 4, 8],
    "hidden_size": [1024, 4096, 7168],
    "tokens": [2048, 4096, 16384],
}
NAMED = [  # shapes of released models (EP 1, one micro-batch of 4096 or 8192 tokens)
    dict(num_experts=8, moe_router_topk=2, hidden_size=4096, tokens=8192, score="softmax", dispatcher="alltoall"),
    dict(num_experts=128, moe_router_topk=8, hidden_size=2048, tokens=8192, score="softmax", dispatcher="alltoall"),
    dict(num_experts=256, moe_router_topk=8, hidden_size=7168, tokens=4096, score="sigmoid", dispatcher="alltoall"),
    dict(num_experts=64, moe_router_topk=6, hidden_size=2048, tokens=8192, score="softmax", dispatcher="allgather"),
    dict(num_experts=8, moe_router_topk=2, hidden_size=4096, tokens=8192, score="softmax", dispatcher="allgather"),
]
BASE_ARGS = ("--num-layers 1 --hidden-size 2048 --num-attention-heads 16 --seq-length 4096 --max-position-embeddings "
             "4096 --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
             "--transformer-impl transformer_engine --micro-batch-size 1 --global-batch-size 1 --lr 1e-4 --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --train-iters 10 --num-experts 64 "
             "--moe-router-topk 6 --moe-ffn-hidden-size 1024 --moe-router-load-balancing-type aux_loss "
             "--moe-aux-loss-coeff 1e-2").split()


def grid() -> list[dict[str, Any]]:
    """About 40 shapes: the base, each size varied alone, under both score functions; the dispatcher
    varied; and shapes of released models."""
    shapes: list[dict[str, Any]] = []
    for score in ("sigmoid", "softmax"):
        shapes.append({**BASE, "score": score})
        for key, values in VARY.items():
            shapes += [{**BASE, key: v, "score": score} for v in values]
    shapes.append({**BASE, "dispatcher": "allgather"})
    shapes += NAMED
    out, seen = [], set()
    for s in shapes:
        if s["moe_router_topk"] <= s["num_experts"] and (k := name(s)) not in seen:
            seen.add(k)
            out.append(s)
    return out


def name(s: dict[str, Any]) -> str:
    return (f"E{s['num_experts']}-k{s['moe_router_topk']}-H{s['hidden_size']}-T{s['tokens']}-{s['score']}-"
            f"{s['dispatcher']}")


def shape_args(base: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """The base plan's arguments with this shape's MoE sizes (sigmoid: with expert bias)."""
    heads = s["hidden_size"] // 128
    return {**base, "num_experts": s["num_experts"], "moe_router_topk": s["moe_router_topk"],
            "hidden_size": s["hidden_size"], "num_attention_heads": heads, "num_query_groups": heads,
            "kv_channels": 128, "seq_length": s["tokens"], "micro_batch_size": 1,
            "moe_router_score_function": s["score"], "moe_router_enable_expert_bias": s["score"] == "sigmoid",
            "moe_token_dispatcher_type": s["dispatcher"]}


def measure_shape(args: dict[str, Any], blocks: int, warmup: int, seed: int) -> dict[str, Any]:
    from megatron_perf_toggles.core.registry import BY_DEST
    from megatron_perf_toggles.tools.layers import gpu_units
    from megatron_perf_toggles.tools.layers.shard import one_gpu_args, shard_of

    shard = shard_of(args)
    one = one_gpu_args(args, shard)
    out = {}
    for dest, unit in (("moe_router_fusion", "router"), ("moe_permute_fusion", "dispatcher")):
        result = gpu_units.measured(gpu_units.Job(one, shard, BY_DEST[dest], seed, True), unit, blocks, warmup, seed)
        # the sweep keeps the speedups and peaks of each shape (its file stays small: no per-block timings)
        out[dest] = {k: v for k, v in result.items() if k in ("error", "gpu", "wall", "peak_mb")}
    return out


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"format": "megatron-perf-toggles/moe-sweep",
                                                               "shapes": {}}


def save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def run(ns: argparse.Namespace, path: Path) -> int:
    from megatron_perf_toggles.runtime.machine.target import make_target
    from megatron_perf_toggles.tools.layers import gpu_build
    from megatron_perf_toggles.tools.planning import validated_arguments

    data = load(path)
    todo = [s for s in grid() if name(s) not in data["shapes"]]
    print(f"{len(todo)} of {len(grid())} shapes to run", flush=True)
    if not todo:
        return 0
    _plan, label, validated = validated_arguments(ns.megatron, BASE_ARGS, make_target(world_size=1))
    base = vars(validated)
    sys.path.insert(0, str(Path(ns.megatron).resolve()))
    gpu_build.init_one_rank(ns.seed)
    data.update(planned_with=label, blocks=ns.blocks, warmup=ns.warmup, seed=ns.seed, versions=_versions())
    started, done = time.monotonic(), 0
    for s in todo:
        t0 = time.monotonic()
        data["shapes"][name(s)] = {"shape": s, **measure_shape(shape_args(base, s), ns.blocks, ns.warmup, ns.seed)}
        save(path, data)
        done += 1
        per = (time.monotonic() - started) / done
        print(f"[{done}/{len(todo)}] {name(s)}: {time.monotonic() - t0:.1f} s; "
              f"priced: {per:.1f} s a shape, {per * (len(todo) - done):.0f} s for the rest", flush=True)
        if time.monotonic() - started + per > ns.budget_s:
            print(f"stopping inside the budget ({ns.budget_s:.0f} s): {len(todo) - done} shapes left; "
                  "run again to resume", flush=True)
            break
    return 0


def _versions() -> dict[str, Any]:
    import torch

    from megatron_perf_toggles.runtime.machine.probe import dist_version

    return {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "transformer_engine": dist_version("transformer-engine", "transformer_engine")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", help="Megatron-LM checkout")
    ap.add_argument("--out", required=True, help="directory: sweep.json (resumed), sweep.png")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop before this many seconds (default 420)")
    ap.add_argument("--print-grid", action="store_true")
    ap.add_argument("--plot", action="store_true")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    if ns.print_grid:
        for s in grid():
            print(name(s))
        print(f"{len(grid())} shapes")
        return 0
    if ns.plot:
        return plot(load(out / "sweep.json"), out / "sweep.png")
    if not ns.megatron:
        ap.error("--megatron PATH is needed to run the sweep")
    return run(ns, out / "sweep.json")


def routed(shape: dict[str, Any]) -> int:
    """Elements the dispatcher permutes per micro-batch: tokens x top-k x hidden (the rule's measure)."""
    return shape["tokens"] * shape["moe_router_topk"] * shape["hidden_size"]


def _interval(ax: Any, x: float, sp: dict[str, Any], marker: str, label: str | None = None) -> None:
    color = "tab:green" if sp["low"] > 1 else "tab:red" if sp["high"] < 1 else "tab:gray"
    ax.plot([x, x], [sp["low"], sp["high"]], color=color, lw=1)
    ax.plot(x, sp["estimate"], marker, color=color, ms=4, label=label)


def plot(data: dict[str, Any], path: Path) -> int:
    """Both fusions' speedups (95 %) against the elements each shape routes: GPU time (triangles) and
    wall time with the launches (circles); green faster, red slower, grey no detectable difference;
    the permute rule's thresholds as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_perf_toggles.core.rules.guards_moe import PF_SLOWER_BELOW

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, dest in zip(axes, ("moe_router_fusion", "moe_permute_fusion"), strict=True):
        for row in data["shapes"].values():
            result = row.get(dest) or {}
            x = routed(row["shape"]) / 2**20 * (1.04 if row["shape"]["dispatcher"] == "allgather" else 1.0)
            for clock, marker in (("gpu", "^"), ("wall", "o")):
                sp = (result.get(clock) or {}).get("speedup") or {}
                if sp.get("low") is not None:
                    _interval(ax, x, sp, marker)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("elements routed per micro-batch (tokens x top-k x hidden), Mi")
        ax.set_title(f"{dest}: x on its unit (^ GPU time, o wall time), 95 %")
    for name, limit in PF_SLOWER_BELOW.items():
        axes[1].axvline(limit / 2**20, ls="--", lw=0.8, color="tab:blue" if name == "alltoall" else "tab:orange",
                        label=f"off below ({name})")
    axes[1].legend(loc="upper left", fontsize=8)
    axes[0].set_ylabel("speedup (stock time / fused time)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
