"""Timing two arms of one unit on the GPU: warm-up, then blocks, each running both arms once in a
seeded random order, twice over per arm: once for the GPU's time, once for the wall time.

GPU time: CUDA events around the step, with a large GEMM queued just before it so that the CPU has
queued the whole step before the GPU reaches it (the events then see the GPU's work, not the
launches; Megatron's own MoE performance test does the same). Wall time: synchronise, run the step,
synchronise again (the launches included: fused kernels also save launches, which matters where the
CPU is the bottleneck). Peak memory: the largest allocation during the step, each arm.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping
from typing import Any

from .gpu_build import Step

DUMMY = 4096  # side of the bf16 GEMM that keeps the GPU busy while the step is queued


def _dummy(n: int) -> None:
    import torch

    a = torch.empty(DUMMY, DUMMY, device="cuda", dtype=torch.bfloat16)
    for _ in range(n):
        torch.matmul(a, a)


def _gpu_ms(step: Step, cover: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _dummy(cover)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))


def _wall_ms(step: Step) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000.0


def _peak_mb(step: Step) -> float:
    """The step's own peak: the most it allocated above what was resident before it (the modules of
    both arms stay resident, so the absolute peak would count the other arm's weights too)."""
    import torch

    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - resident) / 2**20


def _cover(steps: Mapping[str, Step]) -> int:
    """How many dummy GEMMs outlast queueing the slower arm's step (at least one)."""
    one = _wall_ms(lambda: _dummy(1))
    queue = max(_wall_ms(s) for s in steps.values())
    return max(1, math.ceil(1.5 * queue / max(one, 1e-3)))


def time_pair(stock: Step, toggle: Step, blocks: int, warmup: int, seed: int) -> dict[str, Any]:
    """Per-block times of both arms, GPU and wall, with each arm's peak memory and the order run."""
    steps = {"stock": stock, "toggle": toggle}
    for _ in range(warmup):
        for step in steps.values():
            step()
    cover = _cover(steps)
    rng = random.Random(seed)
    out: dict[str, Any] = {f"{arm}_{clock}": [] for arm in steps for clock in ("gpu", "wall")}
    order = []
    for _ in range(blocks):
        arms = list(steps)
        rng.shuffle(arms)
        order.append("".join(a[0] for a in arms))
        for arm in arms:
            out[f"{arm}_gpu"].append(_gpu_ms(steps[arm], cover))
            out[f"{arm}_wall"].append(_wall_ms(steps[arm]))
    out["peak_mb"] = {arm: _peak_mb(step) for arm, step in steps.items()}
    out.update(order=order, dummy_gemms=cover, warmup=warmup, blocks=blocks, seed=seed)
    return out
