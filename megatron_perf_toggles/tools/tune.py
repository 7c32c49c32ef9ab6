"""``megatron-perf-toggles tune``: measure the toggles on your own command line and write a profile.

It is ``ablate`` run two or three times, with a decision rule between and after (nothing here
measures or checks confounds on its own; it calls ablate's functions):

1. **Leave-one-out from the defaults**: every toggle on (the baseline), then each one off. Removing
   a toggle is either detectably slower (its interval lies below 1: keep it on), detectably faster
   at a Bonferroni-corrected confidence (turn it off; see :func:`correct_turn_offs`), or neither
   (unresolved). A toggle whose arm failed is not measured and keeps its default; a baseline that
   never finishes stops tune without a profile.
2. **Factorial of the unresolved toggles** (at most ``--max-factorial`` of them), with the resolved
   ones pinned to their decided values, every combination compared with all of them on. A
   combination replaces "all on" only when it is detectably faster, at a confidence corrected for
   picking among many arms (Bonferroni: ``1 - (1 - confidence) / (arms - 1)``); otherwise the
   unresolved toggles stay on.
3. **Confirmation**, where the chosen values differ from the defaults: the two sets against each
   other; unless the chosen set is faster or not detectably different, the defaults are kept.

Why keep on what is not detectably different: the defaults are the fast settings where they were
measured, a toggle that does nothing costs nothing, and turning one off on the strength of noise
would make a profile worse than no profile. Only an effect the experiment resolves moves a value.

Toggles a guard keeps off on this setup (no TE kernel, FSDP, ...) take no part: the guard decides
them in every run, with or without a profile. No block starts that is expected to end after
``--budget`` (priced by the runs finished so far; in the later phases, by leave-one-out's); a
re-run of the same command resumes (finished runs are skipped and cost nothing), as ablate's does.
A phase the budget cuts short before any comparison decides nothing: the unresolved toggles keep
their defaults, and chosen values stay unconfirmed. The result is
OUT/profile.json (``core.profile.render_profile``) and OUT/profile.md; each phase keeps ablate's own
results in OUT/leave-one-out/, OUT/factorial/ and OUT/confirmation/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..core.profile import Choice, Confirmation, Environment, Evidence, Profile, render_profile
from ..core.registry import BY_DEST, format_value
from ..errors import PerfTogglesError, fail
from .ablate import report, stats
from .ablate import runner as ablate
from .ablate.design import DEFAULT_TOGGLES, Arm, DesignError, baseline_of, expand, parse_toggles
from .ablate.report import write_results
from .ablate.world import world_size

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


# --- the decision rule, on ablate's result rows ----------------------------------------------------


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
    base_ms = [_ms(r) for r in report.done_by_block(first["runs"], base, blocks)]
    out = dict(verdicts)
    for dest, verdict in verdicts.items():
        if verdict == stats.FASTER:
            arm_ms = [_ms(r) for r in report.done_by_block(first["runs"], f"without:{dest}", blocks)]
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
    arms = expand("factorial", tuple(unresolved), [])
    pinned = {**(pins or {}), **{d: dec.value for d, dec in decided.items()}}
    for arm in arms:
        arm.fixed = dict(pinned)
        arm.baseline = all(arm.toggles.values())
    return arms


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


# --- evidence: the chosen arm against the arm that differs in this toggle alone ------------------


def _ms(run: Mapping[str, Any] | None) -> float | None:
    return ((run or {}).get("summary", {}).get("ms_per_iter") or {}).get("median")


def _loss(decided: Decided, result: Mapping[str, Any], chosen: Sequence[Mapping[str, Any] | None],
          against: Sequence[Mapping[str, Any] | None]) -> tuple[float | None, bool | None]:
    """The loss with the chosen value over the loss with the other, and whether it left the phase's
    one noise band, the baseline's (the band its results.md states). Where one of the two arms is
    the baseline, both come from the other arm's row of the phase's table, so the profile says what
    the table says; otherwise the pair is compared at its own last logged iteration against the
    baseline's band. Without a baseline row there is no band."""
    rows = {r["arm"]: r for r in result.get("rows", [])}
    base = next((name for name, r in rows.items() if r.get("baseline")), None)
    if base is not None and base in (decided.chosen, decided.against):
        other = decided.against if base == decided.chosen else decided.chosen
        row = (rows.get(other) or {}).get("loss")
        if not row:
            return None, None
        if base == decided.against:
            return row.get("ratio"), row.get("outside_noise_band")
        # the chosen value is the baseline's: the median of its per-block ratios, the table's the other way up
        flipped = stats.loss_comparison(row["arm_losses"], row["baseline_losses"])
        return (flipped or {}).get("ratio"), row.get("outside_noise_band")
    common = report.loss_iterations(chosen) & report.loss_iterations(against)
    if not common:
        return None, None
    last = max(common)
    band = report.losses_at(report.done_by_block(result["runs"], base, result["blocks_run"]), last) if base else []
    cmp_ = stats.loss_comparison(report.losses_at(against, last), report.losses_at(chosen, last), band_from=band)
    return (cmp_["ratio"], cmp_["outside_noise_band"]) if cmp_ else (None, None)


def evidence(decided: Decided, result: Mapping[str, Any]) -> Evidence:
    """Step time with the other value over step time with the chosen one, paired by block; the
    loss as :func:`_loss` compares it."""
    blocks = result["blocks_run"]
    chosen = report.done_by_block(result["runs"], decided.chosen, blocks)
    against = report.done_by_block(result["runs"], decided.against, blocks)
    sp = stats.paired_speedup([_ms(r) for r in against], [_ms(r) for r in chosen],
                              decided.confidence or result["confidence"])
    ratio, outside = _loss(decided, result, chosen, against)
    return Evidence(against=not decided.value, speedup=sp.get("estimate"), low=sp.get("low"), high=sp.get("high"),
                    verdict=sp["verdict"], confidence=sp["confidence"], blocks=sp["blocks"],
                    design=decided.phase, loss_ratio=ratio, loss_within_noise=None if outside is None else not outside,
                    rule=decided.rule, peak_memory_delta_mb=memory_change(result, decided.chosen, decided.against))


def peak_mb(result: Mapping[str, Any], arm: str) -> float | None:
    """An arm's measured peak allocated MB (the highest over its finished runs), None if not logged."""
    row = next((r for r in result.get("rows", []) if r["arm"] == arm), None)
    return None if row is None else row.get("max_allocated_mb")


def memory_change(result: Mapping[str, Any], chosen: str, against: str) -> float | None:
    """Peak allocated MB with the chosen arm minus with the other one."""
    a, b = peak_mb(result, chosen), peak_mb(result, against)
    return None if a is None or b is None else round(a - b, 1)


def within_memory_limit(choices: Mapping[str, Choice], first: Mapping[str, Any], limit_gb: float | None
                        ) -> tuple[dict[str, Choice], str]:
    """Keep the choices within ``--memory-limit-gb``: the peak of a set of choices is read from
    leave-one-out as all-on's peak plus, for each toggle chosen off, what removing it changed
    (measured; the toggles' memory terms add up, docs/memory.md). While it is above the limit, the
    toggle whose removal lowers the peak most is turned off, with the numbers in its rule. Returns
    the choices and a line for the profile's review ('' where no limit was given)."""
    if limit_gb is None:
        return dict(choices), ""
    limit = limit_gb * 1024
    base = peak_mb(first, "all-on")
    if base is None:
        return dict(choices), f"--memory-limit-gb {limit_gb:g}: not applied, leave-one-out logged no peak memory"
    without = {d: peak_mb(first, f"without:{d}") for d in choices}
    saving: dict[str, float] = {d: base - mb for d, mb in without.items() if mb is not None}

    def peak(cs: Mapping[str, Choice]) -> float:
        return base - sum(saving.get(d, 0.0) for d, c in cs.items() if c.value is False)

    out = dict(choices)
    while peak(out) > limit:
        candidates = [d for d, c in out.items() if c.value is not False and saving.get(d, 0.0) > 0]
        if not candidates:
            return out, (f"--memory-limit-gb {limit_gb:g}: the choices peak at {peak(out) / 1024:.1f} GB per GPU "
                         "(measured), and no toggle left on lowers it: above the limit")
        dest = max(candidates, key=lambda d: saving[d])
        before = peak(out)
        rule = (f"off: --memory-limit-gb {limit_gb:g}; with it on the choices peak at {before / 1024:.1f} GB per GPU "
                f"(measured), removing it saves {saving[dest]:.0f} MB")
        out[dest] = Choice(False, Evidence(against=True, verdict="memory limit", design="leave-one-out", rule=rule,
                                           peak_memory_delta_mb=-round(saving[dest], 1)))
        say(f"{dest} off: {rule}")
    return out, f"--memory-limit-gb {limit_gb:g}: the choices peak at {peak(out) / 1024:.1f} GB per GPU (measured)"


# --- the environment measured, from the dry-run records ------------------------------------------


def measured_on(record: Mapping[str, Any], world: int | None) -> Environment:
    """What the runs ran on: the baseline's dry-run record (Megatron, TE, torch, the GPU that
    process saw) and ``world``, the runs' world size (``ablate.world.world_size``; None: not
    recorded). The dry run's record is not asked for it: the dry run is one process planning for
    a world, not the runs themselves. No torch is imported here."""
    caps = record.get("capabilities") or {}
    te = caps.get("te_version")
    return Environment(megatron=(record.get("megatron") or {}).get("version"),
                       transformer_engine=None if te == "unknown" else te, torch=caps.get("torch_version"),
                       gpu=record.get("gpu_visible"),
                       world_size=world)


# --- running the phases --------------------------------------------------------------------------


@dataclass(slots=True)
class Setup:
    """What every phase shares: the parsed options, the Megatron arguments, the environment, the
    dry-run resolver and the clock (the last two are stand-ins in tests)."""

    ns: argparse.Namespace
    args: list[str]
    environ: dict[str, str]
    resolver: Callable[..., dict[str, Any]]
    clock: Callable[[], float]
    start: float
    planned: str = "one process"  # the world the dry runs plan for, in words (ablate.planned_for)

    def minutes_left(self) -> float | None:
        return None if self.ns.budget is None else self.ns.budget - (self.clock() - self.start) / 60

    def phase_clock(self) -> Callable[[], float]:
        """The clock for one ablate experiment, whose budget counts from its own first reading:
        that reading is tune's start, so ``--budget`` covers every phase and is named as given."""
        first = [True]

        def clock() -> float:
            if first[0]:
                first[0] = False
                return self.start
            return self.clock()

        return clock


def say(text: str) -> None:
    print(f"[tune] {text}", file=sys.stderr, flush=True)


# The plugin's own variables the runs keep: ASSUME plans for another machine (tests and CPU-only
# planning need it); the other two tag log directories and check ranks, and decide no toggle.
KEPT_OWN = ("MEGATRON_PERF_TOGGLES_ASSUME", "MEGATRON_PERF_TOGGLES_TAG_LOG_DIR", "MEGATRON_PERF_TOGGLES_RANK_CHECK")


def runs_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The runs' environment: this one without the plugin variables that would change what the
    runs decide (a profile in use, the plugin switched off, ...), which would measure the profile
    or the switch instead of the defaults. Said once on stderr when any was set."""
    removed = sorted(k for k in environ if k.startswith("MEGATRON_PERF_TOGGLES") and k not in KEPT_OWN)
    if removed:
        say(f"{', '.join(removed)} {'is' if len(removed) == 1 else 'are'} set here and left out of every run: "
            "tune measures the defaults, not a profile or a switch")
    return {k: v for k, v in environ.items() if k not in removed}


def guarded_off(setup: Setup, toggles: Sequence[str]) -> tuple[dict[str, str], dict[str, bool]]:
    """Toggles a guard keeps off with every default on (dest -> the guard's reason): they cannot
    take part, since an arm that asks for them on would not get it (ablate refuses such arms); and
    every on/off toggle not taking part with the value this dry run decided, pinned in every run so
    that no run decides them differently."""
    record = setup.resolver(setup.ns.script, setup.args, Arm("defaults", dict.fromkeys(toggles, True)),
                            setup.environ)
    decisions = record.get("decisions", {})
    excluded = {d: f"{decisions[d].get('source')}: {decisions[d].get('reason')}" for d in toggles
                if d in decisions and decisions[d].get("value") is not True}
    pins = {d: rec["value"] for d, rec in decisions.items() if d in BY_DEST and BY_DEST[d].kind == "bool"
            and isinstance(rec.get("value"), bool) and (d not in toggles or d in excluded)}
    return excluded, pins


def phase_options(setup: Setup, design: str, confidence: float, warmup_run: bool) -> argparse.Namespace:
    """The options ablate's experiment() reads, for one phase."""
    ns = setup.ns
    return argparse.Namespace(design=design, seed=ns.seed, repeats=ns.repeats, warmup_run=warmup_run,
                              warmup=ns.warmup, launch=ns.launch, script=ns.script, confidence=confidence,
                              effect=0.01, target_ci=None, max_repeats=ns.repeats, budget=ns.budget,
                              world_size=ns.world_size)


def run_phase(setup: Setup, design: str, arms: list[Arm], confidence: float, warmup_run: bool,
              prior_seconds: Sequence[float] = ()) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One ablate experiment in OUT/<design>: confound check, blocks, results; (result, records).
    ``prior_seconds`` (the leave-one-out runs' times) price the first block of a phase without a
    warm-up run, so that it too starts only where it ends within the budget."""
    out = Path(setup.ns.out) / design
    records, derived = ablate.resolve_and_check(setup.resolver, setup.ns.script, setup.args, arms, setup.environ)
    iters = setup.ns.iters if setup.ns.iters is not None else records[arms.index(baseline_of(arms))].get(
        "effective_args", {}).get("train_iters")
    ns = phase_options(setup, design, confidence, warmup_run)

    def runs_of_block(block: int) -> list[ablate.Run]:
        return [ablate.make_run(out, arms[i], block, ns.launch, ns.script, setup.args, records[i])
                for i in ablate.block_order(ns.seed, block, len(arms))]

    out.mkdir(parents=True, exist_ok=True)
    result = ablate.experiment(ns, arms, records, setup.args, out, setup.environ, runs_of_block, iters, derived,
                               setup.phase_clock(), prior_seconds)
    write_results(out, result, records)
    return result, records


def timed_runs(first: Mapping[str, Any]) -> list[float]:
    """The finished leave-one-out runs' seconds (its blocks, not the warm-up): what a later phase's
    runs cost."""
    return ablate.run_seconds([r for r in first["runs"] if r.get("block", -1) >= 0])


def phase_fits(setup: Setup, first: Mapping[str, Any], design: str, arms: Sequence[Arm]) -> str | None:
    """Why a later phase cannot start within the budget (None: it can): the runs of its first block
    not done in an earlier call, timed by the leave-one-out runs, must end before the budget does.
    (Inside the phase, each block is checked again once the dry runs give the exact commands.)"""
    left = setup.minutes_left()
    seconds = timed_runs(first)
    out = Path(setup.ns.out) / design
    to_run = [a for a in arms if ablate.finished_earlier(ablate.run_dir(out, a, 0), a) is None]
    if left is None or not seconds or not to_run:
        return None
    block = statistics.median(seconds) * len(to_run) / 60
    if block > left:
        what = f"one block of {len(arms)} arms" if len(to_run) == len(arms) else \
            f"the {len(to_run)} runs of its first block not done earlier"
        return f"--budget {setup.ns.budget:g} min: {what} (about {block:.1f} min) would not fit in " \
               f"the {max(left, 0):.1f} min left"
    return None


def unresolved_kept(unresolved: Sequence[str], why_not: str) -> dict[str, Decided]:
    return {d: Decided(d, True, f"kept on: removing it made no detectable difference, and {why_not}",
                       "leave-one-out", "all-on", f"without:{d}") for d in unresolved}


def second_phase(setup: Setup, decided: Mapping[str, Decided], unresolved: Sequence[str],
                 results: dict[str, dict[str, Any]], pins: Mapping[str, bool]) -> dict[str, Decided]:
    """The factorial of the unresolved toggles where it can run, else they stay on (with why)."""
    first, limit = results["leave-one-out"], setup.ns.max_factorial
    if first.get("stop_reason"):
        return unresolved_kept(unresolved, f"the factorial did not run ({first['stop_reason']})")
    if len(unresolved) > limit:
        return unresolved_kept(unresolved, f"the factorial did not run: {len(unresolved)} unresolved toggles are "
                               f"more than --max-factorial {limit} (more --repeats resolve more of them)")
    arms = factorial_arms(unresolved, decided, pins)
    why = phase_fits(setup, first, "factorial", arms)
    if why:
        say(f"factorial skipped: {why}")
        return unresolved_kept(unresolved, f"the factorial did not run ({why})")
    confidence = family_confidence(setup.ns.confidence, len(arms))
    say(f"phase 2: factorial of {', '.join(unresolved)} ({len(arms)} arms), the others pinned; a combination "
        f"must be faster than all on at {confidence * 100:.2f} % (corrected for {len(arms) - 1} comparisons)")
    second, _ = run_phase(setup, "factorial", arms, confidence, False, timed_runs(first))
    results["factorial"] = second
    cut = cut_short(second)
    if cut:  # the budget stopped it before a comparison could be made
        say(f"factorial {cut}")
        return unresolved_kept(unresolved, f"the factorial {cut}")
    return decide_factorial(unresolved, arms, pick_combination(second["rows"], arms))


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


def confirm(setup: Setup, choices: Mapping[str, Choice], pins: Mapping[str, bool],
            results: dict[str, dict[str, Any]]) -> tuple[dict[str, Choice], Confirmation | None]:
    """The last phase, where the chosen values differ from the defaults: defaults against chosen,
    headline-style (two arms, paired by block, no warm-up run), within the budget."""
    chosen = {d: c.value for d, c in choices.items()}
    if all(v is True for v in chosen.values()):
        return dict(choices), None
    arms = [Arm("defaults", dict.fromkeys(chosen, True), baseline=True, fixed=dict(pins)),
            Arm("chosen", dict(chosen), fixed=dict(pins))]  # type: ignore[arg-type]
    why = phase_fits(setup, results["leave-one-out"], "confirmation", arms)
    if why:
        say(f"confirmation skipped: {why}")
        return dict(choices), Confirmation(outcome=f"not run ({why}): the chosen values are unconfirmed")
    say("confirmation: the chosen values against the defaults (2 arms)")
    result, _ = run_phase(setup, "confirmation", arms, setup.ns.confidence, False,
                          timed_runs(results["leave-one-out"]))
    results["confirmation"] = result
    blocks = result["blocks_run"]
    cut = cut_short(result)
    if cut:  # like a confirmation that could not start: unconfirmed, not measured against
        say(f"confirmation {cut}")
        return dict(choices), Confirmation(outcome=f"{cut}: the chosen values are unconfirmed", blocks=blocks)
    sp = stats.paired_speedup([_ms(r) for r in report.done_by_block(result["runs"], "defaults", blocks)],
                              [_ms(r) for r in report.done_by_block(result["runs"], "chosen", blocks)], result["confidence"])
    settled, record = settle(choices, sp)
    say(f"confirmation: {record.outcome}")
    return settled, record


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


def tune(setup: Setup) -> tuple[Profile, dict[str, str], dict[str, dict[str, Any]]]:
    """Every phase; the profile, the toggles that took no part (with why) and each phase's result."""
    ns = setup.ns
    toggles = parse_toggles(ns.toggles)
    say(f"dry runs plan for {setup.planned}")
    excluded, pins = guarded_off(setup, toggles)
    for dest, why in excluded.items():
        say(f"{dest} takes no part: a guard keeps it off here ({why})")
    taking_part = tuple(t for t in toggles if t not in excluded)
    if not taking_part:
        raise DesignError("every toggle named is kept off by a guard on this setup: nothing to tune")
    say(f"phase 1: leave-one-out of {', '.join(taking_part)} from the defaults ({len(taking_part) + 1} arms)")
    arms = expand("leave-one-out", taking_part, [])
    for arm in arms:
        arm.fixed = dict(pins)
    first, records = run_phase(setup, "leave-one-out", arms, ns.confidence, ns.warmup_run)
    check_baseline(first, arms)
    results = {"leave-one-out": first}
    failed = [d for d in taking_part if f"without:{d}" in failed_arms(first)]
    pins = {**pins, **dict.fromkeys(failed, True)}  # not measured: at their default from here on
    for dest in failed:
        say(f"{dest} is not measured: its arm failed (it keeps its default; see leave-one-out/)")
    verdicts = {d: v for d, v in leave_one_out_verdicts(first["rows"]).items() if d not in failed}
    verdicts, off_confidence = correct_turn_offs(first, baseline_of(arms).name, verdicts, ns.confidence)
    decided, unresolved = decide_leave_one_out(verdicts, off_confidence)
    if unresolved:
        decided.update(second_phase(setup, decided, unresolved, results, pins))
    fallback = not_measured(failed, first)
    choices = {d: Choice(True, fallback[d]) if d in fallback else
               Choice(decided[d].value, evidence(decided[d], results[decided[d].phase])) for d in taking_part}
    choices, confirmation = confirm(setup, choices, {d: v for d, v in pins.items() if d not in choices}, results)
    # After the confirmation, which weighs speed alone: the limit is a constraint, not a preference.
    choices, memory_line = within_memory_limit(choices, first, getattr(ns, "memory_limit_gb", None))
    if memory_line:
        say(memory_line)
    command = ablate.arm_command(ns.launch, ns.script, setup.args, baseline_of(arms))
    profile = Profile(
        toggles=choices, environment=measured_on(records[arms.index(baseline_of(arms))],
                                                 world_size(first["runs"], baseline_of(arms).name, ns.launch, ns.world_size)),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        made_by=f"megatron-perf-toggles tune {__version__}", command=shlex.join(command), confirmation=confirmation,
        notes=memory_line)
    return profile, excluded, results


# --- output --------------------------------------------------------------------------------------


def _interval(ev: Evidence) -> str:
    if ev.speedup is None:
        return "-"
    if ev.low is None or ev.high is None:
        return f"{ev.speedup:.3f}"
    return f"{ev.speedup:.3f} [{ev.low:.3f}, {ev.high:.3f}]"


def summary(profile: Profile, path: Path, excluded: Mapping[str, str], results: Mapping[str, Mapping[str, Any]]
            ) -> str:
    """OUT/profile.md: what was chosen and why, for the review the profile is meant to get."""
    env = profile.environment
    lines = [f"# Profile `{path.name}`", "",
             f"Measured {profile.created} with {profile.made_by}: Megatron {env.megatron or '?'}, Transformer Engine "
             f"{env.transformer_engine or 'none'}, torch {env.torch or '?'}, GPU {env.gpu or 'not known'}, world size "
             f"{env.world_size or 'not recorded'}.", "", f"Command: `{profile.command}`", "",
             "| toggle | value | speedup of the value over the other [CI] | verdict | loss ratio "
             "| peak memory vs the other (MB) | how |",
             "|---|---|---|---|---|---|---|"]
    for dest, choice in profile.toggles.items():
        ev = choice.evidence
        assert ev is not None  # tune records evidence for every toggle it decides
        loss = "-" if ev.loss_ratio is None else f"{ev.loss_ratio:.4f}" + (
            "" if ev.loss_within_noise in (None, True) else " (outside noise band)")
        memory = "-" if ev.peak_memory_delta_mb is None else f"{ev.peak_memory_delta_mb:+.0f}"
        lines.append(f"| {dest} | {format_value(choice.value)} | {_interval(ev)} | {ev.verdict} | {loss} | {memory} "
                     f"| {ev.rule} |")
    for dest, why in excluded.items():
        lines.append(f"| {dest} | (not in the profile) | - | - | - | - | a guard keeps it off here: {why} |")
    if profile.notes:
        lines += ["", profile.notes + "."]
    lines += ["", "Intervals: paired t over blocks; a value turned off in leave-one-out and the factorial's at the "
              "corrected confidence they were decided with."]
    conf = profile.confirmation
    if conf is not None:
        if conf.verdict:
            interval = "-" if conf.speedup is None else _interval(Evidence(False, conf.speedup, conf.low, conf.high))
            lines += ["", f"Confirmation (defaults over chosen, {conf.blocks or 0} block(s)): {interval}, "
                      f"{conf.verdict}; {conf.outcome}."]
        else:  # not run, or cut short before a comparison: the outcome says which
            lines += ["", f"Confirmation (defaults over chosen): {conf.outcome}."]
    for phase, result in results.items():
        lines.append(f"- {phase}: {result['blocks_run']} block(s), results in `{phase}/results.md`"
                     + (f"; stopped: {result['stop_reason']}" if result.get("stop_reason") else ""))
    lines += ["", f"Use it: `MEGATRON_PERF_TOGGLES_PROFILE={path} <your launch>`; "
              "`megatron-perf-toggles explain` with the same variable shows what it decides."]
    return "\n".join(lines) + "\n"


def write_profile(out: Path, profile: Profile, excluded: Mapping[str, str],
                  results: Mapping[str, Mapping[str, Any]]) -> Path:
    path = out / "profile.json"
    tmp = out / ".profile.json.tmp"
    tmp.write_text(render_profile(profile))
    os.replace(tmp, path)  # a reader (or a launch) never sees half a profile
    (out / "profile.md").write_text(summary(profile, path, excluded, results))
    return path


# --- command -------------------------------------------------------------------------------------

DESCRIPTION = (
    "Measure the toggles on your own command line and write a profile (OUT/profile.json, with OUT/profile.md "
    "to review): first leave-one-out from the defaults; a toggle whose removal is detectably faster is turned "
    "off, one whose removal is detectably slower stays on; then every combination of the unresolved ones "
    "(removal not detectably different), of which one replaces 'all on' only when it is detectably faster. "
    "Every run is checked for confounds through Megatron's parser first, runs in seeded blocks, and is "
    "skipped when the same command is run again (resume); where the chosen values differ from the defaults, "
    "a last comparison of the two sets confirms them or falls back to the defaults. Use the result with "
    "MEGATRON_PERF_TOGGLES_PROFILE=OUT/profile.json.")
EPILOG = ("example: megatron-perf-toggles tune --budget 90 --launch 'torchrun --nproc-per-node 8' --out runs/tune "
          "-- pretrain_gpt.py <megatron args>")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tune`` options, for :func:`main`'s parser and the ``megatron-perf-toggles tune`` subcommand."""
    p.add_argument("--budget", type=float, metavar="MINUTES",
                   help="no block starts that would end later than this many minutes after the start (the first, "
                   "unmeasured warm-up run always runs, unless done in an earlier call: it times the others; "
                   "with --no-warmup-run the first block starts unpriced unless runs of it were done earlier; "
                   "the factorial and the confirmation are priced by the leave-one-out runs); run the same "
                   "command again to resume, with a fresh budget in which runs done earlier cost nothing")
    p.add_argument("--toggles", help="comma list of on/off toggle dests to tune (default: all five)")
    p.add_argument("--launch", help="launcher prefix, e.g. 'torchrun --nproc-per-node 8' (default: this python); "
                   "the profile's world size is the runs' own (Megatron's log), else --world-size, else what "
                   "it plainly starts")
    p.add_argument("--world-size", type=int, metavar="N", help=ablate.WORLD_SIZE_HELP)
    p.add_argument("--out", default="tune", help="output directory (default: ./tune); run again to resume")
    p.add_argument("--repeats", type=int, default=3, help="blocks per phase; each block runs every arm once (default 3)")
    p.add_argument("--iters", type=int, help="iterations per run (sets --train-iters; default: the arguments' own)")
    p.add_argument("--warmup", type=int, default=3, help="iterations left out of each run's median (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seeds each block's arm order (default 0)")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the intervals (default 0.95)")
    p.add_argument("--max-factorial", type=int, default=DEFAULT_MAX_FACTORIAL, metavar="N",
                   help=f"most unresolved toggles the factorial takes, 2^N arms (default {DEFAULT_MAX_FACTORIAL}); "
                   "with more, they stay on")
    p.add_argument("--no-warmup-run", dest="warmup_run", action="store_false",
                   help="skip the unmeasured warm-up run before the first block")
    p.add_argument("--memory-limit-gb", type=float, metavar="GB",
                   help="keep the choices' peak allocated memory per GPU (measured in leave-one-out) within this "
                   "many GB (of 1024 MB): while above it, the toggle whose removal saves most is turned off")
    p.add_argument("script", help="the Megatron training script, e.g. pretrain_gpt.py")
    p.add_argument("megatron_args", nargs=argparse.REMAINDER, help="Megatron arguments")


def build_tune_parser() -> argparse.ArgumentParser:
    from ..errors import OneLineArgumentParser

    p = OneLineArgumentParser(prog="megatron-perf-toggles tune", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def _prepare(ns: argparse.Namespace) -> list[str]:
    """Every check before the first dry run, and the Megatron arguments as the runs get them."""
    ns.effect, ns.target_ci = 0.01, None  # what ablate's checks read; tune has no such options
    ablate._validate(ns)
    if ns.memory_limit_gb is not None and not ns.memory_limit_gb > 0:
        raise DesignError(f"--memory-limit-gb {ns.memory_limit_gb:g}: a positive number of GB per GPU")
    if not 1 <= ns.max_factorial <= 5:
        raise DesignError(f"--max-factorial {ns.max_factorial}: between 1 and 5 (2 to 32 arms a block)")
    ablate._check_out(Path(ns.out))
    args = ablate.megatron_args_of(ns)
    if ns.iters is not None:
        args = ablate.set_args(args, {"--train-iters": str(ns.iters)})
    # tune's runs set every on/off toggle's variable (those taking part, and the others pinned)
    ablate.check_launcher(ns.launch, ns.script, args, [Arm("every toggle", dict.fromkeys(DEFAULT_TOGGLES, True))])
    return args


def run_tune(ns: argparse.Namespace, resolver: Callable[..., dict[str, Any]] = ablate.resolve_arm,
             clock: Callable[[], float] = time.monotonic) -> int:
    """The command: every phase, then the profile. Exit 0, 1 where a run failed (the profile is
    still written, from the runs that finished, unless the baseline never finished), 2 for bad
    input or a confound."""
    try:
        args = _prepare(ns)
        resolver, planned = ablate.planned_for(resolver, ns.launch, ns.world_size)
        setup = Setup(ns, args, runs_environ(os.environ), resolver, clock, clock(), planned)
        profile, excluded, results = tune(setup)
        path = write_profile(Path(ns.out), profile, excluded, results)
    except PerfTogglesError as error:
        fail(error)
    print((Path(ns.out) / "profile.md").read_text())
    say(f"wrote {path} (and profile.md beside it); use it with MEGATRON_PERF_TOGGLES_PROFILE={path}")
    failed = any(r.get("status") == "failed" for res in results.values() for r in res["runs"])
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None, resolver: Callable[..., dict[str, Any]] = ablate.resolve_arm,
         clock: Callable[[], float] = time.monotonic) -> int:
    try:
        ns = build_tune_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except PerfTogglesError as error:
        fail(error)
    return run_tune(ns, resolver, clock)


if __name__ == "__main__":
    raise SystemExit(main())
