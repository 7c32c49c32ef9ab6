"""ablate's loss test: each arm's loss against the baseline's, seed by seed, as an equivalence test.

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


def by_block(runs: Sequence[Mapping[str, Any]], arm: str, blocks: int) -> list[Mapping[str, Any] | None]:
    """The arm's finished run in each block (None where it failed or did not run)."""
    by = {(r["arm"], r["block"]): r for r in runs if r.get("block", -1) >= 0 and r.get("status") == "done"}
    return [by.get((arm, b)) for b in range(blocks)]


def redrawn_by(arm: Arm, base: Arm) -> list[str]:
    """The toggles the arm and the baseline set apart that draw the initial weights differently:
    under one seed the two do not start from the same weights."""
    mine, theirs = arm.pinned(), base.pinned()
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
    mine, theirs = arm.pinned(), base.pinned()
    apart = [d for d in mine if mine.get(d) != theirs.get(d)]
    if len(apart) == 1 and not arm.settings:
        return apart[0]
    return arm.name


def compare_losses(arms: Sequence[Arm], runs: Sequence[Mapping[str, Any]], blocks: int, *, measure: str,
                   window: int | None, margin: float, alpha: float, seeds: Sequence[int] | None,
                   common_start: bool = False) -> dict[str, Any]:
    """The loss test of every arm against the baseline: ``{"settings": ..., "arms": {name: entry}}``.

    Each entry: the toggle it names, the measure per seed (block), the differences, the interval,
    the verdict, the smallest margin shown, the seeds the margin needs, paired or not (and why).
    ``common_start``: every arm of a seed loaded one saved start (common_start.py), so every
    comparison is paired."""
    base = baseline_of(arms)
    done = {a.name: by_block(runs, a.name, blocks) for a in arms}
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


def _pct(v: Any, fmt: str = "+.2f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def interval_text(e: Mapping[str, Any]) -> str:
    """``+0.12 % [-0.30, +0.54]`` (the estimate alone where there is no interval)."""
    if e.get("estimate") is None:
        return "-"
    if e.get("low") is None:
        return f"{_pct(e['estimate'])} %"
    return f"{_pct(e['estimate'])} % [{_pct(e['low'])}, {_pct(e['high'])}]"


def advice(e: Mapping[str, Any]) -> str:
    """What an inconclusive or too-wide result would need: seeds at the spread measured."""
    need = e.get("seeds_needed")
    if need is None:
        return "2 or more seeds give an interval"
    per = " per arm" if not e.get("paired") else ""
    return f"+-{e['margin']:g} % needs about {need} seeds{per} at this spread"


def verdict_line(name: str, e: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """One arm's verdict in a line, as ablate prints it."""
    how = "paired" if e.get("paired") else "unpaired"
    unit = "seeds" if settings.get("seeded_blocks", True) else "blocks of one seed"
    words = f"{e['toggle']} ({name}): {interval_text(e)}, {e.get('seeds_compared', 0)} {unit}, {how}, " \
            f"{settings['measure']}: {e['verdict']}"
    if not settings.get("seeded_blocks", True):
        words += " (one seed: run-to-run only, no claim across seeds)"
    if e["verdict"] == equivalence.INCONCLUSIVE and e.get("smallest_margin_shown") is not None:
        words += f" (smallest margin shown +-{e['smallest_margin_shown']:.2f} %; {advice(e)})"
    return words


def verdict_lines(loss: Mapping[str, Any] | None) -> list[str]:
    if not loss:
        return []
    return [verdict_line(n, e, loss["settings"]) for n, e in loss["arms"].items() if "verdict" in e]


def markdown_lines(loss: Mapping[str, Any] | None) -> list[str]:
    """The report's loss section: one row per arm, first cell the toggle's registry name."""
    if not loss:
        return []
    s = loss["settings"]
    what = ("the last held-out validation loss" if s["measure"] == VALIDATION else
            f"the mean training loss over the last {s['window'] or 'tenth of the'} iterations")
    unit = ("seeds (--block-seeds --common-start: every arm of a seed starts from one saved state and sees the "
            "same data)" if s.get("common_start") else
            "seeds (--block-seeds: every arm of a seed shares its initial weights and data order)"
            if s["seeded_blocks"] else "blocks that repeat one seed: the interval measures run-to-run "
            "nondeterminism on that seed alone, not the change across seeds")
    conf = f"{s['interval'] * 100:g} %"
    lines = ["", f"## Loss: equivalence within +-{s['margin']:g} %", "",
             f"Measure: {what}. Unit: {unit}. Difference: arm less baseline, same seed, in % of the baseline's "
             f"mean; {conf} t-interval (two one-sided tests at {s['alpha']:g}); unpaired (Welch) where the arm "
             "draws its initial weights another way. Verdicts: equivalent (the interval inside the margin), "
             "different (it excludes 0 and reaches past the margin), else inconclusive.", "",
             f"| toggle | arm | seeds | difference [{conf} CI] | smallest margin shown | seeds for +-{s['margin']:g} % "
             "| pairing | verdict |", "|---|---|---|---|---|---|---|---|"]
    for name, e in loss["arms"].items():
        if "verdict" not in e:
            continue
        small = e.get("smallest_margin_shown")
        pairing = "paired" if e.get("paired") else f"unpaired: {e.get('unpaired_because')}"
        lines.append(f"| {e['toggle']} | {name} | {e.get('seeds_compared', 0)} | {interval_text(e)} "
                     f"| {'-' if small is None else f'+-{small:.2f} %'} | {e.get('seeds_needed') or '-'} "
                     f"| {pairing} | {e['verdict']} |")
    return lines
