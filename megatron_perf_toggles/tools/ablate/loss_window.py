"""Loss over a window of the last iterations, compared seed by seed against the seed-to-seed band.

A toggle that changes numerics (a fused kernel, another reduction order) changes the loss curve a
little; so does a different seed. Whether the change matters is judged against the second: each
run's mean loss over its last N iterations (a mean, because one iteration's loss is noisy), per
arm each seed's difference from the baseline's run of the same seed, and the band the baseline's
own means span across seeds (max - min). An arm is "within the seed-to-seed band" only where every
seed's difference is; a band needs the baseline at two seeds or more, and without one there is no
verdict, only the numbers. With ``--block-seeds`` each block is one seed; without it the blocks
repeat one seed and the band is run-to-run nondeterminism alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .design import Arm, baseline_of

WITHIN = "within the seed-to-seed band"
OUTSIDE = "outside the band"
TOO_FEW = "no verdict: the band needs the baseline at 2 or more seeds"


def windowed_mean(run: Mapping[str, Any] | None, window: int) -> float | None:
    """The mean logged loss over the run's last ``window`` iterations (None: no run, or no loss)."""
    if not run:
        return None
    points = [(it["iteration"], it["lm_loss"]) for it in run.get("iterations", []) if "lm_loss" in it]
    if not points:
        return None
    last = max(i for i, _ in points)
    values = [v for i, v in points if i > last - window]
    return statistics.fmean(values)


def band_of(losses: Sequence[float | None]) -> float | None:
    """The seed-to-seed band: how far apart the baseline's windowed losses are (None: under 2 seeds)."""
    vals = [v for v in losses if v is not None]
    return max(vals) - min(vals) if len(vals) >= 2 else None


def verdict(differences: Sequence[float | None], band: float | None) -> str:
    """Within the band only where there is one and every seed the arm and the baseline share is in it."""
    paired = [d for d in differences if d is not None]
    if band is None or not paired:
        return TOO_FEW
    return WITHIN if all(abs(d) <= band for d in paired) else OUTSIDE


def by_block(runs: Sequence[Mapping[str, Any]], arm: str, blocks: int) -> list[Mapping[str, Any] | None]:
    """The arm's finished run in each block (None where it failed or did not run)."""
    by = {(r["arm"], r["block"]): r for r in runs if r.get("block", -1) >= 0 and r.get("status") == "done"}
    return [by.get((arm, b)) for b in range(blocks)]


def compare_windows(arms: Sequence[Arm], runs: Sequence[Mapping[str, Any]], blocks: int, window: int,
                    seeds: Sequence[int] | None) -> dict[str, dict[str, Any]]:
    """Per arm: each seed's windowed loss, its difference from the baseline's of the same seed,
    the band and the verdict (the baseline's own entry has the band and no verdict)."""
    base = baseline_of(arms)
    base_losses = [windowed_mean(r, window) for r in by_block(runs, base.name, blocks)]
    band = band_of(base_losses)
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        losses = [windowed_mean(r, window) for r in by_block(runs, arm.name, blocks)]
        entry: dict[str, Any] = {"window": window, "seeds": list(seeds) if seeds is not None else None,
                                 "losses": losses, "band": band}
        if arm is not base:
            diffs = [a - b if a is not None and b is not None else None
                     for a, b in zip(losses, base_losses, strict=True)]
            entry.update(differences=diffs, baseline_losses=base_losses, verdict=verdict(diffs, band),
                         largest_difference=max((abs(d) for d in diffs if d is not None), default=None))
        out[arm.name] = entry
    return out


def _num(v: Any, fmt: str = ".4f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def markdown_lines(result: Mapping[str, Any]) -> list[str]:
    """The report's loss section: one row per arm and seed count, the band, the verdicts."""
    rows = [r for r in result.get("rows", []) if r.get("loss_window")]
    if not rows:
        return []
    first = rows[0]["loss_window"]
    seeds = first.get("seeds")
    heads = [f"seed {s}" for s in seeds] if seeds else [f"block {i + 1}" for i in range(len(first["losses"]))]
    lines = ["", f"## Loss over the last {first['window']} iterations", "",
             f"Band (the baseline's spread across {'seeds' if seeds else 'blocks'}): {_num(first['band'])}. "
             "Difference: arm less baseline, same seed.", "",
             f"| arm | {' | '.join(heads)} | differences | verdict |", f"|---|{'---|' * len(heads)}---|---|"]
    for r in rows:
        w = r["loss_window"]
        diffs = ", ".join(_num(d, "+.4f") for d in w.get("differences", [])) or "-"
        lines.append(f"| {r['arm']} | {' | '.join(_num(v) for v in w['losses'])} | {diffs} "
                     f"| {w.get('verdict', 'baseline')} |")
    return lines
