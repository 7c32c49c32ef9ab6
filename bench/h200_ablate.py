"""Benchmark presets over ``megatron-perf-toggles ablate``: every published throughput number comes
from repeated, interleaved ablate runs with intervals.

The model is the reference one: Llama-3-8B-shaped layers (hidden 4096, ffn 14336, 32 heads, 8 KV
groups), 4 layers, seq 4096, micro-batch 2, global batch 16, vocab 128256, mock data, distributed
optimizer, bf16, Transformer Engine, no checkpoints. Parts (each one ``ablate`` call, its own
directory under --out):

  headline        all five toggles off against all on (the plugin defaults)
  noop            the planted no-op: ddp_average_in_collective alone against all off, at DP=1
  one-at-a-time   all off, then each toggle alone
  leave-one-out   all on, then each toggle off
  fp8-delayed     headline with FP8 (hybrid format, delayed scaling)
  fp8-tensorwise  headline with FP8 (e4m3, tensorwise scaling)
  fp8-one-at-a-time  one-at-a-time with FP8 (hybrid format, delayed scaling): each toggle's memory
                  under FP8
  lean-ce         the plugin defaults (cross-entropy fusion through Transformer Engine, where the
                  Megatron version allows it) against the same with Megatron's native fused cross
                  entropy: speed and peak memory of the two implementations
  dp2             headline at DP=2 (torchrun, 2 GPUs)
  candidates      at DP=1, the plugin defaults against each candidate added to them: manual GC, and
                  CUDA graphs of the transformer layers through Transformer Engine
  candidates2     at DP=1, a second round: no attention mask from the data loader (the fused kernels
                  take the causal mask from the layer spec), PyTorch's expandable-segments allocator,
                  no per-micro-batch NaN check (neutral, but it removes a safety check), and one CUDA
                  graph of the whole forward-backward step (which needs the NaN check off)
  dp2-candidates  at DP=2, the plugin defaults against each candidate added to them: overlapping the
                  gradient reduce (and the parameter gather) with compute, and manual GC
  tp2-candidates  at TP=2 with sequence parallelism (torchrun, 2 GPUs), the plugin defaults against
                  overlapping the tensor-parallel communication with the GEMMs (--tp-comm-overlap)
  tune            ``megatron-perf-toggles tune`` on this model, one GPU: writes OUT/tune/profile.json
  dp2-tune        the same at DP=2 (torchrun, 2 GPUs)
  dp2-buckets     at DP=2 with the gradient reduce overlapped, Megatron's gradient bucket size against
                  buckets of at least 10M, 160M and 640M parameters (18, 6 and 3 buckets, against 14)

    python bench/h200_ablate.py --megatron PATH --out DIR --parts headline,noop --budget 20
    python bench/h200_ablate.py --megatron PATH --out DIR --smoke     # CPU: stand-in runs, real dry runs
    python bench/h200_ablate.py --megatron PATH --out DIR --devices 0,1 --parts one-at-a-time,leave-one-out,dp2

--toggles LIST narrows the parts that vary toggles (headline, one-at-a-time, leave-one-out, the fp8
and dp2 headlines, tune) to the toggles named; the others keep the plugin defaults in every arm. No
part takes the plugin's variables (a toggle's, a profile, the switch) from the caller's shell.

With --devices, one-GPU parts run side by side, one per listed GPU (each with its own port and log
OUT/PART.log); a part that needs several GPUs waits until the parts before it are done and then runs
alone. Arms are only ever compared inside one part, so a neighbour on another GPU cannot favour one
arm. Running the same command again with the same --out resumes: finished runs are skipped.

It prints the expected run time first. --smoke runs the same parts on CPU: the arms' dry runs go
through the given Megatron tree's real parser, the runs themselves through tests/support/fake_megatron_run.py.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_perf_toggles.core.registry import SETTINGS, TOGGLES  # noqa: E402
from megatron_perf_toggles.errors import PerfTogglesError  # noqa: E402
from megatron_perf_toggles.tools.ablate.runs import set_args  # noqa: E402
from megatron_perf_toggles.tools.ablate.spec import parse_toggles  # noqa: E402
from megatron_perf_toggles.tools.llama3_8b import LLAMA3_8B_BF16  # noqa: E402

# The reference model: the package's one Llama-3-8B definition, cut to 4 layers and a 16-sequence
# batch of 4096 tokens, without what a speed ablation must not carry (the DP-overlap settings are
# candidates of their own, the schedule and logging are the run's), plus short-run bookkeeping.
_CUT = set_args(
    set_args(LLAMA3_8B_BF16, dict.fromkeys(
        ("--overlap-grad-reduce", "--overlap-param-gather", "--optimizer", "--adam-beta1", "--adam-beta2",
         "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--train-iters", "--tensorboard-dir"))),
    {"--num-layers": "4", "--seq-length": "4096", "--max-position-embeddings": "4096", "--global-batch-size": "16",
     "--lr-warmup-iters": "2", "--seed": "1234", "--log-interval": "1", "--eval-iters": "0",
     "--eval-interval": "100000"},
)
MODEL = [*_CUT, "--log-throughput"]
# A small model of the same family for quick optimizer experiments: values that replace the reference ones.
SMALL = {"--num-layers": "4", "--hidden-size": "1024", "--ffn-hidden-size": "3584", "--num-attention-heads": "16",
         "--num-query-groups": "4", "--seq-length": "1024", "--max-position-embeddings": "1024",
         "--micro-batch-size": "8", "--global-batch-size": "32"}
FP8 = {"delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
       "tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]}
# A logits-heavy model: a large vocabulary over a small hidden size and four sequences of 4096 tokens
# per micro-batch, so the output layer's logits dominate the activations (peak-memory validation).
LOGITS_HEAVY = {"--hidden-size": "1024", "--ffn-hidden-size": "3584", "--num-attention-heads": "16",
                "--num-query-groups": "4", "--micro-batch-size": "4", "--global-batch-size": "16",
                "--vocab-size": "256000"}
SHAPES = {"llama3-8b-4l": {}, "small": SMALL, "logits-heavy": LOGITS_HEAVY}
# part -> (the subcommand and its design options, extra Megatron args, GPUs)
PARTS: dict[str, tuple[list[str], list[str], int]] = {
    "headline": (["ablate", "--design", "headline"], [], 1),
    "noop": (["ablate", "--design", "one-at-a-time", "--toggles", "ddp_average_in_collective", "--others", "off"], [], 1),
    "one-at-a-time": (["ablate", "--design", "one-at-a-time"], [], 1),
    "leave-one-out": (["ablate", "--design", "leave-one-out"], [], 1),
    "fp8-delayed": (["ablate", "--design", "headline"], FP8["delayed"], 1),
    "fp8-tensorwise": (["ablate", "--design", "headline"], FP8["tensorwise"], 1),
    "fp8-one-at-a-time": (["ablate", "--design", "one-at-a-time"], FP8["delayed"], 1),
    "lean-ce": (["ablate", "--design", "candidates",
                 "--candidate", "native-ce=--cross-entropy-fusion-impl native"], [], 1),
    "dp2": (["ablate", "--design", "headline"], [], 2),
    "candidates": (["ablate", "--design", "candidates", "--candidate", "manual-gc=--manual-gc",
                    "--candidate", "cuda-graphs-te=--cuda-graph-impl transformer_engine"], [], 1),
    "candidates2": (["ablate", "--design", "candidates",
                     "--candidate", "no-attention-mask=--no-create-attention-mask-in-dataloader",
                     "--candidate", "expandable-segments=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                     "--candidate", "no-nan-check=--no-check-for-nan-in-loss-and-grad",
                     "--candidate", "cuda-graph-step=--cuda-graph-impl full_iteration "
                     "--no-check-for-nan-in-loss-and-grad"], [], 1),
    "dp2-candidates": (["ablate", "--design", "candidates",
                        "--candidate", "overlap-grad-reduce=--overlap-grad-reduce",
                        "--candidate", "overlap-grad-and-param=--overlap-grad-reduce --overlap-param-gather",
                        "--candidate", "manual-gc=--manual-gc"], [], 2),
    "tp2-candidates": (["ablate", "--design", "candidates", "--candidate", "tp-comm-overlap=--tp-comm-overlap"],
                       ["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    "tune": (["tune"], [], 1),
    "dp2-tune": (["tune"], [], 2),
    # Megatron uses buckets only while the reduce overlaps the backward pass (else one buffer-wide
    # reduce at the end), so every arm overlaps it; the baseline keeps Megatron's own size,
    # max(40M, 1M x DP) parameters. A bucket holds whole weights (in backward order, closed once it
    # reaches the size), so on this 1.9B-parameter model, with its two 525M-parameter embedding
    # and output weights: 14 buckets at 40M, 18 at 10M (one weight each: the finest there is), 6 at
    # 160M, 3 at 640M
    "dp2-buckets": (["ablate", "--design", "candidates",
                     "--candidate", "bucket-10M=--ddp-bucket-size 10000000",
                     "--candidate", "bucket-160M=--ddp-bucket-size 160000000",
                     "--candidate", "bucket-640M=--ddp-bucket-size 640000000"], ["--overlap-grad-reduce"], 2),
}
ARMS = {"headline": 2, "noop": 2, "one-at-a-time": 6, "leave-one-out": 6, "fp8-delayed": 2, "fp8-tensorwise": 2,
        "fp8-one-at-a-time": 6, "lean-ce": 2,
        "dp2": 2, "candidates": 3, "candidates2": 5, "dp2-candidates": 4, "tp2-candidates": 2,
        # tune, at most: leave-one-out of five toggles (6 arms), a factorial of up to 3 (8 arms), then
        # the confirmation (2 arms) where the chosen values differ from the defaults
        "tune": 16, "dp2-tune": 16, "dp2-buckets": 4}
# Parts that take no --toggles, with why.
FIXED_TOGGLES = {part: "names its own toggles" if "--toggles" in design else "compares candidates, it varies no toggle"
                 for part, (design, _, _) in PARTS.items() if "--toggles" in design or "candidates" in design}
# The plugin's variables, which no part takes from the caller's shell (see base_env).
PLUGIN_VARS = frozenset(t.env for t in TOGGLES) | frozenset(s.env for s in SETTINGS)
# Seconds per iteration on one H200 (bf16 and fp8, from earlier runs of this model), and the
# start-up of one run (Python, Megatron, TE, CUDA context, mock dataset).
SECONDS_PER_ITER = {"bf16": 1.2, "fp8": 1.0, "dp2": 1.3}
STARTUP_S = 40.0
DRY_RUNS_S = 30.0


def model_args(shape: str, data: str | None) -> list[str]:
    args = list(MODEL)
    for flag, value in SHAPES[shape].items():
        args[args.index(flag) + 1] = value
    if data:  # bytes as tokens, NullTokenizer's EOD 256 (megatron_perf_toggles.tools.text_corpus)
        args[args.index("--vocab-size") + 1] = "257"
        args.remove("--mock-data")
        args += ["--data-path", data, "--split", "100,0,0"]
    return args


def arms_of(part: str, toggles: int | None = None) -> int:
    """Arms a block of the part runs; ``toggles``: how many --toggles names (default: all five)."""
    if toggles is None or part not in ("one-at-a-time", "fp8-one-at-a-time", "leave-one-out", "tune", "dp2-tune"):
        return ARMS[part]
    return toggles + 1 + (2 ** min(toggles, 3) + 2 if "tune" in part else 0)


def estimate_s(part: str, repeats: int, iters: int, toggles: int | None = None, no_warmup_run: bool = False) -> float:
    per_iter = SECONDS_PER_ITER["dp2" if part.startswith(("dp2", "tp2")) else "fp8" if part.startswith("fp8") else "bf16"]
    runs = (0 if no_warmup_run else 1) + repeats * arms_of(part, toggles)
    return DRY_RUNS_S + runs * (STARTUP_S + iters * per_iter)


def base_env(megatron: Path, smoke: bool) -> dict[str, str]:
    # every part measures the plugin's own defaults: none of its variables (a toggle's, a profile,
    # the switch) comes from the caller's shell, so a toggle no arm names is at its default
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES") and k not in PLUGIN_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(megatron), str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env.setdefault("NO_VCS_VERSION", "1")  # else Megatron appends `git rev-parse HEAD` of an enclosing checkout
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    if smoke:  # no GPU here: plan for the H200's capabilities in the dry runs
        env["MEGATRON_PERF_TOGGLES_ASSUME"] = "apex,te=2.20.2,cuda"
    return env


def part_port(ns: argparse.Namespace, part: str) -> int:
    """A fixed port per part: parts that run side by side do not collide, and a resumed part gets
    the same command it had (the ablate resume compares commands)."""
    return ns.port + list(PARTS).index(part)


def ablate_command(part: str, ns: argparse.Namespace, out: Path, budget_min: float | None) -> tuple[list[str], dict]:
    design, extra, gpus = PARTS[part]
    megatron = Path(ns.megatron).resolve()
    env = base_env(megatron, ns.smoke)
    port = part_port(ns, part)
    if ns.smoke:
        # one python process standing in for the part's world, which it logs as Megatron would;
        # --world-size (below) plans the dry runs for that world, as torchrun's would on the GPUs
        launch = f"env FAKE_WORLD_SIZE={gpus} {sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"
    elif gpus > 1:
        launch = f"{sys.executable} -m torch.distributed.run --nproc-per-node {gpus} --master-port {port}"
    else:
        launch = sys.executable
        # a plain `python` launch: torchrun would set these
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("WORLD_SIZE", "1"),
                           ("RANK", "0"), ("LOCAL_RANK", "0")):
            env.setdefault(key, value)
    cmd = [sys.executable, "-m", "megatron_perf_toggles", *design, "--out", str(out / part),
           "--launch", launch, "--repeats", str(ns.repeats), "--seed", str(ns.seed), "--iters", str(ns.iters),
           "--warmup", str(ns.warmup)]
    if ns.no_warmup_run:  # e.g. peak-memory runs, which need no timed steady state
        cmd += ["--no-warmup-run"]
    if budget_min is not None:
        cmd += ["--budget", f"{budget_min:.2f}"]
    if ns.smoke:
        cmd += ["--world-size", str(gpus)]
    if ns.toggles:
        cmd += ["--toggles", ns.toggles]
    cmd += [str(megatron / "pretrain_gpt.py"), "--", *model_args(ns.shape, ns.data), *extra]
    return cmd, env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="Megatron-LM checkout (pretrain_gpt.py)")
    ap.add_argument("--out", required=True, help="results directory; each part writes OUT/PART/results.*")
    ap.add_argument("--parts", default="headline,noop", help=f"comma list of: {', '.join(PARTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12, help="iterations per run (default 12)")
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of each run's median (default 5)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup-run", action="store_true",
                    help="no unmeasured warm-up run per part (peak-memory runs need no timed steady state)")
    ap.add_argument("--budget", type=float, metavar="MINUTES",
                    help="time for all parts together: no block starts that would end after it")
    ap.add_argument("--toggles", metavar="LIST",
                    help="comma list of toggle dests for the parts that vary toggles (default: all five), e.g. "
                         "tune on the toggles an earlier leave-one-out left unresolved; the toggles not named "
                         "keep the plugin defaults in every arm (the presets pass on none of the plugin's variables "
                         f"from the shell). Not for {', '.join(FIXED_TOGGLES)}")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b-4l")
    ap.add_argument("--data", metavar="PREFIX", help="a real-text indexed dataset instead of mock data")
    ap.add_argument("--port", type=int, default=29511, help="first port; each part uses its own (default 29511)")
    ap.add_argument("--devices", metavar="LIST",
                    help="comma list of GPU indices: one-GPU parts run side by side, one per GPU")
    ap.add_argument("--smoke", action="store_true", help="CPU: stand-in runs (tests/support/fake_megatron_run.py)")
    ap.add_argument("--print-only", action="store_true", help="print the plan and the commands, run nothing")
    ns = ap.parse_args(argv)
    parts = [p.strip() for p in ns.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        ap.error(f"--parts: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}")
    if ns.toggles:  # an empty list is the default: all five
        try:
            parse_toggles(ns.toggles)
        except PerfTogglesError as exc:
            ap.error(str(exc))
        for part in parts:
            if part in FIXED_TOGGLES:
                ap.error(f"--toggles: part {part} {FIXED_TOGGLES[part]}")
    if not (Path(ns.megatron) / "pretrain_gpt.py").is_file():
        ap.error(f"--megatron {ns.megatron}: no pretrain_gpt.py there")
    out = Path(ns.out)
    total = 0.0
    print(f"plan: {ns.repeats} blocks per part, {ns.iters} iterations per run ({ns.warmup} left out), "
          f"1 warm-up run per part; about {STARTUP_S:.0f}s start-up per run" + (" (smoke: stand-in runs)"
                                                                                if ns.smoke else ""))
    n_toggles = len(parse_toggles(ns.toggles)) if ns.toggles else None
    for part in parts:
        est = estimate_s(part, ns.repeats, ns.iters, n_toggles, ns.no_warmup_run)
        total += est
        runs = (0 if ns.no_warmup_run else 1) + ns.repeats * arms_of(part, n_toggles)
        print(f"  {part:<15} {runs:>3} runs  ~{est / 60:5.1f} min  -> {out / part}")
    devices = [d.strip() for d in ns.devices.split(",") if d.strip()] if ns.devices else []
    if devices:  # side by side: a phase takes about as long as its parts spread over the devices
        total = sum(max(max(estimate_s(p, ns.repeats, ns.iters, n_toggles, ns.no_warmup_run) for p in ph),
                        sum(estimate_s(p, ns.repeats, ns.iters, n_toggles, ns.no_warmup_run) for p in ph) / len(devices))
                    for ph in phases(parts, devices))
    print(f"expected: ~{total / 60:.1f} min on the H200" + (f" on GPUs {','.join(devices)}" if devices else "")
          + (f" (budget {ns.budget:g} min)" if ns.budget else ""), flush=True)
    if ns.devices is not None and not devices:
        ap.error("--devices: expected a comma list of GPU indices, e.g. 0,1")
    for part in parts:
        if devices and PARTS[part][2] > len(devices):
            ap.error(f"--devices {ns.devices}: part {part} needs {PARTS[part][2]} GPUs")
    start = time.monotonic()
    worst = 0
    for phase in phases(parts, devices):
        worst = max(worst, run_phase(phase, ns, out, start, devices))
    return worst


def phases(parts: list[str], devices: list[str]) -> list[list[str]]:
    """Groups that run together: with several devices, consecutive one-GPU parts share a phase; a
    multi-GPU part is a phase of its own. Without devices, every part is its own phase."""
    if len(devices) < 2:
        return [[p] for p in parts]
    groups: list[list[str]] = []
    for multi, run in itertools.groupby(parts, key=lambda p: PARTS[p][2] > 1):
        members = list(run)
        groups += [[p] for p in members] if multi else [members]
    return groups


def run_phase(phase: list[str], ns: argparse.Namespace, out: Path, start: float, devices: list[str]) -> int:
    """Start each part of the phase (at most one per device at a time), wait for all of them."""
    worst, pending, active = 0, list(phase), {}
    free = list(devices) if len(phase) > 1 else []
    while pending or active:
        while pending and (free or not active):
            part = pending.pop(0)
            left = None if ns.budget is None else ns.budget - (time.monotonic() - start) / 60
            if left is not None and left <= 0:
                print(f"[{part}] skipped: the budget is spent", flush=True)
                worst = max(worst, 1)
                continue
            cmd, env = ablate_command(part, ns, out, left)
            print(f"[{part}] {shlex.join(cmd)}", flush=True)
            if ns.print_only:
                continue
            if free:  # side by side: one GPU each, output to OUT/PART.log
                device = free.pop(0)
                out.mkdir(parents=True, exist_ok=True)
                log = open(out / f"{part}.log", "a")  # closed when the part ends
                proc = subprocess.Popen(cmd, env={**env, "CUDA_VISIBLE_DEVICES": device}, stdout=log,
                                        stderr=subprocess.STDOUT)
                print(f"[{part}] started on GPU {device}; log {out / f'{part}.log'}", flush=True)
                active[part] = (proc, device, log)
            else:
                if devices:
                    env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(devices[:PARTS[part][2]])}
                worst = max(worst, _finished(part, subprocess.call(cmd, env=env), start, out))
        for part, (proc, device, log) in list(active.items()):
            if proc.poll() is not None:
                log.close()
                worst = max(worst, _finished(part, proc.returncode, start, out))
                del active[part]
                free.append(device)
        if active:
            time.sleep(2)
    return worst


def _finished(part: str, code: int, start: float, out: Path) -> int:
    print(f"[{part}] exit {code} after {(time.monotonic() - start) / 60:.1f} min; results in {out / part}",
          flush=True)
    return code

if __name__ == "__main__":
    raise SystemExit(main())
