"""tune's phases, each one experiment in OUT/<phase>, through ablate's stages from its arms on
(runs, schedule, execution, analysis, report: the same modules, not copies): leave-one-out from
the defaults, the factorial of the unresolved toggles, the confirmation; and :func:`tune`, which
runs them in order within one budget."""

from __future__ import annotations

import dataclasses
import datetime
import shlex
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._version import __version__
from ...core.profile import Choice, Confirmation, Profile
from ...core.registry import BY_DEST
from ..ablate import analysis, execution, report, runs, schedule, stats
from ..ablate.design import Arm, DesignError, baseline_of, design_of, expand, pinning
from ..ablate.spec import ExperimentSpec, parse_toggles
from .evidence import evidence, measured_on, within_memory_limit
from .rule import (
    DEFAULT_MAX_FACTORIAL,
    Decided,
    check_baseline,
    correct_turn_offs,
    cut_short,
    decide_factorial,
    decide_leave_one_out,
    factorial_arms,
    failed_arms,
    family_confidence,
    leave_one_out_verdicts,
    not_measured,
    pick_combination,
    say,
    settle,
    step_ms,
    unresolved_kept,
)


@dataclass(slots=True)
class Setup:
    """What every phase shares: the experiment's spec (tune's options), the environment, the
    dry-run resolver (one arm's dry run, as ``ablate.runs.resolve_arm``) and the clock (the last two
    are stand-ins in tests), and tune's own options."""

    spec: ExperimentSpec
    environ: dict[str, str]
    resolver: Callable[..., dict[str, Any]]
    clock: Callable[[], float]
    start: float
    planned: str = "one process"  # the world the dry runs plan for, in words (the spec's world_words)
    max_factorial: int = DEFAULT_MAX_FACTORIAL
    memory_limit_gb: float | None = None

    @property
    def args(self) -> list[str]:
        """The Megatron arguments as every run gets them."""
        return runs.run_args(self.spec)

    def minutes_left(self) -> float | None:
        return None if self.spec.budget is None else self.spec.budget - (self.clock() - self.start) / 60

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


def defaults_dry_run(setup: Setup, toggles: Sequence[str]) -> tuple[dict[str, str], dict[str, bool]]:
    """Toggles a guard keeps off with every default on (dest -> the guard's reason): they cannot
    take part, since an arm that asks for them on would not get it (ablate refuses such arms); and
    every on/off toggle not taking part with the value this dry run decided, pinned in every run so
    that no run decides them differently."""
    resolver = runs.planned(setup.resolver, setup.spec)
    record = resolver(setup.spec.script, setup.args, Arm("defaults", dict.fromkeys(toggles, True)), setup.environ)
    decisions = record.get("decisions", {})
    excluded = {d: f"{decisions[d].get('source')}: {decisions[d].get('reason')}" for d in toggles
                if d in decisions and decisions[d].get("value") is not True}
    pins = {d: rec["value"] for d, rec in decisions.items() if d in BY_DEST and BY_DEST[d].kind == "bool"
            and isinstance(rec.get("value"), bool) and (d not in toggles or d in excluded)}
    return excluded, pins


def run_phase(setup: Setup, design: str, arms: list[Arm], confidence: float, warmup_run: bool,
              prior_seconds: Sequence[float] = ()) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One experiment in OUT/<design>: confound check, blocks, results; (result, records). A phase
    has tune's spec with its own design, confidence and warm-up run, and no stopping rule but
    --repeats and --budget. ``prior_seconds`` (the leave-one-out runs' times) price the first block
    of a phase without a warm-up run, so that it too starts only where it ends within the budget."""
    spec = dataclasses.replace(setup.spec, design=design, confidence=confidence, warmup_run=warmup_run,
                               target_ci=None, max_repeats=setup.spec.repeats, out=str(Path(setup.spec.out) / design))
    resolved = runs.resolved(spec, design_of(design, arms), setup.environ, setup.resolver)
    planned = schedule.scheduled(resolved, prior_seconds)
    result = report.reported(analysis.analysed(execution.executed(planned, setup.phase_clock())))
    return result, resolved.records


def timed_runs(first: Mapping[str, Any]) -> list[float]:
    """The finished leave-one-out runs' seconds (its blocks, not the warm-up): what a later phase's
    runs cost."""
    return execution.run_seconds([r for r in first["runs"] if r.get("block", -1) >= 0])


def phase_fits(setup: Setup, first: Mapping[str, Any], design: str, arms: Sequence[Arm]) -> str | None:
    """Why a later phase cannot start within the budget (None: it can): the runs of its first block
    not done in an earlier call, timed by the leave-one-out runs, must end before the budget does.
    (Inside the phase, each block is checked again once the dry runs give the exact commands.)"""
    left = setup.minutes_left()
    seconds = timed_runs(first)
    out = Path(setup.spec.out) / design
    to_run = [a for a in arms if schedule.finished_earlier(runs.run_dir(out, a, 0), a.env) is None]
    if left is None or not seconds or not to_run:
        return None
    block = statistics.median(seconds) * len(to_run) / 60
    if block > left:
        what = f"one block of {len(arms)} arms" if len(to_run) == len(arms) else \
            f"the {len(to_run)} runs of its first block not done earlier"
        return f"--budget {setup.spec.budget:g} min: {what} (about {block:.1f} min) would not fit in " \
               f"the {max(left, 0):.1f} min left"
    return None


def second_phase(setup: Setup, decided: Mapping[str, Decided], unresolved: Sequence[str],
                 results: dict[str, dict[str, Any]], pins: Mapping[str, bool]) -> dict[str, Decided]:
    """The factorial of the unresolved toggles where it can run, else they stay on (with why)."""
    first, limit = results["leave-one-out"], setup.max_factorial
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
    confidence = family_confidence(setup.spec.confidence, len(arms))
    say(f"phase 2: factorial of {', '.join(unresolved)} ({len(arms)} arms), the others pinned; a combination "
        f"must be faster than all on at {confidence * 100:.2f} % (corrected for {len(arms) - 1} comparisons)")
    second, _ = run_phase(setup, "factorial", arms, confidence, False, timed_runs(first))
    results["factorial"] = second
    cut = cut_short(second)
    if cut:  # the budget stopped it before a comparison could be made
        say(f"factorial {cut}")
        return unresolved_kept(unresolved, f"the factorial {cut}")
    return decide_factorial(unresolved, arms, pick_combination(second["rows"], arms))


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
    result, _ = run_phase(setup, "confirmation", arms, setup.spec.confidence, False,
                          timed_runs(results["leave-one-out"]))
    results["confirmation"] = result
    blocks = result["blocks_run"]
    cut = cut_short(result)
    if cut:  # like a confirmation that could not start: unconfirmed, not measured against
        say(f"confirmation {cut}")
        return dict(choices), Confirmation(outcome=f"{cut}: the chosen values are unconfirmed", blocks=blocks)
    sp = stats.paired_speedup([step_ms(r) for r in stats.by_block(result["runs"], "defaults", blocks)],
                              [step_ms(r) for r in stats.by_block(result["runs"], "chosen", blocks)], result["confidence"])
    settled, record = settle(choices, sp)
    say(f"confirmation: {record.outcome}")
    return settled, record


def taking_part(setup: Setup) -> tuple[tuple[str, ...], dict[str, str], dict[str, bool]]:
    """The toggles that take part, those a guard keeps off here (with why), and the pins."""
    toggles = parse_toggles(setup.spec.toggles, setup.spec.megatron_args)
    say(f"dry runs plan for {setup.planned}")
    excluded, pins = defaults_dry_run(setup, toggles)
    for dest, why in excluded.items():
        say(f"{dest} takes no part: a guard keeps it off here ({why})")
    part = tuple(t for t in toggles if t not in excluded)
    if not part:
        raise DesignError("every toggle named is kept off by a guard on this setup: nothing to tune")
    return part, excluded, pins


def tune(setup: Setup) -> tuple[Profile, dict[str, str], dict[str, dict[str, Any]]]:
    """Every phase; the profile, the toggles that took no part (with why) and each phase's result."""
    spec = setup.spec
    part, excluded, pins = taking_part(setup)
    say(f"phase 1: leave-one-out of {', '.join(part)} from the defaults ({len(part) + 1} arms)")
    arms = pinning(expand("leave-one-out", part, []), pins)
    first, records = run_phase(setup, "leave-one-out", arms, spec.confidence, spec.warmup_run)
    check_baseline(first, arms)
    results = {"leave-one-out": first}
    failed = [d for d in part if f"without:{d}" in failed_arms(first)]
    pins = {**pins, **dict.fromkeys(failed, True)}  # not measured: at their default from here on
    for dest in failed:
        say(f"{dest} is not measured: its arm failed (it keeps its default; see leave-one-out/)")
    verdicts = {d: v for d, v in leave_one_out_verdicts(first["rows"]).items() if d not in failed}
    verdicts, off_confidence = correct_turn_offs(first, baseline_of(arms).name, verdicts, spec.confidence)
    decided, unresolved = decide_leave_one_out(verdicts, off_confidence)
    if unresolved:
        decided.update(second_phase(setup, decided, unresolved, results, pins))
    fallback = not_measured(failed, first)
    choices = {d: Choice(True, fallback[d]) if d in fallback else
               Choice(decided[d].value, evidence(decided[d], results[decided[d].phase])) for d in part}
    choices, confirmation = confirm(setup, choices, {d: v for d, v in pins.items() if d not in choices}, results)
    # After the confirmation, which weighs speed alone: the limit is a constraint, not a preference.
    choices, memory_line = within_memory_limit(choices, first, setup.memory_limit_gb)
    if memory_line:
        say(memory_line)
    base = baseline_of(arms)
    profile = Profile(
        toggles=choices, environment=measured_on(records[arms.index(base)], first["world_size"]),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        made_by=f"megatron-perf-toggles tune {__version__}",
        command=shlex.join(runs.arm_command(spec.launch, spec.script, setup.args, base)), confirmation=confirmation,
        notes=memory_line)
    return profile, excluded, results
