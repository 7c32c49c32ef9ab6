"""Loss equivalence: two one-sided tests (TOST) on seeds, with a stated margin and a three-way verdict.

Whether a toggle "does not change training" is a claim of equivalence, and the absence of a
significant difference does not show it (few seeds find nothing). The test that can show it puts
an interval around the change in loss and asks whether the whole interval lies inside a margin
stated in advance (default +-1 % of the baseline's loss):

    d_s = 100 * (arm_s - baseline_s) / mean(baseline)      one number per seed s, in %
    interval = mean(d) +- t(1 - alpha, n - 1) * sd(d) / sqrt(n)

a (1 - 2 alpha) two-sided interval, which is the two one-sided tests at level alpha each. Seeds
pair the runs: every arm of a seed shares its initial weights and data order, so the difference
within a seed is far less noisy than the spread between seeds. Where an arm draws its initial
weights differently (a toggle with ``redraws_init`` in the registry), a seed no longer pairs its
runs, and Welch's unpaired interval over the seeds is used instead.

Verdicts: *equivalent* (the interval inside (-m, +m)), *different* (the interval excludes 0 and
reaches past the margin: worse where the loss went up), else *inconclusive*, with the smallest
margin these data could have shown (the interval's farthest end from 0). The seeds a margin needs
at the spread measured size the next run from a pilot.

Standard library only; the t quantiles are stats.py's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ..stats import t_quantile

WORSE = "different: worse"
BETTER = "different: better"
INCONCLUSIVE = "inconclusive"
POWER = 0.8  # the chance of showing equivalence at the seeds advised, where the true change is 0
SEED_LIMIT = 100_000


def equivalent(margin: float) -> str:
    """The equivalence verdict, naming its margin (in % of the baseline's loss)."""
    return f"equivalent within +-{margin:g} %"


def verdict(low: float | None, high: float | None, margin: float) -> str:
    """The three-way verdict of an interval (in %) against the margin ``margin`` (in %)."""
    if low is None or high is None:
        return INCONCLUSIVE
    if -margin < low and high < margin:
        return equivalent(margin)
    if low > 0 and high > margin:
        return WORSE
    if high < 0 and low < -margin:
        return BETTER
    return INCONCLUSIVE


def _finish(out: dict[str, Any], estimate: float, half: float | None, margin: float) -> dict[str, Any]:
    """Interval, verdict and smallest margin shown, from an estimate and a half-width (None: no interval)."""
    low = None if half is None else estimate - half
    high = None if half is None else estimate + half
    smallest = None if low is None or high is None else max(abs(low), abs(high))
    return {**out, "estimate": estimate, "low": low, "high": high, "verdict": verdict(low, high, margin),
            "smallest_margin_shown": smallest}


def paired(arm: Sequence[float | None], baseline: Sequence[float | None], margin: float, alpha: float = 0.05
           ) -> dict[str, Any]:
    """The paired test: ``arm[s]`` and ``baseline[s]`` are one seed's loss measures (None: no run).

    Seeds where either is missing drop out. Differences are in % of the baseline's mean over the
    seeds compared. With fewer than 2 seeds there is no interval: inconclusive."""
    pairs = [(a, b) for a, b in zip(arm, baseline, strict=True) if a is not None and b is not None]
    out: dict[str, Any] = {"paired": True, "margin": margin, "alpha": alpha, "seeds_compared": len(pairs)}
    if not pairs:
        return {**out, "differences": [], "estimate": None, "low": None, "high": None, "verdict": INCONCLUSIVE,
                "smallest_margin_shown": None, "sd": None, "seeds_needed": None}
    scale = statistics.fmean(b for _, b in pairs)
    diffs = [100.0 * (a - b) / scale for a, b in pairs]
    out.update(baseline_mean=scale, differences=diffs)
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return {**_finish(out, mean, None, margin), "sd": None, "seeds_needed": None}
    sd = statistics.stdev(diffs)
    half = t_quantile(1.0 - alpha, n - 1) * sd / math.sqrt(n)
    return {**_finish(out, mean, half, margin), "sd": sd, "seeds_needed": seeds_needed(sd, margin, alpha)}


def welch(arm: Sequence[float | None], baseline: Sequence[float | None], margin: float, alpha: float = 0.05
          ) -> dict[str, Any]:
    """The unpaired test (Welch): the arm's and the baseline's loss measures over their own seeds,
    where a seed does not give both arms the same start. In % of the baseline's mean."""
    a = [v for v in arm if v is not None]
    b = [v for v in baseline if v is not None]
    out: dict[str, Any] = {"paired": False, "margin": margin, "alpha": alpha, "seeds_compared": min(len(a), len(b)),
                           "differences": None}
    if not a or not b:
        return {**out, "estimate": None, "low": None, "high": None, "verdict": INCONCLUSIVE,
                "smallest_margin_shown": None, "sd": None, "seeds_needed": None}
    scale = statistics.fmean(b)
    pa, pb = [100.0 * v / scale for v in a], [100.0 * v / scale for v in b]
    out["baseline_mean"] = scale
    estimate = statistics.fmean(pa) - statistics.fmean(pb)
    if len(a) < 2 or len(b) < 2:
        return {**_finish(out, estimate, None, margin), "sd": None, "seeds_needed": None}
    va, vb = statistics.variance(pa) / len(pa), statistics.variance(pb) / len(pb)
    se = math.sqrt(va + vb)
    df = welch_df(va, vb, len(pa), len(pb))
    half = t_quantile(1.0 - alpha, df) * se
    # the per-run spread (pooled over both arms): what the seeds per arm are sized from
    sd = math.sqrt((statistics.variance(pa) + statistics.variance(pb)) / 2.0)
    return {**_finish(out, estimate, half, margin), "sd": sd, "df": df,
            "seeds_needed": seeds_needed(sd * math.sqrt(2.0), margin, alpha)}


def welch_df(va: float, vb: float, na: int, nb: int) -> float:
    """Welch-Satterthwaite degrees of freedom from the two squared standard errors (the smaller
    sample's n - 1 where both are 0: any df gives a zero-width interval then)."""
    if va + vb == 0:
        return float(min(na, nb) - 1)
    return (va + vb) ** 2 / (va * va / (na - 1) + vb * vb / (nb - 1))


def seeds_needed(sd: float, margin: float, alpha: float = 0.05, power: float = POWER, limit: int = SEED_LIMIT) -> int:
    """Seeds a TOST needs to show equivalence within +-``margin`` with ``power``, where the true
    change is 0 and the per-seed differences spread by ``sd`` (both in %): the smallest n >= 2 with

        (t(1 - alpha, n - 1) + t(1 - (1 - power) / 2, n - 1)) * sd / sqrt(n) <= margin

    (at a true change of 0 both one-sided tests must reject, so the power splits between them).
    For the unpaired test pass the sd of a difference of two runs (sqrt(2) x the per-run sd): the
    answer is then seeds per arm. ``limit`` where even that many would not do."""
    if margin <= 0:
        raise ValueError("margin must be positive")
    if sd <= 0:
        return 2
    beta_q = 1.0 - (1.0 - power) / 2.0
    return _fewest(lambda n: t_quantile(1.0 - alpha, n - 1) + t_quantile(beta_q, n - 1), sd, margin,
                   _z(1.0 - alpha) + _z(beta_q), limit)


def seeds_to_fit(estimate: float, sd: float, margin: float, alpha: float = 0.05, limit: int = SEED_LIMIT
                 ) -> int | None:
    """Seeds at which the interval would lie inside +-``margin`` if the mean difference stayed at
    ``estimate`` and the per-seed differences kept spreading by ``sd`` (all in %): the smallest
    n >= 2 with

        t(1 - alpha, n - 1) * sd / sqrt(n) <= margin - |estimate|

    None where ``|estimate| >= margin``: no number of seeds brings that interval inside. Where
    :func:`seeds_needed` sizes a new experiment (a true change of 0, with power), this answers an
    experiment continued over sessions: how far its interval is, at what it measured so far, from
    an equivalence claim (about even odds of making it there: the mean moves as seeds come)."""
    room = margin - abs(estimate)
    if room <= 0:
        return None
    if sd <= 0:
        return 2
    return _fewest(lambda n: t_quantile(1.0 - alpha, n - 1), sd, room, _z(1.0 - alpha), limit)


def _z(p: float) -> float:
    return statistics.NormalDist().inv_cdf(p)


def _fewest(quantile: Callable[[int], float], sd: float, half: float, z: float, limit: int) -> int:
    """The smallest n >= 2 with ``quantile(n) * sd / sqrt(n) <= half`` (``limit`` where none below
    it does). ``z``: the normal approximation of ``quantile``, whose answer is a lower bound to start
    from (t only adds seeds)."""
    n = max(2, int((z * sd / half) ** 2))
    while n < limit:
        if quantile(n) * sd / math.sqrt(n) <= half:
            return n
        n += 1
    return limit
