"""Mixture-of-experts presets over ``megatron-perf-toggles ablate`` on one H200: does each MoE
toggle (grouped GEMM, permute fusion, router fusion) keep the loss, and how fast is it.

Every MoE part is one ``ablate`` experiment with the same five arms, in the same blocks: stock
(every plugin toggle off), each MoE toggle alone, and the plugin defaults (every toggle on). Parts
(each its own directory under --out):

  loss     a small MoE model on real text (the standard library's sources as bytes, vocab 257),
           300 iterations; blocks are seeds (--block-seeds), 3 of them, and all 15 runs run at
           once on the one GPU (--concurrent: loss does not depend on timing); ablate's loss test
           compares each arm with stock seed by seed (paired differences, a 90 % interval, a
           three-way verdict against --loss-margin), on the mean loss over the last --loss-window
           iterations, or with --eval-iters N on the held-out validation loss at the end
  loss-dense  the same model without experts (a dense model: stock, each dense toggle alone and the
           defaults, 7 arms), so the dense toggles get their own loss test at the same size
  loss-control  the loss test's positive controls on the loss model: the command as given (the
           defaults) against a learning rate x0.3 and against Adam's epsilon at 1e-3, changes known
           to harm; the test must call them different
  loss-null  its null control: average in the collective alone against off, at one GPU, where it
           divides by 1 (exact math, the same runs): the test must call it equivalent
  speed-a  Mixtral-style: 4 layers, hidden 2048, 16 heads (8 query groups), 8 experts, top-2,
           expert FFN 4096; 3 interleaved blocks after a warm-up run, 40 iterations (20 left out:
           MoE step times still fall while the aux loss balances the routing)
  speed-b  fine-grained (Qwen3-MoE-like): the same with 64 experts, top-8, expert FFN 768

Both speed shapes: alltoall dispatcher, EP=1, seq 4096, micro-batch 4, global batch 4 (one
micro-batch a step: at micro-batch 1 the step was launch-bound and runs of one arm differed by a
third), mock data, bf16, distributed optimizer, aux-loss load balancing, Transformer Engine, one
fixed --seed in every arm. --headline narrows a speed part to stock against the defaults (2 arms);
--no-warmup-run drops the warm-up run where a part ran just before on the same machine (for a loss
part: ablate's compile warm-up, one short run of each arm that fills the compile caches so that the
runs starting together do not all compile the fused kernels at once; ablate makes it only where it
rides in the common starts' waves without adding one, so here in loss-common alone).
--force-balance gives every speed arm random, on-average balanced routing: with learnt routing the
step time follows how balanced the routing happens to be, which changes within a run and differs
between arms (their numerics differ, so their routing does); on speed-a at micro-batch 4 the same
arm's step time fell from about 200 to 140 ms within one 32-iteration run, and runs of one arm
differed by up to 25 % (a block-to-block spread of 14 %). Each run's
peak memory (Megatron's max allocated) is kept with the arm's arguments and environment in
results.json: the MoE memory model's validation data.

    python bench/moe_h200.py --megatron PATH --out DIR --parts loss --budget 6
    python bench/moe_h200.py --megatron PATH --out DIR --parts speed-a --budget 9   # again to resume
    python bench/moe_h200.py --megatron PATH --out DIR --smoke     # CPU: stand-in runs, real dry runs
    python bench/moe_h200.py --out DIR --collect SMALL             # results, statuses and logs, to copy

It prints the expected run time first. --budget stops cleanly and the same command resumes:
finished runs are skipped. A speed part stops before a run that would not fit (ablate
--split-blocks: a 16-run part does not fit one call, and a whole block of 5 runs left unstarted
would waste minutes), so its blocks may span two calls (the results name them); the loss part's
runs start together or not at all. The budget ablate gets leaves out the dry runs before its first
run (about a minute). Where the registry lacks the MoE toggles, the MoE arms are candidates (their
flags added to stock) and there is no defaults arm.
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from h200_ablate import REPO, STARTUP_S, base_env  # bench/ is on the path; this puts the repository there too

from megatron_perf_toggles.core.registry import BY_DEST, TOGGLES
from megatron_perf_toggles.tools.ablate.design import DEFAULT_TOGGLES

MOE_TOGGLES = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion")
MOE_FLAGS = {"grouped-gemm": "--moe-grouped-gemm", "permute-fusion": "--moe-permute-fusion",
             "router-fusion": "--moe-router-fusion"}
# The model every shape shares; a shape replaces or adds values.
COMMON = {
    "--num-layers": "4", "--hidden-size": "2048", "--num-attention-heads": "16", "--group-query-attention": None,
    "--num-query-groups": "8", "--seq-length": "4096", "--max-position-embeddings": "4096",
    "--position-embedding-type": "rope", "--normalization": "RMSNorm", "--swiglu": None,
    "--untie-embeddings-and-output-weights": None, "--disable-bias-linear": None, "--attention-dropout": "0.0",
    "--hidden-dropout": "0.0", "--transformer-impl": "transformer_engine", "--micro-batch-size": "4",
    "--global-batch-size": "4", "--lr": "3e-4", "--min-lr": "3e-5", "--lr-decay-style": "cosine",
    "--lr-warmup-iters": "2", "--weight-decay": "0.1", "--clip-grad": "1.0", "--init-method-std": "0.02",
    "--bf16": None, "--use-distributed-optimizer": None, "--tokenizer-type": "NullTokenizer",
    "--vocab-size": "32000", "--mock-data": None, "--seed": "1234", "--log-interval": "1", "--eval-iters": "0",
    "--eval-interval": "100000", "--log-throughput": None,
    # the peak of the whole run, not only after iteration 2 (Megatron's own report; core 0.16 and later)
    "--log-memory-interval": "10",
    "--num-experts": "8", "--moe-router-topk": "2", "--moe-ffn-hidden-size": "4096",
    "--moe-token-dispatcher-type": "alltoall", "--expert-model-parallel-size": "1",
    "--moe-router-load-balancing-type": "aux_loss", "--moe-aux-loss-coeff": "1e-2",
}
SHAPES: dict[str, dict[str, str | None]] = {
    "mixtral-a": {},
    "fine-b": {"--num-experts": "64", "--moe-router-topk": "8", "--moe-ffn-hidden-size": "768"},
    # small enough that 15 runs share one GPU; bytes as tokens (NullTokenizer, EOD 256)
    "loss-small": {"--hidden-size": "512", "--num-attention-heads": "8", "--num-query-groups": "4",
                   "--moe-ffn-hidden-size": "1024", "--seq-length": "1024", "--max-position-embeddings": "1024",
                   "--micro-batch-size": "8", "--global-batch-size": "8", "--lr": "1e-3", "--min-lr": "1e-4",
                   "--lr-warmup-iters": "20", "--vocab-size": "257", "--mock-data": "drop",
                   "--log-throughput": "drop"},
}
MOE_ONLY = ("--num-experts", "--expert-model-parallel-size")  # with every --moe-* flag: what a dense shape drops
SHAPES["loss-dense"] = {**SHAPES["loss-small"], **{f: "drop" for f in COMMON if f.startswith(("--moe-", *MOE_ONLY))}}


@dataclass(frozen=True)
class Part:
    shape: str
    iters: int
    warmup: int  # iterations left out of each run's medians
    seconds_per_iter: float  # the arms' mean on one H200 (stock is slower), for the estimate
    loss: bool = False  # seeds as blocks, all runs at once, the loss test; no speed
    dense: bool = False  # no experts: the dense toggles each alone
    design: tuple[str, ...] = ()  # the ablate design words, where not the MoE (or dense) each-alone
    n_arms: int = 0  # the arms of ``design``
    common_start: bool = False  # every arm of a seed loads that seed's one saved start (torch_dist)


PARTS = {"loss": Part("loss-small", 300, 8, 0.4, loss=True),
         "loss-dense": Part("loss-dense", 300, 8, 0.3, loss=True, dense=True),
         "loss-control": Part("loss-small", 300, 8, 0.4, loss=True, n_arms=3, design=(
             "--design", "candidates", "--candidate", "lr-x0.3=--lr 3e-4 --min-lr 3e-5",
             "--candidate", "adam-eps-1e-3=--adam-eps 1e-3")),
         "loss-null": Part("loss-small", 300, 8, 0.4, loss=True, n_arms=2, design=(
             "--design", "one-at-a-time", "--toggles", "ddp_average_in_collective", "--others", "off")),
         # the MoE defaults (grouped GEMM included) against stock, each seed's arms from one saved start
         # (ablate --common-start): paired by seed although grouped GEMM draws its weights another way
         "loss-common": Part("loss-small", 100, 8, 0.4, loss=True, n_arms=2, common_start=True,
                             design=("--design", "headline")),
         "speed-a": Part("mixtral-a", 40, 20, 0.3),
         "speed-b": Part("fine-b", 40, 20, 0.35)}
DRY_RUNS_S = 75.0  # 5 arms and the single-change probes of the toggles the defaults arm adds
LOSS_STARTUP_S = 90.0  # 15 runs starting at once share the CPU


def have_moe_toggles() -> bool:
    """Whether this package's registry has the MoE toggles (else the arms are candidates)."""
    return all(d in BY_DEST for d in MOE_TOGGLES)


def design_words(headline: bool = False, dense: bool = False) -> list[str]:
    """The ablate design: stock, each MoE toggle alone, the defaults (or, without the toggles in
    the registry, stock against each MoE flag and all three added as candidates); ``headline``:
    stock against the defaults only (every toggle off against every toggle on); ``dense``: stock,
    each dense toggle alone and the defaults."""
    if dense:
        return ["--design", "each-alone"]
    if have_moe_toggles():
        if headline:
            return ["--design", "headline"]
        return ["--design", "each-alone", "--toggles", ",".join(MOE_TOGGLES)]
    words = ["--design", "candidates"]
    for name, flag in MOE_FLAGS.items():
        words += ["--candidate", f"{name}={flag}"]
    return [*words, "--candidate", "all-moe=" + " ".join(MOE_FLAGS.values())]


def model_args(shape: str, data: str | None, eval_iters: int = 0, iters: int = 0) -> list[str]:
    """The shape's Megatron arguments; ``eval_iters`` > 0 (with ``data``): hold out 5 % of the text
    and evaluate ``eval_iters`` batches of it once, after the last iteration (the loss test's
    validation measure: the same held-out batches for every run)."""
    values = {**COMMON, **SHAPES[shape]}
    if eval_iters and data:
        values.update({"--eval-iters": str(eval_iters), "--eval-interval": str(max(iters, 1))})
    args: list[str] = []
    for flag, value in values.items():
        if value != "drop":
            args += [flag] if value is None else [flag, value]
    if data:
        args += ["--data-path", data, "--split", "95,5,0" if eval_iters else "100,0,0"]
    return args


def arms(headline: bool = False, dense: bool = False, part: str | None = None) -> int:
    """The arms of a part (``part``), else of the MoE design (``headline``: 2) or the dense one."""
    if part is not None and PARTS[part].n_arms:
        return PARTS[part].n_arms
    if part is not None:
        dense = PARTS[part].dense
    if dense:
        return 1 + len(DEFAULT_TOGGLES) + 1
    return 2 if headline else 1 + len(MOE_TOGGLES) + 1


def estimate_s(part: str, repeats: int, iters: int | None = None, headline: bool = False,
               warmup_run: bool = True) -> float:
    p = PARTS[part]
    iters_s = (iters or p.iters) * p.seconds_per_iter
    if p.loss:  # one batch of every run at once: about as long as one run, slowed by the sharing
        # ablate's compile warm-up costs no wave: it rides in the common starts' waves or is not made
        return DRY_RUNS_S + LOSS_STARTUP_S + iters_s
    return DRY_RUNS_S + (int(warmup_run) + repeats * arms(headline, part=part)) * (STARTUP_S + iters_s)


def compile_warmed(part: str, ns: argparse.Namespace) -> bool:
    """Whether ablate makes a loss part's compile warm-up: with --common-start, one warm-up per arm
    riding in the waves of the starts (one per seed), where that adds no wave (ablate's rule,
    schedule.compile_warmups; a memory check that runs fewer at once may still drop it)."""
    p = PARTS[part]
    if not p.loss or not p.common_start or ns.no_warmup_run:
        return False
    starts, warmups = ns.repeats, arms(part=part)
    k = ns.concurrent or ns.repeats * arms(part=part)
    return k > 1 and math.ceil((starts + warmups) / k) == math.ceil(starts / k)


def ablate_command(part: str, ns: argparse.Namespace, budget_min: float | None) -> tuple[list[str], dict[str, str]]:
    p = PARTS[part]
    # paths as given (relative to where it runs): a later call on a fresh machine, its --out copied
    # back, gets the same commands, so the runs done earlier count as done
    megatron = Path(ns.megatron)
    env = base_env(megatron.resolve(), ns.smoke)
    if not have_moe_toggles():  # stock: every plugin toggle off in the candidates' common run
        env.update({t.env: "0" for t in TOGGLES if t.kind == "bool"})
    if ns.smoke:
        launch = f"{sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"
    else:
        launch = sys.executable
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(ns.port + list(PARTS).index(part) * 100)),
                           ("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
            env.setdefault(key, value)
    iters = ns.iters or p.iters
    headline = ns.headline and not p.loss
    cmd = [sys.executable, "-m", "megatron_perf_toggles", "ablate", *(p.design or design_words(headline, p.dense)),
           "--out", str(Path(ns.out) / part),
           "--launch", launch, "--repeats", str(ns.repeats), "--iters", str(iters),
           "--warmup", str(min(p.warmup, iters // 2))]
    if p.loss:
        runs_at_once = ns.concurrent or ns.repeats * arms(part=part)
        cmd += ["--block-seeds", str(ns.base_seed), "--loss-window", str(min(ns.loss_window, iters)),
                "--loss-margin", f"{ns.loss_margin:g}", "--concurrent", str(runs_at_once)]
        if p.common_start:
            cmd.append("--common-start")
    if ns.no_warmup_run:
        cmd.append("--no-warmup-run")
    if budget_min is not None:  # ablate's clock starts after its dry runs; a speed part may stop mid-block
        cmd += ["--budget", f"{max(budget_min - DRY_RUNS_S / 60, 0.1):.2f}", *([] if p.loss else ["--split-blocks"])]
    data = corpus(ns) if p.loss else None
    cmd += [str(megatron / "pretrain_gpt.py"), "--", *model_args(p.shape, data, ns.eval_iters if p.loss else 0, iters)]
    if p.common_start:  # a torch_dist start loads across the expert layouts (grouped and sequential experts)
        cmd += ["--ckpt-format", "torch_dist"]
    if ns.force_balance and not p.loss:  # the step time of the kernels, not of the routing learnt so far
        cmd.append("--moe-router-force-load-balancing")
    return cmd, env


def corpus(ns: argparse.Namespace) -> str:
    """The real-text dataset's prefix: --data, else OUT/corpus/stdlib (written on first use)."""
    if ns.data:
        return str(ns.data)
    prefix = Path(ns.out) / "corpus" / "stdlib"
    if not Path(f"{prefix}.idx").is_file() and not ns.print_only:
        subprocess.run([sys.executable, "-m", "megatron_perf_toggles.tools.text_corpus", "--out", str(prefix.resolve()),
                        "--max-mb", "32"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return str(prefix)


def build_helpers(megatron: Path) -> None:
    """Megatron compiles its dataset helpers on first use, in each run; runs that start at once
    would all write the same library: build it once first (make does nothing when it is there)."""
    datasets = megatron / "megatron" / "core" / "datasets"
    if (datasets / "Makefile").is_file():
        subprocess.run(["make", "-C", str(datasets)], check=False, stdout=subprocess.DEVNULL)


def collect(out: Path, dest: Path) -> int:
    """Copy every part's results (json, md, png) and each run's status.json and log.txt to ``dest``:
    what the report reads, and what a later call on another machine needs to resume (copied back
    to the same --out path: a run counts as done by its status and is measured from its log)."""
    n = 0
    for path in sorted(out.glob("*/results.*")) + sorted(out.glob("*/runs/*/*/*")):
        if path.name in ("results.json", "results.md", "results.png", "status.json", "log.txt"):
            target = dest / path.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            n += 1
    print(f"collected {n} files from {out} into {dest}")
    return 0 if n else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", help="Megatron-LM checkout (pretrain_gpt.py)")
    ap.add_argument("--out", required=True, help="results directory; each part writes OUT/PART/results.*")
    ap.add_argument("--parts", default="loss,speed-a,speed-b", help=f"comma list of: {', '.join(PARTS)}")
    ap.add_argument("--repeats", type=int, default=3, help="blocks (for loss: seeds) per part (default 3)")
    ap.add_argument("--concurrent", type=int, help="loss parts: runs at once (default: every run of the part)")
    ap.add_argument("--iters", type=int, help="iterations per run (default: the part's: loss 300, speed 40)")
    ap.add_argument("--loss-window", type=int, default=50, help="loss: the last N iterations compared (default 50)")
    ap.add_argument("--base-seed", type=int, default=1234, help="loss: block i runs with --seed BASE+i")
    ap.add_argument("--loss-margin", type=float, default=1.0, metavar="PCT",
                    help="loss: the loss test's equivalence margin, in %% of stock's loss (default 1)")
    ap.add_argument("--eval-iters", type=int, default=0, metavar="N",
                    help="loss: hold out 5 %% of the text and compare the validation loss over N batches of it "
                    "after the last iteration (default 0: the training loss over --loss-window)")
    ap.add_argument("--budget", type=float, metavar="MINUTES", help="time for all parts of this call together")
    ap.add_argument("--data", metavar="PREFIX", help="loss: a real-text indexed dataset (default: OUT/corpus/stdlib)")
    ap.add_argument("--port", type=int, default=29611, help="first MASTER_PORT (each part its own range)")
    ap.add_argument("--headline", action="store_true",
                    help="speed parts: stock against the defaults only (2 arms), not each toggle alone")
    ap.add_argument("--force-balance", action="store_true",
                    help="speed parts: Megatron's --moe-router-force-load-balancing (random routing, balanced on "
                    "average) in every arm, so that step times do not follow the routing each run has learnt")
    ap.add_argument("--no-warmup-run", action="store_true",
                    help="speed parts: no unmeasured warm-up run (where a part ran just before on the same machine); "
                    "loss parts: no compile warm-up (one short run of each arm that fills the compile caches before "
                    "the runs start at once; ablate makes it only in the common starts' waves: loss-common)")
    ap.add_argument("--smoke", action="store_true", help="CPU: stand-in runs (tests/support/fake_megatron_run.py)")
    ap.add_argument("--print-only", action="store_true", help="print the plan and the commands, run nothing")
    ap.add_argument("--collect", metavar="DIR", help="copy each part's results, each run's status and log to DIR; run nothing")
    ns = ap.parse_args(argv)
    ns.part_list = [p.strip() for p in ns.parts.split(",") if p.strip()]
    unknown = [p for p in ns.part_list if p not in PARTS]
    if unknown or not ns.part_list:
        ap.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    if ns.collect is None and not (ns.megatron and (Path(ns.megatron) / "pretrain_gpt.py").is_file()):
        ap.error(f"--megatron {ns.megatron}: no pretrain_gpt.py there")
    if ns.repeats < 1 or (ns.iters is not None and ns.iters < 2) or ns.loss_window < 1:
        ap.error("--repeats and --loss-window: at least 1; --iters: at least 2")
    if not ns.loss_margin > 0 or ns.eval_iters < 0:
        ap.error("--loss-margin: above 0; --eval-iters: 0 or more")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    out = Path(ns.out)
    if ns.collect:
        return collect(out, Path(ns.collect))
    mode = "MoE toggles from the registry" if have_moe_toggles() else "MoE flags as candidates (no toggles yet)"
    print(f"plan: {arms()} arms ({mode}), {ns.repeats} blocks per part" + (" (smoke: stand-in runs)" if ns.smoke
                                                                             else ""))
    total = 0.0
    for part in ns.part_list:
        loss, headline = PARTS[part].loss, ns.headline and not PARTS[part].loss
        warm = not ns.no_warmup_run
        est = estimate_s(part, ns.repeats, ns.iters, headline, warm)
        total += est
        how = (("all at once, after a compile warm-up with the common starts" if compile_warmed(part, ns)
                else "all at once") if loss else ("1 warm-up run, then " if warm else "") + "one at a time")
        print(f"  {part:<8} {ns.repeats * arms(headline, part=part) + int(warm and not loss):>3} runs ({how})  "
              f"~{est / 60:5.1f} min  -> {out / part}")
    print(f"expected: ~{total / 60:.1f} min on the H200" + (f" (budget {ns.budget:g} min)" if ns.budget else ""),
          flush=True)
    start, worst = time.monotonic(), 0
    if not ns.smoke and not ns.print_only and any(PARTS[p].loss for p in ns.part_list):
        build_helpers(Path(ns.megatron).resolve())
    for part in ns.part_list:
        left = None if ns.budget is None else ns.budget - (time.monotonic() - start) / 60
        if left is not None and left <= 0:
            print(f"[{part}] skipped: the budget is spent", flush=True)
            worst = max(worst, 1)
            continue
        cmd, env = ablate_command(part, ns, left)
        print(f"[{part}] {shlex.join(cmd)}", flush=True)
        if not ns.print_only:
            code = subprocess.call(cmd, env=env)
            print(f"[{part}] exit {code} after {(time.monotonic() - start) / 60:.1f} min; results in {out / part}",
                  flush=True)
            worst = max(worst, code)
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
