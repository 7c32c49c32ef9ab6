"""From the interleaved timings to claims: each toggle's speedup on its unit with a 95 % interval,
the time it saves per unit, and the share of a training step that is.

The statistics are ``ablate``'s (``tools.ablate.stats``): each block ran both arms once, in a seeded
random order, so the pair shares that moment's clocks; the unit of evidence is the per-block log
ratio. The time saved is the mean per-block difference with its own paired t-interval. The step
share multiplies it by how often the unit runs in a step and divides by the step's time, which
comes from the user (``--step-ms``) or from an ``ablate`` result, and says which. A toggle that acts
in several units (gradient accumulation fusion: every layer's weight gradients and the output
layer's) saves the sum of their shares (``summed_share``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..ablate.stats import FASTER, NO_DIFFERENCE, SLOWER, TOO_FEW, paired_speedup, t_quantile

CONFIDENCE = 0.95


def paired_difference(stock_ms: Sequence[float], toggle_ms: Sequence[float],
                      confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Time the toggle saves per call (stock - toggle, ms; above 0: it saves), with a paired t-interval."""
    d = [s - t for s, t in zip(stock_ms, toggle_ms, strict=True)]
    if len(d) < 2:
        return {"estimate": statistics.fmean(d) if d else None, "low": None, "high": None, "blocks": len(d)}
    mean = statistics.fmean(d)
    half = t_quantile(1 - (1 - confidence) / 2, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return {"estimate": mean, "low": mean - half, "high": mean + half, "blocks": len(d)}


def step_share(saved: Mapping[str, Any], per_step: int, step_ms: float | None) -> dict[str, Any] | None:
    """The fraction of a step the toggle saves: saved ms per call x calls per step / step ms."""
    if not step_ms or saved.get("estimate") is None:
        return None
    share = {k: (saved[k] * per_step / step_ms if saved.get(k) is not None else None)
             for k in ("estimate", "low", "high")}
    return {**share, "calls_per_step": per_step, "step_ms": step_ms}


def summed_share(shares: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """A toggle's step share over the units it acts in (``step_share`` of each): the estimates add.

    The units are measured one after another, each over its own blocks, so their errors are
    independent; each unit's 95 % interval is symmetric (a paired t-interval, scaled), and the sum's
    half-width is the units' half-widths combined in quadrature, sqrt(h1^2 + h2^2 + ...), which is
    exact for normal errors and a close approximation for t-intervals over tens of blocks. Without a
    share for every unit (no step time, a failed unit) there is no sum; without an interval for
    every unit (too few blocks), the sum has no interval."""
    if not shares or any(s is None or s.get("estimate") is None for s in shares):
        return None
    known = [s for s in shares if s is not None]
    estimate = math.fsum(s["estimate"] for s in known)
    out: dict[str, Any] = {"estimate": estimate, "low": None, "high": None, "units": len(known),
                           "step_ms": known[0]["step_ms"], "combined": "estimates summed, half-widths in quadrature"}
    if all(s.get("low") is not None and s.get("high") is not None for s in known):
        half = math.sqrt(math.fsum(((s["high"] - s["low"]) / 2) ** 2 for s in known))
        out.update(low=estimate - half, high=estimate + half)
    return out


def summarise(timings: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """One arm pair's timings (``stock_gpu``, ``toggle_gpu``, ``stock_wall``, ``toggle_wall``, in ms per
    block) as speedups and time saved, GPU and wall (the wall time includes the launches)."""
    out: dict[str, Any] = {}
    for clock in ("gpu", "wall"):
        stock, toggle = list(timings[f"stock_{clock}"]), list(timings[f"toggle_{clock}"])
        speed = paired_speedup(stock, toggle, confidence=CONFIDENCE)
        speed.pop("per_block", None)
        out[clock] = {"speedup": speed, "saved_ms": paired_difference(stock, toggle),
                      "stock_ms": statistics.median(stock) if stock else None,
                      "toggle_ms": statistics.median(toggle) if toggle else None}
    return out


def resolved_within(result: Mapping[str, Any], target: float = 0.01) -> bool:
    """Whether the GPU speedup's interval is within +-``target`` of its estimate (the check's aim: 1 %)."""
    speed = result["gpu"]["speedup"]
    if speed.get("low") is None:
        return False
    return bool(speed["high"] / speed["estimate"] - 1 <= target and 1 - speed["low"] / speed["estimate"] <= target)


def verdict_word(speed: Mapping[str, Any]) -> str:
    """faster / slower / no detectable difference / too few blocks, as ablate says it."""
    return {FASTER: "faster", SLOWER: "slower", NO_DIFFERENCE: "no detectable difference"}.get(
        speed.get("verdict", TOO_FEW), TOO_FEW)
