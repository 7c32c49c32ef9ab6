"""tune's decision rule, on the rows of each phase's experiment: what is kept on, turned off, or left
to the next phase, and at which confidence. Pure: no run, no file."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...core.profile import Choice, Confirmation, Evidence
from ...errors import PerfTogglesError
from ..ablate import stats
from ..ablate.design import Arm, baseline_of, expand
from ..ablate.stats import step_ms

DEFAULT_MAX_FACTORIAL = 3  # 8 arms a block; 4 would be 16


@dataclass(slots=True)
class Decided:
    """One toggle's value and how it was reached: the experiment, its two arms and the rule."""

    dest: str
    value: bool
    rule: str
    phase: str = ""  # the phase whose runs hold the evidence ("" where nothing was measured)
    chosen: str = ""  # the arm with the chosen value
    against: str = ""  # the arm that differs from ``chosen`` in this toggle alone
    confidence: float | None = None  # the confidence it was decided at, where not the phase's own


def say(text: str) -> None:
    print(f"[tune] {text}", file=sys.stderr, flush=True)


def leave_one_out_verdicts(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """dest -> the verdict on removing it ("without:dest" against all on): slower, faster, or not."""
    return {row["arm"].split(":", 1)[1]: (row.get("speedup") or {}).get("verdict", stats.TOO_FEW)
            for row in rows if str(row["arm"]).startswith("without:")}


def correct_turn_offs(first: Mapping[str, Any], base: str, verdicts: Mapping[str, str], confidence: float
                      ) -> tuple[dict[str, str], float]:
    """The verdicts with every "faster" (turn it off) checked again at a Bonferroni-corrected
    confidence over the toggles compared, and that confidence.

    Phase 1 makes one comparison per toggle; at 95 % each, with five toggles that do nothing one of
    them would be called "faster" by noise about a fifth of the time. Turning a default off is the
    action that must be guarded, so "faster" must hold at ``1 - (1 - confidence) / toggles``. A
    "slower" verdict keeps the default, which is the null action (what no profile would do), so a
    false one costs nothing over having no profile and needs no correction. A "faster" that does
    not survive becomes unresolved and goes to the factorial, which corrects for its own arms."""
    corrected = 1 - (1 - confidence) / max(len(verdicts), 1)
    blocks = first["blocks_run"]
    base_ms = [step_ms(r) for r in stats.by_block(first["runs"], base, blocks)]
    out = dict(verdicts)
    for dest, verdict in verdicts.items():
        if verdict == stats.FASTER:
            arm_ms = [step_ms(r) for r in stats.by_block(first["runs"], f"without:{dest}", blocks)]
            out[dest] = stats.paired_speedup(base_ms, arm_ms, corrected)["verdict"]
    return out, corrected


def decide_leave_one_out(verdicts: Mapping[str, str], off_confidence: float | None = None
                         ) -> tuple[dict[str, Decided], list[str]]:
    """Removing it is detectably slower: keep it on; detectably faster (at ``off_confidence``, the
    corrected one, where given): turn it off; otherwise it is unresolved (kept on unless the
    factorial finds better)."""
    decided: dict[str, Decided] = {}
    unresolved: list[str] = []
    for dest, verdict in verdicts.items():
        without = f"without:{dest}"
        if verdict == stats.SLOWER:
            decided[dest] = Decided(dest, True, "kept on: removing it is detectably slower", "leave-one-out",
                                    "all-on", without)
        elif verdict == stats.FASTER:
            at = "" if off_confidence is None else \
                f" at {off_confidence * 100:.2f} % (corrected for {len(verdicts)} comparisons)"
            decided[dest] = Decided(dest, False, f"turned off: removing it is detectably faster{at}", "leave-one-out",
                                    without, "all-on", off_confidence)
        else:
            unresolved.append(dest)
    return decided, unresolved


def failed_arms(result: Mapping[str, Any]) -> set[str]:
    """Arms with a measured run that crashed: their comparisons would read as "too few blocks",
    i.e. "unresolved", which is a claim about speed that nothing measured."""
    return {r["arm"] for r in result["runs"] if r.get("block", -1) >= 0 and r.get("status") == "failed"}


def finished_blocks(result: Mapping[str, Any], arm: str) -> int:
    return sum(1 for r in result["runs"] if r["arm"] == arm and r.get("block", -1) >= 0 and r.get("status") == "done")


def not_measured(dests: Sequence[str], first: Mapping[str, Any]) -> dict[str, Evidence]:
    """Toggles whose arm failed keep their default; the evidence says so instead of quoting an
    interval, so that nobody reads the value as measured."""
    runs = [r for r in first["runs"] if r.get("block", -1) >= 0]
    out = {}
    for dest in dests:
        arm = f"without:{dest}"
        bad = sum(1 for r in runs if r["arm"] == arm and r.get("status") == "failed")
        total = sum(1 for r in runs if r["arm"] == arm)
        out[dest] = Evidence(against=False, verdict="not measured", design="leave-one-out", confidence=first["confidence"],
                             rule=f"kept at its default, not measured: the arm without it failed in {bad} of {total} "
                             f"block(s) (see leave-one-out/{arm})")
    return out


def factorial_arms(unresolved: Sequence[str], decided: Mapping[str, Decided],
                   pins: Mapping[str, bool] | None = None) -> list[Arm]:
    """Every combination of the unresolved toggles, the resolved ones (and ``pins``) pinned to their
    values; the baseline is all of the unresolved on (the defaults it would otherwise keep)."""
    pinned = {**(pins or {}), **{d: dec.value for d, dec in decided.items()}}
    return [dataclasses.replace(arm, fixed=dict(pinned), baseline=all(arm.toggles.values()))
            for arm in expand("factorial", tuple(unresolved), [])]


def family_confidence(confidence: float, arms: int) -> float:
    """Bonferroni over the comparisons with the baseline: the chance that any arm is called
    faster by noise stays at most ``1 - confidence``."""
    return 1 - (1 - confidence) / max(arms - 1, 1)


def pick_combination(rows: Sequence[Mapping[str, Any]], arms: Sequence[Arm]) -> Arm:
    """The detectably faster combination with the highest lower bound, else the baseline."""
    faster = [(row["speedup"]["low"], arm) for row, arm in zip(rows, arms, strict=True)
              if not arm.baseline and (row.get("speedup") or {}).get("verdict") == stats.FASTER]
    return max(faster, key=lambda pair: pair[0])[1] if faster else baseline_of(arms)


def decide_factorial(unresolved: Sequence[str], arms: Sequence[Arm], chosen: Arm) -> dict[str, Decided]:
    by_values = {tuple(sorted(a.toggles.items())): a for a in arms}
    out: dict[str, Decided] = {}
    for dest in unresolved:
        flipped = by_values[tuple(sorted({**chosen.toggles, dest: not chosen.toggles[dest]}.items()))]
        rule = ("kept on: no combination of the unresolved toggles was detectably faster than all on"
                if chosen.baseline else f"{'on' if chosen.toggles[dest] else 'off'} in the combination "
                f"{chosen.name}, detectably faster than all on")
        out[dest] = Decided(dest, chosen.toggles[dest], rule, "factorial", chosen.name, flipped.name)
    return out


def unresolved_kept(unresolved: Sequence[str], why_not: str) -> dict[str, Decided]:
    return {d: Decided(d, True, f"kept on: removing it made no detectable difference, and {why_not}",
                       "leave-one-out", "all-on", f"without:{d}") for d in unresolved}


def cut_short(result: Mapping[str, Any]) -> str | None:
    """What to say of a later phase that the budget stopped before any arm had blocks enough to be
    compared (None: it compared, or ran all its blocks): no verdict can be read from it. A phase of
    tune has no --target-ci, so the budget is the only thing that stops one early."""
    reason = result.get("stop_reason")
    if not reason:
        return None
    if any((r.get("speedup") or {}).get("verdict") != stats.TOO_FEW for r in result["rows"] if not r.get("baseline")):
        return None
    blocks = result.get("blocks_run", 0)
    return f"did not run ({reason})" if not blocks else f"stopped after {blocks} block(s), too few to compare ({reason})"


def settle(choices: Mapping[str, Choice], sp: Mapping[str, Any]) -> tuple[dict[str, Choice], Confirmation]:
    """Keep the chosen values when, together, they are faster than the defaults or not detectably
    different; otherwise (slower, or the comparison could not be made) go back to the defaults:
    each value was chosen in its own comparison, and only this one ran them all at once."""
    record = {"speedup": sp.get("estimate"), "low": sp.get("low"), "high": sp.get("high"),
              "confidence": sp.get("confidence"), "verdict": sp["verdict"], "blocks": sp.get("blocks")}
    if sp["verdict"] in (stats.FASTER, stats.NO_DIFFERENCE):
        return dict(choices), Confirmation(**record, outcome="kept: the chosen values together are not detectably "
                                           "slower than the defaults")
    off = [d for d, c in choices.items() if c.value is not True]
    why = f"the chosen values together (off: {', '.join(off)}) were {sp['verdict']} against the defaults"
    back = Evidence(against=False, verdict="not confirmed", design="confirmation",
                    rule=f"back to the default: {why} in the confirmation")
    return ({d: Choice(True, back) if d in off else c for d, c in choices.items()},
            Confirmation(**record, outcome=f"fell back to the defaults: {why}"))


class TuneStopped(PerfTogglesError):
    """Nothing can be decided from what ran (the baseline never finished): no profile is written."""

    exit_code = 1


def check_baseline(first: Mapping[str, Any], arms: Sequence[Arm]) -> None:
    """Every comparison is with the baseline: without one finished run of it, a profile would
    claim measurements that do not exist, so tune stops instead of writing one."""
    base = baseline_of(arms).name
    crashed = any(r.get("status") == "failed" for r in first["runs"])  # the warm-up run too
    if not first.get("blocks_run") and first.get("stop_reason") and not crashed:  # the budget alone
        raise TuneStopped(f"no block of leave-one-out could start ({first['stop_reason']}), so nothing was "
                          "measured and no profile was written", "run the same command with a larger --budget: "
                          "what ran is kept")
    if not finished_blocks(first, base):
        raise TuneStopped(f"the baseline ({base}) did not finish a single measured run, so nothing was measured "
                          "and no profile was written", "see OUT/leave-one-out/ for its logs")
