"""Stage 4 of an experiment, runs to a schedule: blocks, seeds, runs at once, budget and resume.

Runs go in blocks: each block runs every arm once, in an order shuffled by ``--seed`` anew for
every block (drift and warm-up hit every arm alike), after one unmeasured warm-up run; with
``--common-start`` each block's seed first saves its start. ``--concurrent K`` runs K at a time
where K runs fit the GPU's memory (the memory model's planned peak of each run plus one process's
own overhead, measured: ``docs/benchmarks/process_overhead.json``), else as many as fit; there,
instead of the warm-up run, a compile warm-up may come first: one short run of each arm with runs
left (the baseline's too), riding in the waves of the common starts this call makes, so that the
runs that then start together find the compile caches warm rather than all compiling at the same
time. Its gain is modest (warm caches saved about 10 s of a run), so it never costs a wave of its
own: none without common starts to make in this call, or where the warm-ups would add a wave to
theirs; none either where runs go one at a time, or where every run is done. A run whose status
says done with the same command and the same plugin variables was finished in an earlier call and
is not run again (resume); the schedule knows which. It carries the stopping rules (``--budget``,
``--target-ci``, ``--max-repeats``) to the execution, and says itself in words for a dry run. :func:`scheduled` is the stage.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.registry import BY_DEST
from ...runtime.machine.target import GPUS
from .runs import COMPILE_WARMUP_ITERS, Run, Runs
from .spec import ExperimentSpec

OVERHEAD_FILE = "process_overhead.json"
# Until one process's overhead is measured on a GPU (bench/process_overhead.py): a guess, said as such.
FALLBACK_OVERHEAD_MB = 2048.0


def block_order(seed: int, block: int, n_arms: int) -> list[int]:
    """Arm indices in the order block ``block`` runs them: a shuffle seeded by (seed, block), so a
    block's order does not depend on how many blocks run and a resumed experiment repeats it."""
    order = list(range(n_arms))
    random.Random(f"ablate/{seed}/{block}").shuffle(order)
    return order


def finished_earlier(directory: Path, env: Mapping[str, str], command: Sequence[str] | None = None
                     ) -> dict[str, Any] | None:
    """The status of a run that finished in an earlier call and need not run again (None: it must
    run): done, with the arm's plugin variables ``env`` and, where given, the same command. Without
    a command (tune, before its dry runs) the answer is a forecast that the run itself confirms."""
    try:
        previous = json.loads((directory / "status.json").read_text())
    except (OSError, ValueError):  # none yet, or torn by a kill: run it
        return None
    if previous.get("status") != "done" or previous.get("env") != dict(env):
        return None
    if command is not None and previous.get("command") != list(command):
        return None
    return previous


# --- runs at once: what fits the GPU's memory ------------------------------------------------------


def overhead_path() -> Path | None:
    """The measured overhead's file: the package's copy (an installed package), else the source
    tree's ``docs/benchmarks/`` (a checkout); None where neither is there."""
    package = Path(__file__).resolve().parents[2]  # megatron_perf_toggles/
    for path in (package / "data" / OVERHEAD_FILE, package.parent / "docs" / "benchmarks" / OVERHEAD_FILE):
        if path.is_file():
            return path
    return None


def process_overhead(path: Path | None = None) -> tuple[float, str]:
    """One process's GPU memory outside what the memory model prices (the CUDA context, cuBLAS and
    NCCL workspaces), in MB, and where the figure comes from: the measurement where the file holds
    one (``measured.overhead_mb``), else a fallback that says it is one."""
    path = path or overhead_path()
    measured = None
    try:
        measured = json.loads(path.read_text()).get("measured") if path is not None else None
    except (OSError, ValueError, AttributeError):
        measured = None
    if isinstance(measured, Mapping) and isinstance(measured.get("overhead_mb"), (int, float)):
        return float(measured["overhead_mb"]), f"measured on {measured.get('gpu') or 'a GPU'}"
    return FALLBACK_OVERHEAD_MB, "a fallback until docs/benchmarks/process_overhead.json is measured"


def _gpu(record: Mapping[str, Any]) -> tuple[float | None, str]:
    """The GPU's memory in MB and its name, as the plan has them: the memory model's (the device's,
    or the planned GPU's), else the planned target's from the table of GPU facts."""
    caps, memory = record.get("capabilities") or {}, record.get("memory") or {}
    target = ((record.get("target") or {}).get("gpu") or {}).get("name")
    name = caps.get("gpu_name") or (GPUS[target].product if target in GPUS else None) or "the GPU"
    mb = memory.get("gpu_memory_mb") or caps.get("gpu_memory_mb")
    if mb is None and target in GPUS:
        mb = GPUS[target].memory_gib * 1024
    return (float(mb) if mb else None), name


def runs_that_fit(asked: int, records: Sequence[Mapping[str, Any]], overhead: tuple[float, str] | None = None
                  ) -> tuple[int, str | None]:
    """How many runs go at once: ``asked``, or the most that fit the GPU's memory where ``asked``
    do not (each run's planned peak, the largest of the arms', plus one process's overhead), and
    the one line that says so (None: nothing to say)."""
    if asked <= 1:
        return asked, None
    peaks = [(r.get("memory") or {}).get("planned_peak_mb") for r in records]
    capacity, name = _gpu(records[0]) if records else (None, "the GPU")
    if not records or capacity is None or any(p is None for p in peaks):
        return asked, (f"note: --concurrent {asked}: no planned peak memory for these runs (the memory model has no "
                       "estimate for this command), so whether they fit the GPU at once is not checked")
    extra, source = overhead or process_overhead()
    per_run = max(float(p) for p in peaks if p is not None) + extra
    fits = max(1, int(capacity // per_run))
    if fits >= asked:
        return asked, None
    return fits, (f"--concurrent {asked}: {asked} runs at once need about {asked * per_run / 1024:.1f} GB, more than "
                  f"{name}'s {capacity / 1024:.1f} GB (each run's planned peak {(per_run - extra) / 1024:.1f} GB plus "
                  f"{extra / 1024:.1f} GB of its process's own, {source}): running {fits} at once")


# --- the stage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    """The stage's value: each block's runs in its seeded order (every block the experiment may
    run), the warm-up run (None: none, as with ``--no-warmup-run`` or runs at once), each block's
    start run (``--common-start``), how many run at once, the runs finished in an earlier call (by
    directory), the run times that price a block before this call has timed one (tune's later
    phases), the runs the experiment plans, and (runs at once) the compile warm-up runs this call
    makes (see :func:`compile_warmups`) and, where it makes none, why in a few words (None: nothing
    to say, as with ``--no-warmup-run``, one at a time, or every run done)."""

    runs: Runs
    blocks: list[list[Run]]
    warmup: Run | None
    starts: dict[int, Run]
    at_once: int
    done: dict[Path, dict[str, Any]]
    prior_seconds: list[float]
    planned_runs: int
    compile_warmups: list[Run]
    no_warmup: str | None = None

    @property
    def together(self) -> bool:
        """--concurrent: runs share the GPU, so none is timed (and none is a warm-up run: the
        compile warm-up runs only fill the compile caches)."""
        return self.runs.spec.concurrent > 1

    @property
    def starts_made(self) -> list[Run]:
        """The common start runs this call makes (those of --repeats blocks not finished earlier)."""
        return starts_to_make(self.runs.starts, self.runs.spec.repeats, self.done)


def scheduled(runs: Runs, prior_seconds: Sequence[float] = (), say: Callable[[str], None] | None = None) -> Schedule:
    """The stage: the runs in blocks and in time. ``prior_seconds``: run times from an earlier
    experiment on the same job (tune's later phases, which have no warm-up run) price a block until
    this experiment has timed a run. ``say`` (ablate's): the line on runs at once that do not fit,
    and the plan in one line."""
    spec, note = runs.spec, say or (lambda line: None)
    together = spec.concurrent > 1
    blocks = [[block[i] for i in block_order(spec.seed, b, len(block))] for b, block in enumerate(runs.blocks)]
    at_once, line = runs_that_fit(spec.concurrent, runs.records)
    if line:
        note(line)
    warmup = runs.warmup if spec.warmup_run and not together else None
    # the warm-up run's status too, where it is not run: a resumed call may have had it earlier (the
    # compile warm-ups' are not read: a call makes its own, the caches being a machine's)
    every = [*(r for block in blocks for r in block), *runs.starts, *([] if together else [runs.warmup])]
    done = {r.directory: s for r in every if (s := finished_earlier(r.directory, r.env, r.command)) is not None}
    warmups, why = compile_warmups(runs, blocks[:spec.repeats], at_once, done)
    planned = spec.repeats * len(runs.design.arms) + (1 if warmup else 0) + len(warmups)
    schedule = Schedule(runs, blocks, warmup, dict(enumerate(runs.starts)), at_once, done, list(prior_seconds), planned,
                        warmups, why)
    note(plan_words(schedule))
    return schedule


def starts_to_make(starts: Sequence[Run], repeats: int, done: Mapping[Path, Any]) -> list[Run]:
    """The common start runs a call makes: those of the first ``repeats`` blocks not finished earlier."""
    return [r for r in starts[:repeats] if r.directory not in done]


def compile_warmups(runs: Runs, blocks: Sequence[Sequence[Run]], at_once: int, done: Mapping[Path, Any]
                    ) -> tuple[list[Run], str | None]:
    """The compile warm-up runs this call makes (runs.py makes one per arm), and where it makes
    none, why in a few words (None: nothing to say).

    One for each arm with a run of ``blocks`` still to do, the baseline's too (its start runs stop
    after one iteration, a warm-up after two), and only where they ride in the waves of the common
    starts this call makes without adding one: S starts and W warm-ups, K at a time, where
    ceil((S + W) / K) == ceil(S / K). A warm-up saves a run some seconds, a wave of its own would
    cost a whole start-up, so none without starts to make in this call or where they would need a
    wave more. None either with ``--no-warmup-run``, where runs go one at a time (the first of each
    arm compiles alone) or where every run is done. One made in an earlier call is made again: the
    caches it filled are that machine's, and a resumed call may run on another."""
    if not runs.spec.warmup_run or at_once <= 1:
        return [], None
    left = {r.arm for block in blocks for r in block if r.directory not in done}
    warmups = [r for r in runs.compile_warmups if r.arm in left]
    if not warmups:
        return [], None
    if not runs.starts:
        return [], "no compile warm-up: no common starts to ride with"
    starts = len(starts_to_make(runs.starts, len(blocks), done))
    if not starts:
        return [], "no compile warm-up: the common starts were made earlier"
    if math.ceil((starts + len(warmups)) / at_once) > math.ceil(starts / at_once):
        return [], "no compile warm-up: it would need a wave of its own"
    return warmups, None


# --- in words, for the notes and a dry run -------------------------------------------------------------


def _seeds_words(spec: ExperimentSpec) -> str:
    """Megatron's seeds of the blocks: --block-seeds BASE for the first, one more for each next."""
    base, blocks = spec.block_seeds or 0, spec.repeats
    last = base + blocks - 1
    words = str(base) if blocks == 1 else f"{base} and {last}" if blocks == 2 else f"{base} to {last}"
    more = spec.target_ci is not None and spec.max_repeats > spec.repeats
    return words + (" (and on, where --target-ci adds blocks)" if more else "")


def warmup_words(schedule: Schedule) -> str:
    """The compile warm-up of runs at once in words ("" where there is none this call), e.g. "1
    compile warm-up run of each arm first, at once with the common starts (no wave of its own)"."""
    wave, design = schedule.compile_warmups, schedule.runs.design
    if not wave:
        return ""
    every = len(wave) == len(design.arms)
    who = "each arm" if every else ", ".join(r.arm for r in wave) + " (the other arms' runs are done)"
    waves = math.ceil((len(wave) + len(schedule.starts_made)) / max(schedule.at_once, 1))
    split = f", in {waves} waves of at most {schedule.at_once}" if waves > 1 else ""
    return (f"1 compile warm-up run of {who} first, at once with the common starts (no wave of its own){split}, "
            f"{COMPILE_WARMUP_ITERS} iterations each, unmeasured")


def plan_words(schedule: Schedule) -> str:
    """The plan in one line: runs, blocks and arms, both seeds by name, iterations and what is measured."""
    spec, runs = schedule.runs.spec, schedule.runs
    compile_first = warmup_words(schedule)
    warm = "1 unmeasured warm-up run, then " if schedule.warmup else f"{compile_first}; then " if compile_first else ""
    seeds = f"arm order: --seed {spec.seed}"
    if spec.block_seeds is not None:
        seeds += f"; Megatron's --seed {_seeds_words(spec)}, one per block (--block-seeds {spec.block_seeds})"
    measured = (f"{schedule.at_once} at once share the GPU, so no step time is measured" if schedule.together
                else f"the first {spec.warmup} left out of the medians")
    why = f"; {schedule.no_warmup}" if schedule.no_warmup else ""
    return (f"{schedule.planned_runs} runs: {warm}{spec.repeats} block(s) x {len(runs.design.arms)} arms ({seeds}); "
            f"{runs.iters} iterations per run, {measured}{why}")


def baseline_words(runs: Runs) -> str:
    """What the baseline really is: the toggles it sets, the others pinned, and those it leaves
    to the plugin with what its dry run decided for them."""
    design, base = runs.design, runs.design.baseline
    decisions = runs.records[design.arms.index(base)].get("decisions", {})
    parts = [", ".join(f"{d} {'on' if v else 'off'}" for d, v in base.toggles.items())] if base.toggles else []
    parts += [", ".join(f"{k}={v}" for k, v in base.settings.items())] if base.settings else []
    if base.fixed:
        values = set(base.fixed.values())
        word = ("on" if True in values else "off") if len(values) == 1 else "at their values"
        parts.append(f"the {len(base.fixed)} toggles not taking part pinned {word}")
    if not parts:
        parts.append("the command as given")
    applies = runs.spec.model_toggles  # a dense model's dry run also reports the MoE toggles, which do nothing there
    free = [d for d in decisions if d in applies and BY_DEST[d].kind == "bool" and d not in base.pinned]
    if free:
        parts.append("not set by any arm, so as the plugin decides: " + ", ".join(
            f"{d} {'on' if decisions[d].get('value') else 'off'} ({decisions[d].get('source')})" for d in free))
    elif design.others == "inherit" and not base.fixed:
        parts.append("the toggles not named keep their defaults (the environment's, else the plugin's)")
    return "; ".join(parts)


def loss_test_words(schedule: Schedule) -> str:
    """What the loss test will do: its measure, unit, interval and margin, and what it prints."""
    spec = schedule.runs.spec
    if not spec.loss_test:
        return ("loss test: none (--block-seeds, --loss-window or --loss-measure asks for one); the results give "
                "each arm's loss ratio to the baseline's at the last iteration both logged, which judges nothing")
    window = f"its last {spec.loss_window} iterations" if spec.loss_window else "the last tenth of its iterations"
    measure = {"validation": "each run's last validation loss (--eval-iters > 0)",
               "train-window": f"each run's mean training loss over {window}",
               "auto": f"each run's last validation loss where every run logs one, else its mean training loss "
                       f"over {window}"}[spec.loss_measure]
    if spec.block_seeds is None:
        unit = "blocks that repeat one seed (run-to-run only, no claim across seeds)"
    else:
        unit = (f"seeds {_seeds_words(spec)} (--block-seeds), paired by seed"
                + (", every arm of a seed from one saved start" if spec.common_start else ""))
    return (f"loss test: {measure}; each arm less the baseline over {unit}, in % of the baseline's loss; a "
            f"{(1 - 2 * spec.loss_alpha) * 100:g} % t-interval (two one-sided tests at {spec.loss_alpha:g}) against "
            f"+-{spec.loss_margin:g} % (--loss-margin): equivalent, different or inconclusive. After the runs: one "
            f"loss: line per arm, with the seeds +-{spec.loss_margin:g} % needs at the spread measured")


def dry_run_lines(schedule: Schedule) -> list[str]:
    """--dry-run: each block's order, (with --common-start) the run that saves block 1's start, (with
    --concurrent) the compile warm-up in words and its first run, or why there is none, then each arm's environment and
    command, what the baseline is, and what the loss test will do."""
    import shlex

    runs = schedule.runs
    lines = [f"block {b + 1}: " + ", ".join(r.arm for r in schedule.blocks[b]) for b in range(runs.spec.repeats)]
    if schedule.starts:
        start = schedule.starts[0]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in start.env.items())
        lines.append(f"common start of block 1 (the baseline, one iteration, saved):\n  {env} {shlex.join(start.command)}")
    if schedule.compile_warmups:
        first = schedule.compile_warmups[0]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in first.env.items())
        lines.append(f"compile warm-up: {warmup_words(schedule)}, no checkpoint loaded or saved; {first.arm}'s:"
                     f"\n  {env} {shlex.join(first.command)}")
    elif schedule.no_warmup:
        lines.append(schedule.no_warmup)
    for run in schedule.blocks[0]:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run.env.items())
        what = f" (baseline: {baseline_words(runs)})" if run.arm == runs.design.baseline.name else ""
        lines.append(f"{run.arm}{what}:\n  {env} {shlex.join(run.command)}")
    return [*lines, loss_test_words(schedule)]
