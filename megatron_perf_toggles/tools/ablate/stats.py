"""Statistics for ``ablate``: paired speed intervals over blocks, verdicts, and sizing (with what
pairs runs by block, and a run's medians and losses, that the intervals are computed from).

Each block runs every arm once, so an arm and the baseline of the same block share the drift of
that moment (GPU clocks, a neighbour's job, the page cache). The unit of evidence is therefore the
per-block ratio ``baseline_ms / arm_ms``, analysed on the log scale (ratios multiply, logs add):

    d_b = ln(baseline_ms_b) - ln(arm_ms_b)          one number per block
    speedup = exp(mean d),  interval = exp(mean d +- t(1 - alpha/2, n - 1) * sd(d) / sqrt(n))

Why a paired t-interval and not a bootstrap: with the 3 to 5 blocks an ablation can afford, a
bootstrap over blocks has only 10 (n=3) to 126 (n=5) distinct resamples, and its percentile
interval is known to cover the true value far less often than it claims at such sizes. The
t-interval is exact when the per-block log ratios are normal, which the medians of many
iterations are close to, and its width grows honestly as blocks get few (t = 4.30 at n=3).

Standard library only: the t quantiles come from the regularized incomplete beta function below.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

FASTER = "faster"
SLOWER = "slower"
NO_DIFFERENCE = "no detectable difference"
TOO_FEW = "too few blocks"


# --- Student's t ------------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=1024)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on t_cdf; accurate to ~1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


# --- paired speedup ----------------------------------------------------------------------------


def log_ratios(baseline_ms: Sequence[float | None], arm_ms: Sequence[float | None]) -> list[float]:
    """ln(baseline / arm) for every block where both ran (a failed run drops its block's pair)."""
    return [math.log(b / a) for b, a in zip(baseline_ms, arm_ms, strict=True) if b and a and b > 0 and a > 0]


def paired_speedup(baseline_ms: Sequence[float | None], arm_ms: Sequence[float | None],
                   confidence: float = 0.95) -> dict[str, Any]:
    """Speedup of the arm over the baseline (>1: the arm is faster) with a paired t-interval.

    ``baseline_ms[b]`` and ``arm_ms[b]`` are the two runs' median ms/iter in block ``b``.
    """
    d = log_ratios(baseline_ms, arm_ms)
    n = len(d)
    out: dict[str, Any] = {"blocks": n, "confidence": confidence, "method": "paired t on log ratios over blocks",
                           "per_block": [math.exp(x) for x in d]}
    if n == 0:
        return {**out, "estimate": None, "low": None, "high": None, "verdict": TOO_FEW}
    mean = statistics.fmean(d)
    out["estimate"] = math.exp(mean)
    if n < 2:
        return {**out, "low": None, "high": None, "sd_log": None, "verdict": TOO_FEW}
    sd = statistics.stdev(d)
    half = t_quantile(1.0 - (1.0 - confidence) / 2.0, n - 1) * sd / math.sqrt(n)
    low, high = math.exp(mean - half), math.exp(mean + half)
    verdict = FASTER if low > 1.0 else SLOWER if high < 1.0 else NO_DIFFERENCE
    return {**out, "low": low, "high": high, "sd_log": sd, "half_width_log": half, "verdict": verdict}


def blocks_to_resolve(sd_log: float, effect: float = 0.01, confidence: float = 0.95, power: float = 0.8,
                      limit: int = 10_000) -> int:
    """Blocks a paired t-test needs to call an ``effect`` (0.01 = 1 %) at ``confidence`` with ``power``.

    The smallest n >= 2 with (t(1 - alpha/2, n-1) + t(power, n-1)) * sd / sqrt(n) <= ln(1 + effect).
    Returns ``limit`` when even that many would not do.
    """
    if effect <= 0:
        raise ValueError("effect must be positive")
    target = math.log1p(effect)
    if sd_log <= 0:
        return 2
    for n in range(2, limit):
        df = n - 1
        if (t_quantile(1 - (1 - confidence) / 2, df) + t_quantile(power, df)) * sd_log / math.sqrt(n) <= target:
            return n
    return limit


def blocks_for_half_width(sd_log: float, half_width: float, confidence: float = 0.95, limit: int = 10_000) -> int:
    """Blocks after which the interval is expected to be within +-``half_width`` (0.01 = 1 %)."""
    target = math.log1p(half_width)
    if sd_log <= 0:
        return 2
    for n in range(2, limit):
        if t_quantile(1 - (1 - confidence) / 2, n - 1) * sd_log / math.sqrt(n) <= target:
            return n
    return limit


def relative_half_width(result: dict[str, Any]) -> float | None:
    """Half the interval's width relative to 1 (0.01: the interval spans about +-1 %)."""
    if result.get("low") is None or result.get("high") is None:
        return None
    return (result["high"] / result["low"]) ** 0.5 - 1.0


# --- pairing runs by block -------------------------------------------------------------------------


def by_block(runs: Sequence[Mapping[str, Any]], arm: str, blocks: int) -> list[Mapping[str, Any] | None]:
    """The arm's finished run in each block (None where it failed or did not run): what comparisons pair."""
    by = {(r["arm"], r["block"]): r for r in runs if r.get("block", -1) >= 0 and r.get("status") == "done"}
    return [by.get((arm, b)) for b in range(blocks)]


def median_of(run: Mapping[str, Any] | None, key: str) -> float | None:
    """A run's steady-state median of ``key`` (``ms_per_iter``, ``tflops_per_gpu``), None where it logged none."""
    return ((run or {}).get("summary", {}).get(key) or {}).get("median")


def step_ms(run: Mapping[str, Any] | None) -> float | None:
    """A run's median step time in ms (its steady-state median), None where it logged none."""
    return median_of(run, "ms_per_iter")


def widest_interval(runs: Sequence[Mapping[str, Any]], base: str, arms: Sequence[str], blocks: int,
                    confidence: float) -> float:
    """The widest relative half-width of the ``arms``' paired speedup intervals against ``base``
    over ``blocks`` (infinite where one has no interval yet): what ``--target-ci`` stops on."""
    base_ms = [step_ms(r) for r in by_block(runs, base, blocks)]
    widths = [relative_half_width(paired_speedup(base_ms, [step_ms(r) for r in by_block(runs, arm, blocks)],
                                                 confidence)) for arm in arms]
    return max((w if w is not None else math.inf for w in widths), default=math.inf)


# --- spread and loss ---------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, Any] | None:
    """Median and range of per-run values (each already a run's own median)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": len(vals)}


def loss_iterations(runs: Sequence[Mapping[str, Any] | None]) -> set[int]:
    """Iterations that logged a loss in any of these runs (None: a block without a finished run)."""
    return {it["iteration"] for r in runs if r for it in r.get("iterations", []) if "lm_loss" in it}


def losses_at(runs: Sequence[Mapping[str, Any] | None], iteration: int) -> list[float | None]:
    """Each block's loss at ``iteration`` (None where the block has no finished run or no such loss)."""
    return [next((it["lm_loss"] for it in r.get("iterations", []) if it["iteration"] == iteration and "lm_loss" in it),
                 None) if r else None for r in runs]


def loss_comparison(baseline_loss: Sequence[float | None], arm_loss: Sequence[float | None]) -> dict[str, Any] | None:
    """Per-block loss ratios (arm / baseline) at one iteration: their median and range. A
    description only: whether a change in loss matters is the loss test's (equivalence.py)."""
    ratios = [a / b for b, a in zip(baseline_loss, arm_loss, strict=True) if a is not None and b]
    if not ratios:
        return None
    return {"ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "blocks": len(ratios)}


# --- sizing ------------------------------------------------------------------------------------


def sizing(rows: Sequence[Mapping[str, Any]], effect: float, confidence: float) -> dict[str, Any] | None:
    """Blocks needed to resolve ``effect`` on the noise measured: pooled over the arms' per-block
    log-ratio spreads (each arm's own is in its row)."""
    sds = [r["speedup"]["sd_log"] for r in rows if r.get("speedup", {}).get("sd_log") is not None]
    if not sds:
        return None
    pooled = math.sqrt(statistics.fmean(s * s for s in sds))
    return {"effect": effect, "confidence": confidence, "power": 0.8, "pooled_sd_log": pooled,
            "blocks_to_resolve": blocks_to_resolve(pooled, effect, confidence),
            "blocks_for_half_width": blocks_for_half_width(pooled, effect, confidence)}
