"""ablate's loss test (part of stage 6, analysis.py): each arm's loss against the baseline's, seed
by seed, as an equivalence test.

Each run gives one loss measure: the last held-out validation loss it logged (Megatron prints one
with ``--eval-iters`` > 0; a fixed held-out set is the least noisy measure), or else the mean of
the training loss over its last N iterations (one iteration's loss is noisy). ``auto`` takes the
validation loss where every run compared logged one. Blocks are seeds (``--block-seeds``): every
arm of a block starts from the same initial weights and sees the same data, so the arm's measure
less the baseline's of the same seed is the paired difference equivalence.py tests. An arm that
differs from its baseline in a toggle that draws the initial weights another way (the registry's
``redraws_init``) does not share its start with the baseline under one seed: its comparison is
unpaired (Welch), and says so. Without ``--block-seeds`` every block repeats one seed, and the
interval measures run-to-run nondeterminism on that seed alone: the results say that too.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ....core.registry import BY_DEST
from ..design import Arm, baseline_of
from ..stats import by_block
from . import equivalence

MEASURES = ("auto", "validation", "train-window")
VALIDATION = "validation"
TRAIN_WINDOW = "train-window"


def train_window_mean(run: Mapping[str, Any] | None, window: int | None) -> float | None:
    """The mean logged training loss over the run's last ``window`` iterations (None: the last
    tenth of them, at least one), or None without a run or a loss."""
    if not run:
        return None
    points = [(it["iteration"], it["lm_loss"]) for it in run.get("iterations", []) if "lm_loss" in it]
    if not points:
        return None
    last = max(i for i, _ in points)
    n = window if window is not None else max(1, last // 10)
    return statistics.fmean(v for i, v in points if i > last - n)


def validation_last(run: Mapping[str, Any] | None) -> float | None:
    """The run's last held-out validation loss (None: none logged)."""
    points = (run or {}).get("validation") or []
    return points[-1]["lm_loss"] if points else None


def resolve_measure(measure: str, runs: Sequence[Mapping[str, Any] | None]) -> str:
    """``auto``: the validation loss where every finished run compared logged one, else the training window."""
    if measure != "auto":
        return measure
    done = [r for r in runs if r]
    return VALIDATION if done and all(validation_last(r) is not None for r in done) else TRAIN_WINDOW


def measure_of(run: Mapping[str, Any] | None, measure: str, window: int | None) -> float | None:
    return validation_last(run) if measure == VALIDATION else train_window_mean(run, window)


def redrawn_by(arm: Arm, base: Arm) -> list[str]:
    """The toggles the arm and the baseline set apart that draw the initial weights differently:
    under one seed the two do not start from the same weights."""
    mine, theirs = arm.pinned, base.pinned
    return sorted(d for d in set(mine) | set(theirs)
                  if d in BY_DEST and BY_DEST[d].redraws_init and mine.get(d) != theirs.get(d))


def toggle_name(arm: Arm, base: Arm) -> str:
    """How the loss table names an arm: the registry name of the one toggle it sets apart from the
    baseline; "defaults" for the defaults arm; a candidate's name; else the arm's own name."""
    if arm is base:
        return "baseline"
    if arm.name == "defaults":
        return "defaults"
    if arm.adds:
        return ", ".join(n for n in arm.adds)
    mine, theirs = arm.pinned, base.pinned
    apart = [d for d in mine if mine.get(d) != theirs.get(d)]
    if len(apart) == 1 and not arm.settings:
        return apart[0]
    return arm.name


def compare_losses(arms: Sequence[Arm], runs: Sequence[Mapping[str, Any]], blocks: int, *, measure: str,
                   window: int | None, margin: float, alpha: float, seeds: Sequence[int] | None,
                   common_start: bool = False) -> dict[str, Any]:
    """The loss test of every arm against the baseline over ``blocks`` blocks of ``runs`` (as
    results.json records them: a finished directory re-analysed); see :func:`losses_compared`."""
    done = {a.name: by_block(runs, a.name, blocks) for a in arms}
    return losses_compared(arms, baseline_of(arms), done, measure=measure, window=window, margin=margin, alpha=alpha,
                           seeds=seeds, common_start=common_start)


def losses_compared(arms: Sequence[Arm], base: Arm, done: Mapping[str, Sequence[Mapping[str, Any] | None]], *,
                    measure: str, window: int | None, margin: float, alpha: float, seeds: Sequence[int] | None,
                    common_start: bool = False) -> dict[str, Any]:
    """The loss test of every arm against ``base``: ``{"settings": ..., "arms": {name: entry}}``.
    ``done``: each arm's finished run in each block (stats.by_block).

    Each entry: the toggle it names, the measure per seed (block), the differences, the interval,
    the verdict, the smallest margin shown, the seeds the margin needs, paired or not (and why).
    ``common_start``: every arm of a seed loaded one saved start (common_start.py), so every
    comparison is paired."""
    used = resolve_measure(measure, [r for rs in done.values() for r in rs])
    values = {name: [measure_of(r, used, window) for r in rs] for name, rs in done.items()}
    settings = {"measure": used, "asked": measure, "window": window if used == TRAIN_WINDOW else None,
                "margin": margin, "alpha": alpha, "interval": 1.0 - 2.0 * alpha,
                "seeds": list(seeds) if seeds is not None else None, "seeded_blocks": seeds is not None,
                "common_start": common_start}
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        entry: dict[str, Any] = {"toggle": toggle_name(arm, base), "measure": used, "seeds": settings["seeds"],
                                 "values": values[arm.name]}
        if arm is not base:
            redrawn = [] if common_start else redrawn_by(arm, base)
            test = equivalence.welch if redrawn else equivalence.paired
            entry.update(test(values[arm.name], values[base.name], margin, alpha),
                         baseline_values=values[base.name],
                         unpaired_because=(f"{', '.join(redrawn)} draws the initial weights another way"
                                           if redrawn else None))
        out[arm.name] = entry
    return {"settings": settings, "arms": out}
