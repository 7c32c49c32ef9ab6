"""Loss evidence for the defaults on one H200: three ``ablate`` experiments side by side, seeds as blocks.

Every experiment pairs its arms by seed (``--block-seeds``: every arm of a block has that block's
seed, so the same initial weights and the same data order) and runs many small runs at once
(``--concurrent``: loss does not depend on timing). Each run trains on real text (the standard
library's sources as byte tokens) and evaluates every ``EVAL_INTERVAL`` iterations on a held-out
split (the same held-out sequences for every arm of a seed), so the loss test can use a held-out
loss as well as a window of training losses.

  moe       a small MoE model: the defaults against the same model with only grouped GEMM on (both
            arms lay experts out as grouped GEMM does, so they start from the same weights; grouped
            GEMM itself is covered by bench/numerics_check.py, exact math from one state)
  dense     a small dense model: stock, bf16 gradient reduction alone, and the defaults
            (two micro-batches a step, so gradients are accumulated, the part of bf16 reduction
            one GPU can exercise)
  controls  the same dense model: stock, a learning rate halved (a known change: at 100 iterations it
            lowers the loss) and a null arm (stock again, with an unrelated environment variable
            set: the negative control)
  harm      the same dense model: stock and a learning rate a tenth of stock's (the positive
            control: a change known to harm the loss at this scale)

    python bench/evidence_h200.py --megatron PATH --out DIR [--seeds 10] [--budget MINUTES]
    python bench/evidence_h200.py --megatron PATH --out DIR --smoke   # CPU: stand-in runs

The same command resumes: finished runs are skipped. It prints the commands and the expected time.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from h200_ablate import REPO, base_env  # bench/ is on the path; this puts the repository there too
from moe_h200 import COMMON, SHAPES, build_helpers

EVAL_INTERVAL = 50
DENSE_TOGGLES = ("gradient_accumulation_fusion", "grad_reduce_in_bf16", "ddp_average_in_collective",
                 "cross_entropy_loss_fusion", "fused_single_qkv_rope")
MOE_FUSIONS = ("moe_permute_fusion", "moe_router_fusion")
# name -> (ablate design words, shape, arms)
EXPERIMENTS: dict[str, tuple[list[str], str, int]] = {
    "moe": (["--design", "headline", "--toggles", ",".join((*DENSE_TOGGLES, *MOE_FUSIONS))], "moe", 2),
    "dense": (["--design", "each-alone", "--toggles", "grad_reduce_in_bf16"], "dense", 3),
    "controls": (["--design", "candidates", "--others", "off", "--candidate", "lr-half=--lr 5e-4 --min-lr 5e-5",
                  "--candidate", "null=PYTHONHASHSEED=0"], "dense", 3),
    "harm": (["--design", "candidates", "--others", "off", "--candidate", "lr-tenth=--lr 1e-4 --min-lr 1e-5"],
             "dense", 2),
}
DENSE_DROP = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-token-dispatcher-type",
              "--expert-model-parallel-size", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff")


def model_args(shape: str, data: str, iters: int) -> list[str]:
    """The loss-small model of bench/moe_h200.py (dense: without experts, an FFN of 1408 and two
    micro-batches of 4 a step), on ``data`` with a held-out split evaluated every EVAL_INTERVAL."""
    values = {**COMMON, **SHAPES["loss-small"]}
    if shape == "dense":
        values = {k: v for k, v in values.items() if k not in DENSE_DROP}
        values.update({"--ffn-hidden-size": "1408", "--micro-batch-size": "4"})
    else:
        values["--moe-grouped-gemm"] = None  # every arm: the experts' layout (and so their initial weights) alike
    values.update({"--eval-iters": "4", "--eval-interval": str(EVAL_INTERVAL), "--log-memory-interval": "drop"})
    args: list[str] = []
    for flag, value in values.items():
        if value != "drop":
            args += [flag] if value is None else [flag, value]
    return [*args, "--data-path", data, "--split", "90,10,0"]


def ablate_command(name: str, ns: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    design, shape, arms = EXPERIMENTS[name]
    megatron = Path(ns.megatron).resolve()
    env = base_env(megatron, ns.smoke)
    if ns.smoke:
        launch = f"{sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"
    else:
        launch = sys.executable
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    cmd = [sys.executable, "-m", "megatron_perf_toggles", "ablate", *design, "--out", str(Path(ns.out) / name),
           "--launch", launch, "--repeats", str(ns.seeds), "--iters", str(ns.iters), "--warmup", "0",
           "--block-seeds", str(ns.base_seed), "--loss-window", str(min(ns.loss_window, ns.iters)),
           "--concurrent", str(max(1, ns.concurrent * arms // 8)), "--no-warmup-run"]
    if ns.budget is not None:
        cmd += ["--budget", f"{ns.budget:.2f}"]
    data = str(Path(ns.out).resolve() / "corpus" / "stdlib")
    cmd += [str(megatron / "pretrain_gpt.py"), "--", *model_args(shape, data, ns.iters)]
    return cmd, env


def corpus(out: Path) -> None:
    prefix = out / "corpus" / "stdlib"
    if not Path(f"{prefix}.idx").is_file():
        subprocess.run([sys.executable, "-m", "megatron_perf_toggles.tools.text_corpus", "--out", str(prefix.resolve()),
                        "--max-mb", "32"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="Megatron-LM checkout (pretrain_gpt.py)")
    ap.add_argument("--out", required=True, help="results directory; each experiment writes OUT/NAME/")
    ap.add_argument("--parts", default="moe,dense,controls", help=f"comma list of: {', '.join(EXPERIMENTS)}")
    ap.add_argument("--seeds", type=int, default=10, help="seeds (blocks) per experiment (default 10)")
    ap.add_argument("--base-seed", type=int, default=1234)
    ap.add_argument("--iters", type=int, default=100, help="iterations per run (default 100)")
    ap.add_argument("--loss-window", type=int, default=20)
    ap.add_argument("--concurrent", type=int, default=32, help="runs at once over all experiments (default 32)")
    ap.add_argument("--budget", type=float, metavar="MINUTES", help="each ablate starts no batch past this")
    ap.add_argument("--smoke", action="store_true", help="stand-in runs (no GPU), real dry runs")
    ap.add_argument("--print-only", action="store_true", help="print the commands, run nothing")
    ns = ap.parse_args(argv)
    ns.part_list = [p.strip() for p in ns.parts.split(",") if p.strip()]
    bad = [p for p in ns.part_list if p not in EXPERIMENTS]
    if bad or ns.seeds < 2 or ns.iters < EVAL_INTERVAL:
        ap.error(f"unknown part {bad[0]!r}" if bad else "--seeds needs 2 or more, --iters at least "
                 f"{EVAL_INTERVAL}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    out = Path(ns.out)
    runs = sum(EXPERIMENTS[p][2] for p in ns.part_list) * ns.seeds
    print(f"plan: {len(ns.part_list)} experiments side by side, {runs} runs of {ns.iters} iterations, "
          f"about {ns.concurrent} at a time", flush=True)
    if not ns.print_only:
        out.mkdir(parents=True, exist_ok=True)
        corpus(out)
        if not ns.smoke:
            build_helpers(Path(ns.megatron).resolve())
    procs = []
    for i, part in enumerate(ns.part_list):
        cmd, env = ablate_command(part, ns, 29500 + 100 * i)
        print(f"[{part}] {shlex.join(cmd)}", flush=True)
        if not ns.print_only:
            log = open(out / f"{part}.log", "a")
            procs.append((part, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    start, worst = time.monotonic(), 0
    for part, proc, log in procs:
        code = proc.wait()
        log.close()
        print(f"[{part}] exit {code} after {(time.monotonic() - start) / 60:.1f} min", flush=True)
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
