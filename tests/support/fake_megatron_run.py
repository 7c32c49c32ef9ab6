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
Invoked as: python fake_megatron_run.py -m megatron_perf_toggles.run SCRIPT [args...]
"""

import os
import random
import sys
import time

argv = sys.argv[1:]
iters = int(argv[argv.index("--train-iters") + 1]) if "--train-iters" in argv else 6
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
for i in range(1, iters + 1):
    loss = 10.0 - 0.5 * i + shift
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
peak = 200.5
for item in filter(None, os.environ.get("FAKE_EXTRA_MB", "").split(",")):
    var, _, extra = item.partition("=")
    peak += float(extra) if os.environ.get(var) == "1" else 0.0
print(f"[Rank 0] (after 6 iterations) memory (MB) | allocated: 100.00 | max allocated: {peak:.2f} | "
      "reserved: 300.00 | max reserved: 400.00", flush=True)
