"""Stands in for `python -m megatron_perf_toggles.run pretrain_gpt.py ...` in ablate tests and smoke runs.

Writes Megatron-format log lines; the speed depends on GRAD_REDUCE_IN_BF16 (900 ms on, 1000 ms off)
so arms differ, and on nothing else.
``--train-iters N`` sets the iterations (default 6).
FAKE_CRASH_ARM=<env value> makes the arm whose GRAD_REDUCE_IN_BF16 equals it crash mid-run.
FAKE_DRIFT=x multiplies every run's speed by a factor drawn uniformly from [1-x, 1+x], seeded by the
run's own command line: run-to-run drift, as on a shared GPU.
FAKE_SLEEP=s sleeps s seconds per iteration.
FAKE_WORLD_SIZE=n prints Megatron's "using world size: n" start-up line.
FAKE_EXTRA_MS=VAR=ms[,VAR=ms] adds ms to each iteration of a run whose VAR is 1 (a toggle that costs time).
FAKE_EXTRA_MB=VAR=mb[,VAR=mb] adds mb to the max allocated memory of a run whose VAR is 1 (a toggle that costs memory).
FAKE_SEED_LOSS=x adds x * (the --seed argument mod 10) to every loss (seed-to-seed spread).
FAKE_LOSS_SHIFT=NAME=x[,NAME=x] adds x to every loss of a run whose variable NAME is 1, or, for a
NAME that starts with --, whose arguments hold that flag (a toggle or a flag that moves the loss).
Planted loss effects (the loss test's fake runs): the loss is scaled as a model's would be, by
  (1 + seed part) x (1 + arm's effect) x (1 + run noise)
FAKE_LOSS_SEED_SD=x: the seed part, drawn from N(0, x) by the --seed value alone, so every arm of a
  seed shares it (initial weights and data order); seeds differ a lot, same-seed arms little.
FAKE_LOSS_REDRAW=VAR: a run whose VAR is 1 draws its seed part from another stream (a toggle that
  draws the initial weights another way: same-seed runs no longer share a start).
FAKE_LOSS_NOISE=x: the run noise, drawn from N(0, x) by the seed and the arm's toggle variables
  (not the run's paths: a test reruns the same draws).
FAKE_LOSS_SCALE=VAR=f[,VAR=f]: the arm's effect, f - 1 where VAR is 1 (1.03: a 3 % harm).
FAKE_VALIDATION=k: also print Megatron's validation loss line every k iterations, and after the last
  one the "on validation set" and "on test set" lines (the validation loss is the training loss
  plus 0.25, the test set's plus 5, so a test can tell which was read).
--exit-interval N: stops after iteration N, as Megatron does (saving where --save is given).
--save DIR: after the last iteration, writes DIR/latest_checkpointed_iteration.txt (a checkpoint).
--load DIR: starts from that checkpoint, which must exist (else it fails as Megatron would); the
  seed part then comes from the checkpoint's seed, never redrawn (every run that loads it starts
  from the same weights).
FAKE_TRACE=path: appends "start PORT DIR" as the run starts and "end PORT DIR" as it ends (DIR: the
  parent of its --tensorboard-dir, the run's own directory; PORT: its MASTER_PORT), so a test can
  tell which runs overlapped and in which waves.
FAKE_CRASH_FLAG=--flag[=value]: a run whose arguments hold that flag (with that value) fails at start.
Invoked as: python fake_megatron_run.py -m megatron_perf_toggles.run SCRIPT [args...]
"""

import atexit
import os
import random
import sys
import time

argv = sys.argv[1:]
iters = int(argv[argv.index("--train-iters") + 1]) if "--train-iters" in argv else 6
stop = int(argv[argv.index("--exit-interval") + 1]) if "--exit-interval" in argv else iters
trace = os.environ.get("FAKE_TRACE")
here = os.path.dirname(argv[argv.index("--tensorboard-dir") + 1]) if "--tensorboard-dir" in argv else "?"


def traced(event: str) -> None:
    if trace:
        with open(trace, "a") as fh:
            fh.write(f"{event} {os.environ.get('MASTER_PORT', '?')} {here}\n")


traced("start")
atexit.register(traced, "end")
flag, _, value = os.environ.get("FAKE_CRASH_FLAG", "").partition("=")
if flag and flag in argv and (not value or argv[argv.index(flag) + 1] == value):
    print(f"Traceback (most recent call last):\nRuntimeError: planted failure ({flag} {value})", flush=True)
    sys.exit(1)
fast = os.environ.get("GRAD_REDUCE_IN_BF16") == "1"
ms = 900.0 if fast else 1000.0
for item in filter(None, os.environ.get("FAKE_EXTRA_MS", "").split(",")):
    var, _, extra = item.partition("=")
    ms += float(extra) if os.environ.get(var) == "1" else 0.0
drift = float(os.environ.get("FAKE_DRIFT", "0") or 0)
if drift:
    ms *= random.Random(" ".join(argv)).uniform(1 - drift, 1 + drift)
counter = os.environ.get("FAKE_COUNTER")
if counter:
    with open(counter, "a") as fh:
        fh.write(os.environ.get("GRAD_REDUCE_IN_BF16", "?") + "\n")
if os.environ.get("FAKE_WORLD_SIZE"):
    world = int(os.environ["FAKE_WORLD_SIZE"])
    tp = int(argv[argv.index("--tensor-model-parallel-size") + 1]) if "--tensor-model-parallel-size" in argv else 1
    print(f"using world size: {world}, data-parallel size: {world // tp}, context-parallel size: 1, "
          f"tensor-model-parallel size: {tp}, pipeline-model-parallel size: 1", flush=True)
shift = float(os.environ.get("FAKE_SEED_LOSS", "0") or 0) * (
    int(argv[argv.index("--seed") + 1]) % 10 if "--seed" in argv else 0)
for item in filter(None, os.environ.get("FAKE_LOSS_SHIFT", "").split(",")):
    name, _, by = item.partition("=")
    shift += float(by) if (name in argv if name.startswith("--") else os.environ.get(name) == "1") else 0.0
ARM_VARS = ("GRAD_REDUCE_IN_BF16", "GRADIENT_ACCUMULATION_FUSION", "DDP_AVERAGE_IN_COLLECTIVE",
            "CROSS_ENTROPY_LOSS_FUSION", "FUSED_SINGLE_QKV_ROPE", "MOE_GROUPED_GEMM", "MOE_PERMUTE_FUSION",
            "MOE_ROUTER_FUSION")
seed = argv[argv.index("--seed") + 1] if "--seed" in argv else "none"
redraw = os.environ.get("FAKE_LOSS_REDRAW")
stream = f"{seed}/redrawn" if redraw and os.environ.get(redraw) == "1" else seed
if "--load" in argv:
    loaded = os.path.join(argv[argv.index("--load") + 1], "latest_checkpointed_iteration.txt")
    if not os.path.isfile(loaded):
        print(f"RuntimeError: no checkpoint to load at {loaded}", flush=True)
        sys.exit(1)
    with open(loaded) as fh:
        stream = fh.read().split()[1]  # the seed the checkpoint was made with
scale = 1.0 + random.Random(f"seed/{stream}").gauss(0.0, float(os.environ.get("FAKE_LOSS_SEED_SD", "0") or 0))
arm_key = ",".join(f"{v}={os.environ.get(v, '')}" for v in ARM_VARS)
scale *= 1.0 + random.Random(f"run/{seed}/{arm_key}").gauss(0.0, float(os.environ.get("FAKE_LOSS_NOISE", "0") or 0))
for item in filter(None, os.environ.get("FAKE_LOSS_SCALE", "").split(",")):
    var, _, factor = item.partition("=")
    scale *= float(factor) if os.environ.get(var) == "1" else 1.0
every = int(os.environ.get("FAKE_VALIDATION", "0") or 0)


def validation(i: int, where: str = "", add: float = 0.25) -> None:
    value = (10.0 - 0.5 * i + shift) * scale + add
    print("-" * 60 + f"\n validation loss at iteration {i}{where} | lm loss value: {value:.6E} | "
          f"lm loss PPL: {min(value, 20.0):.6E} | \n" + "-" * 60, flush=True)


for i in range(1, iters + 1):
    loss = (10.0 - 0.5 * i + shift) * scale
    time.sleep(float(os.environ.get("FAKE_SLEEP", "0") or 0))
    print(f" [2026-11-30 01:00:00.000000] iteration {i:8d}/{iters:8d} | consumed samples: {16 * i:12d} | "
          f"elapsed time per iteration (ms): {ms + (5 if i % 2 else -5):.1f} | throughput per GPU (TFLOP/s/GPU): "
          f"{500000.0 / ms:.1f} | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: {loss:.6E} | "
          f"loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
          flush=True)
    crash = os.environ.get("FAKE_CRASH_ARM")
    if i == 3 and crash is not None and crash == os.environ.get("GRAD_REDUCE_IN_BF16", ""):
        print("Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access", flush=True)
        sys.exit(1)
    if every and i % every == 0:
        validation(i)
    if i % stop == 0:
        break
if every and i == iters:  # a run stopped by --exit-interval evaluates nothing at the end
    validation(iters, " on validation set")
    validation(iters, " on test set", add=5.0)
if "--save" in argv:
    saved = argv[argv.index("--save") + 1]
    os.makedirs(saved, exist_ok=True)
    with open(os.path.join(saved, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(f"{iters} {stream}\n")
peak = 200.5
for item in filter(None, os.environ.get("FAKE_EXTRA_MB", "").split(",")):
    var, _, extra = item.partition("=")
    peak += float(extra) if os.environ.get(var) == "1" else 0.0
print(f"[Rank 0] (after 6 iterations) memory (MB) | allocated: 100.00 | max allocated: {peak:.2f} | "
      "reserved: 300.00 | max reserved: 400.00", flush=True)
