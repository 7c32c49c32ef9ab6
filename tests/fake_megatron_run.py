"""Stands in for `python -m megatron_perf_toggles.run pretrain_gpt.py ...` in ablate tests.

Writes Megatron-format log lines; the speed depends on GRAD_REDUCE_IN_BF16 so arms differ.
FAKE_CRASH_ARM=<env value> makes the arm whose GRAD_REDUCE_IN_BF16 equals it crash mid-run.
Invoked as: python fake_megatron_run.py -m megatron_perf_toggles.run SCRIPT [args...]
"""

import os
import sys

iters = 6
fast = os.environ.get("GRAD_REDUCE_IN_BF16") == "1"
ms = 900.0 if fast else 1000.0
counter = os.environ.get("FAKE_COUNTER")
if counter:
    with open(counter, "a") as fh:
        fh.write(os.environ.get("GRAD_REDUCE_IN_BF16", "?") + "\n")
for i in range(1, iters + 1):
    loss = 10.0 - 0.5 * i
    print(f" [2026-11-30 01:00:00.000000] iteration {i:8d}/{iters:8d} | consumed samples: {16 * i:12d} | "
          f"elapsed time per iteration (ms): {ms + (5 if i % 2 else -5):.1f} | throughput per GPU (TFLOP/s/GPU): "
          f"{500000.0 / ms:.1f} | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: {loss:.6E} | "
          f"loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
          flush=True)
    if i == 3 and os.environ.get("FAKE_CRASH_ARM") == os.environ.get("GRAD_REDUCE_IN_BF16"):
        print("Traceback (most recent call last):\nRuntimeError: CUDA error: an illegal memory access", flush=True)
        sys.exit(1)
print("[Rank 0] (after 6 iterations) memory (MB) | allocated: 100.00 | max allocated: 200.50 | "
      "reserved: 300.00 | max reserved: 400.00", flush=True)
