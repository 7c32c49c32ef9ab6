"""Stage 5 of an experiment, execution to measurements: the schedule carried out, each run's log parsed once.

One run at a time: the unmeasured warm-up run, then blocks until a stopping rule says enough:
after ``--repeats`` blocks, or with ``--target-ci`` once every speed interval is that narrow or
``--max-repeats`` is reached; no block starts that would end after ``--budget`` (with
``--split-blocks``, no run). Runs at once go K at a time in block order, no batch starting that
would end after the budget, after the common starts (in waves of at most K) and, riding in their
waves where the schedule found room, a compile warm-up: one short run of each arm with runs left,
unmeasured, so that the runs that start together find the compile caches warm; a warm-up that
fails is said in one line, and the runs compile for themselves. A run the schedule found finished
in an earlier call is not run again; a crashed run is reported with its last lines and never stops
the others. Each run's log is parsed once, as the run ends (or is found done): that is its
measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..megatron_log import ITERATION, parse_file, parse_lines
from . import stats
from .runs import Run
from .schedule import Schedule, warmup_words

ERROR_TAIL_LINES = 12
RAW_KEYS = ("ms_per_iter", "tflops_per_gpu", "lm_loss", "grad_norm", "global_batch_size")


def say(text: str) -> None:
    print(f"[ablate] {text}", file=sys.stderr, flush=True)


# --- one run ----------------------------------------------------------------------------------------


class Progress:
    """One status line on stderr: run i/N, block, arm, iteration, ETA."""

    def __init__(self, total_runs: int, stream: Any = None, live: bool | None = None) -> None:
        self.total = total_runs
        self.stream = stream or sys.stderr
        # A redrawn line only on a terminal; a log file gets one line per run.
        self.live = live if live is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.run_seconds: list[float] = []
        self.last = ""

    def update(self, index: int, name: str, iteration: int, total_iters: int, ms_per_iter: float | None,
               remaining_runs: int) -> None:
        eta = ""
        if ms_per_iter and total_iters:
            left = (total_iters - iteration) * ms_per_iter / 1000
            per_run = statistics.median(self.run_seconds) if self.run_seconds else total_iters * ms_per_iter / 1000
            eta = f" ETA run {left:5.0f}s, all {left + remaining_runs * per_run:6.0f}s"
        width = 24
        done = int(width * iteration / total_iters) if total_iters else 0
        bar = "#" * done + "." * (width - done)
        self.last = f"[run {index}/{self.total}] {name[:36]:<36} [{bar}] it {iteration}/{total_iters}{eta}"
        if self.live:
            self.stream.write(f"\r{self.last}   ")
            self.stream.flush()

    def finish_run(self, seconds: float, status: str) -> None:
        self.run_seconds.append(seconds)
        self.stream.write(f"{'' if self.live else self.last} {status} in {seconds:.0f}s\n")
        self.last = ""
        self.stream.flush()


def error_tail(text: str, lines: int = ERROR_TAIL_LINES) -> list[str]:
    """The last lines of a failed run's output, starting at its last traceback where it has one."""
    all_lines = text.rstrip().splitlines()
    start = max((i for i, ln in enumerate(all_lines) if ln.lstrip().startswith("Traceback")), default=None)
    picked = all_lines[start:] if start is not None else all_lines
    return picked[-lines:]


def report_failure(status: dict[str, Any], stream: Any) -> None:
    stream.write(f"[ablate] FAILED: {status['label']}, exit code {status['returncode']}; "
                 f"last lines of {status['log']}:\n")
    for line in status.get("error_tail", []):
        stream.write(f"    {line}\n")
    stream.flush()


def run_seconds(statuses: Sequence[Mapping[str, Any] | None]) -> list[float]:
    """How long the finished runs took: what prices the runs still to do (a crash, often quick,
    says nothing about how long a run takes)."""
    return [s["seconds"] for s in statuses if s and s.get("status") == "done" and s.get("seconds")]


def execute(run: Run, environ: dict[str, str], progress: Progress, index: int, remaining: int,
            extra_env: Mapping[str, str] | None = None, previous: dict[str, Any] | None = None,
            loud: bool = True) -> dict[str, Any]:
    """Run one arm once, unless ``previous`` (the status of the same run finished in an earlier
    call, as the schedule found it) says it is done; never raises on a crash. ``extra_env``: what
    this run alone gets besides (a port of its own). ``loud``: a crash's last lines are printed
    (a compile warm-up's failure is its caller's one line instead)."""
    run.directory.mkdir(parents=True, exist_ok=True)
    if previous is not None:
        progress.stream.write(f"[run {index}/{progress.total}] {run.label}: done earlier, skipped\n")
        return previous
    log_path = run.directory / "log.txt"
    start = time.monotonic()
    last_ms: float | None = None
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(run.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**environ, **(extra_env or {}), **run.env}, bufsize=1)
        except OSError as error:
            log.write(f"could not start {run.command[0]}: {error}\n")
            code = 127
        else:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if ITERATION.search(line):  # the progress line reads the iteration as it passes
                    it = parse_lines([line]).iterations[0]
                    last_ms = it.get("ms_per_iter") or last_ms
                    progress.update(index, run.label, it.iteration, it.total, last_ms, remaining)
            code = proc.wait()
    seconds = time.monotonic() - start
    status: dict[str, Any] = {"arm": run.arm, "block": run.block, "label": run.label,
                              "status": "done" if code == 0 else "failed", "returncode": code, "seconds": seconds,
                              "command": run.command, "env": run.env, "log": str(log_path)}
    if code != 0:
        status["error_tail"] = error_tail(log_path.read_text(errors="replace"))
    (run.directory / "status.json").write_text(json.dumps(status, indent=1) + "\n")
    progress.finish_run(seconds, status["status"])
    if code != 0 and loud:
        report_failure(status, progress.stream)
    return status


def execute_together(batch: Sequence[Run], environ: dict[str, str], first_port: int, done: int, total: int,
                     earlier: Mapping[Any, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Run ``batch`` at once (threads wait on the processes), each with its own MASTER_PORT from
    ``first_port`` on; their statuses in the batch's order. ``earlier``: the runs finished in an
    earlier call, by directory. A compile warm-up's crash (block -1) prints no last lines: its
    caller says it in one line, and its arm's runs print their own."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict[str, Any]:
        progress = Progress(total, live=False)
        return execute(batch[i], environ, progress, done + i + 1, 0, {"MASTER_PORT": str(first_port + i)},
                       (earlier or {}).get(batch[i].directory), loud=batch[i].block >= 0)

    with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
        return list(pool.map(one, range(len(batch))))


def measure(status: dict[str, Any], warmup: int) -> tuple[dict[str, Any], int | None]:
    """One run's measurement, from its log read once: its status with every iteration's raw values,
    the steady-state summary (medians after the first ``warmup`` iterations) and the validation
    losses; and the world size the run's log states (None: it states none, or there is no log)."""
    out = dict(status)
    path = status.get("log")
    if not path or not os.path.exists(path):
        return out, None
    log = parse_file(path)
    out["iterations"] = [{"iteration": it.iteration, **{k: it.values[k] for k in RAW_KEYS if k in it.values}}
                         for it in log.iterations]
    out["summary"] = log.summary(skip_first=warmup)
    if log.validation:
        out["validation"] = [{"iteration": i, "lm_loss": v} for i, v in log.validation]
    return out, log.world_size


def warmed_words(statuses: Sequence[Mapping[str, Any]]) -> str:
    """The compile warm-up's outcome in one line: how long it took, or which arms' warm-ups failed
    (their runs go on, each compiling for itself)."""
    failed = [s for s in statuses if s.get("status") != "done"]
    took = max((s.get("seconds") or 0.0 for s in statuses), default=0.0)
    if not failed:
        return f"compile warm-up: {len(statuses)} run(s) done in {took:.0f}s, unmeasured"
    which = ", ".join(f"{s.get('arm')} (exit {s.get('returncode')}, log {s.get('log')})" for s in failed)
    return (f"compile warm-up failed for {which}: the runs go on, compiling for themselves "
            f"({len(statuses) - len(failed)} of {len(statuses)} done)")


def logged_world(measured: Sequence[Mapping[str, Any]], worlds: Sequence[int | None], arm: str) -> int | None:
    """The world size Megatron printed in one of ``arm``'s finished runs (``worlds``: what each of the
    ``measured`` runs' logs said): the run's own word."""
    return next((w for m, w in zip(measured, worlds, strict=True)
                 if w is not None and m.get("arm") == arm and m.get("status") == "done"), None)


# --- the stage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurements:
    """The stage's value: every run measured (its status and its log's numbers, in the order they
    ran: the warm-up run, then the blocks' runs), the blocks run and their orders, the blocks whose
    runs ran in two calls, each seed's start run (--common-start), why it stopped early (None:
    it did not), how long it took, whether a warm-up run finished before the blocks (this call's or
    an earlier one's; runs at once: every compile warm-up run this call made, False where it made
    none), the world size Megatron printed in one of the baseline's finished runs, each arm's
    finished run in each block (stats.by_block), and (runs at once) the status of each compile
    warm-up run this call made, by arm (none where it made none: an earlier call's are not its)."""

    schedule: Schedule
    runs: list[dict[str, Any]]
    blocks: int
    orders: list[list[str]]
    across_calls: list[int]
    starts: dict[int, dict[str, Any]]
    stop_reason: str | None
    seconds: float
    warmed: bool
    logged_world: int | None
    done: dict[str, list[Mapping[str, Any] | None]]  # each arm's finished run in each block: what comparisons pair
    warmups: dict[str, dict[str, Any]]


def executed(schedule: Schedule, clock: Callable[[], float] = time.monotonic) -> Measurements:
    """The stage: the schedule carried out within its stopping rules, each run measured as it ends.
    ``clock`` prices blocks against the budget (a stand-in in tests; its first reading is the start)."""
    return _Execution(schedule, clock).carry_out()


class _Execution:
    """The runs so far, while the schedule is carried out."""

    def __init__(self, schedule: Schedule, clock: Callable[[], float]) -> None:
        self.schedule, self.clock = schedule, clock
        self.spec, self.environ = schedule.runs.spec, schedule.runs.environ
        self.measured: list[dict[str, Any]] = []
        self.worlds: list[int | None] = []
        self.blocks = 0
        self.orders: list[list[str]] = []
        self.across_calls: list[int] = []  # blocks (1-based) whose runs ran in two calls (--split-blocks)
        self.starts: dict[int, dict[str, Any]] = {}  # --common-start: each seed's start run's status
        self.warmups: dict[str, dict[str, Any]] = {}  # --concurrent: this call's compile warm-ups' statuses

    def carry_out(self) -> Measurements:
        start = self.clock()
        reason = self._run_together(start) if self.schedule.together else self._run_blocks(start)
        seconds = self.clock() - start
        logged = logged_world(self.measured, self.worlds, self.schedule.runs.design.baseline.name)
        done = {arm.name: stats.by_block(self.measured, arm.name, self.blocks) for arm in self.schedule.runs.design.arms}
        return Measurements(self.schedule, self.measured, self.blocks, self.orders, self.across_calls, self.starts,
                            reason, seconds, self._warmed(), logged, done, self.warmups)

    def _warmed(self) -> bool:
        """Whether the runs came after a warm-up: one at a time, the warm-up run finished (this call
        or an earlier one); at once, this call made compile warm-ups and every one finished."""
        if self.schedule.together:
            planned = self.schedule.compile_warmups
            return bool(planned) and all(self.warmups.get(r.arm, {}).get("status") == "done" for r in planned)
        warm = self.schedule.runs.warmup
        return warm.directory in self.schedule.done or any(
            m.get("block") == -1 and m.get("status") == "done" for m in self.measured)

    def _record(self, statuses: Sequence[dict[str, Any]]) -> None:
        for status in statuses:
            measured, world = measure(status, self.spec.warmup)
            self.measured.append(measured)
            self.worlds.append(world)

    def _execute(self, run: Run, progress: Progress) -> None:
        index = len(self.measured) + 1
        self._record([execute(run, self.environ, progress, index, max(progress.total - index, 0),
                              previous=self.schedule.done.get(run.directory))])

    # --- one at a time ------------------------------------------------------------------------

    def _run_blocks(self, start: float) -> str | None:
        """Warm-up run, then blocks until a stopping rule; why it stopped early (None: it did not)."""
        progress = Progress(self.schedule.planned_runs)
        failed = self._starts([0], progress)
        if failed:
            return failed
        if self.schedule.warmup is not None:
            self._warm_up(self.schedule.warmup, progress)
        stop_reason = None
        while True:
            stop, stop_reason = self._enough()
            if stop:
                break
            stop_reason = self._starts([self.blocks], progress)
            if stop_reason:
                break
            block = self.schedule.blocks[self.blocks]
            stop_reason = None if self.spec.split_blocks else self._over_budget(block, start)
            if stop_reason:
                break
            self.orders.append([r.arm for r in block])
            progress.total = max(progress.total, len(self.measured) + len(block))
            stop_reason = self._run_block(block, progress, start)
            if stop_reason:
                break
            self.blocks += 1
        if stop_reason:
            say(f"stopped: {stop_reason}")
        return stop_reason

    def _run_block(self, block: list[Run], progress: Progress, start: float) -> str | None:
        """Each run of the block; with --split-blocks, none starts that would end after --budget
        (the stop reason; the same command resumes the block there). A block that a call resumed
        part-way is named in the results: its runs ran in two calls."""
        earlier = sum(r.directory in self.schedule.done for r in block)
        for i, run in enumerate(block):
            why = self._over_budget([run], start) if self.spec.split_blocks else None
            if why:
                return f"{why}: stopped before run {i + 1} of {len(block)} of the block, which the same command resumes"
            self._execute(run, progress)
        if 0 < earlier < len(block):
            self.across_calls.append(self.blocks + 1)
        return None

    def _warm_up(self, warm: Run, progress: Progress) -> None:
        """The unmeasured warm-up run; it times the runs still to do, which it says."""
        earlier = warm.directory in self.schedule.done
        self._execute(warm, progress)
        per_run = self.measured[-1]["seconds"]
        if self.measured[-1]["status"] != "done":
            say(f"the warm-up run failed after {per_run:.0f}s: it prices nothing")
            return
        spec = self.spec
        to_do = sum(r.directory not in self.schedule.done for block in self.schedule.blocks[:spec.repeats]
                    for r in block)
        more = " (--target-ci may add blocks)" if spec.target_ci is not None and spec.max_repeats > spec.repeats else ""
        left = (f"about {per_run * to_do / 60:.1f} min for the {to_do} runs of --repeats blocks still to do"
                if to_do else "every run of the --repeats blocks is done")
        say(f"the warm-up run took {per_run:.0f}s{' (in an earlier call)' if earlier else ''}: {left}{more}")

    def _enough(self) -> tuple[bool, str | None]:
        """Whether to stop before the next block (and why, where a rule other than --repeats says so)."""
        spec = self.spec
        if self.blocks < spec.repeats:
            return False, None
        if spec.target_ci is None:
            return True, None
        arms = self.schedule.runs.design.arms
        base = self.schedule.runs.design.baseline
        width = stats.widest_interval(self.measured, base.name, [a.name for a in arms if a is not base], self.blocks,
                                      spec.confidence)
        if width <= spec.target_ci:
            return True, f"every interval within +-{spec.target_ci * 100:g} % after {self.blocks} blocks"
        if self.blocks >= spec.max_repeats:
            return True, f"--max-repeats {spec.max_repeats} reached (widest interval +-{width * 100:.2f} %)"
        return False, None

    def _over_budget(self, block: list[Run], start: float) -> str | None:
        """Why ``block`` would not end within --budget (None: it would, or nothing prices it).

        A resumed block costs only its runs not done earlier; one with none left costs nothing and
        is never the reason to stop. Priced by this call's finished runs, else (no warm-up run) by
        this block's runs done earlier, else by the caller's prior times."""
        spec = self.spec
        previous = [self.schedule.done.get(r.directory) for r in block]
        to_run = [r for r, done in zip(block, previous, strict=True) if done is None]
        seconds = run_seconds(self.measured) or run_seconds(previous) or self.schedule.prior_seconds
        if spec.budget is None or not seconds or not to_run:
            return None
        predicted = statistics.median(seconds) * len(to_run)
        used = self.clock() - start
        if used + predicted <= spec.budget * 60:
            return None
        left = "" if len(to_run) == len(block) else f", {len(to_run)} of its {len(block)} runs still to do"
        # the first run on a fresh machine also pays one-time costs (kernel and helper builds):
        # say so where that price, not the time already used, stopped it
        timed = (", timed by the warm-up run alone"
                 if self.blocks == 0 and spec.warmup_run and used <= spec.budget * 60 else "")
        return (f"--budget {spec.budget:g} min: block {self.blocks + 1} (about {predicted / 60:.1f} min"
                f"{left}{timed}) would not fit after {used / 60:.1f} min")

    # --- runs at once, and the common starts -----------------------------------------------------------

    def _run_together(self, start: float) -> str | None:
        """--concurrent K: the common starts and (in their waves) the compile warm-up, then every
        block's runs, K at a time (fewer where K do not fit the GPU's memory), in block order; no
        batch starts that would end after --budget (priced by the batches before it). The stop
        reason, if any."""
        spec, k = self.spec, self.schedule.at_once
        blocks = self.schedule.blocks[:spec.repeats]
        todo = [r for block in blocks for r in block]
        self.orders = [[r.arm for r in block] for block in blocks]
        ahead = warmup_words(self.schedule)
        none = self.schedule.no_warmup or "no warm-up run"
        plan = f"{ahead}; then {len(todo)} runs, {k} at a time" if ahead else f"{len(todo)} runs, {k} at a time, {none}"
        say(f"--concurrent {spec.concurrent}: {plan}; they share the GPU, so the result keeps losses and memory but "
            "no speed figures")
        port = self._first_port
        reason = self._first_wave(range(spec.repeats))
        if reason:
            say(f"stopped: {reason}")
            return reason
        for first in range(0, len(todo), k):
            batch = todo[first:first + k]
            reason = self._batch_over_budget(batch, start)
            if reason:
                break
            self._record(execute_together(batch, self.environ, port, len(self.measured), len(todo),
                                          self.schedule.done))
        self.blocks = len(self.measured) // len(blocks[0])
        if reason:
            say(f"stopped: {reason}")
        return reason

    def _batch_over_budget(self, batch: list[Run], start: float) -> str | None:
        """Why a batch of runs at once would not end within --budget: it takes about as long as
        the slowest run of the batches before it (None: it fits, or nothing prices it yet)."""
        budget = self.spec.budget
        to_run = [r for r in batch if r.directory not in self.schedule.done]
        seconds = run_seconds(self.measured)
        if budget is None or not to_run or not seconds:
            return None
        used = self.clock() - start
        if used + max(seconds) <= budget * 60:
            return None
        return (f"--budget {budget:g} min: the next {len(to_run)} runs at once (about {max(seconds) / 60:.1f} min) "
                f"would not fit after {used / 60:.1f} min")

    @property
    def _first_port(self) -> int:
        """The MASTER_PORT of a wave's first run at once (each next run takes the next port)."""
        return int(self.environ.get("MASTER_PORT", "29500")) + 1

    def _first_wave(self, blocks: Sequence[int]) -> str | None:
        """--concurrent: the start runs of ``blocks`` (--common-start) and this call's compile
        warm-up runs (the schedule makes them only where they ride in the starts' waves and add
        none), at once in waves of at most K: a start, the warm-ups, then the other starts; a start
        finished in an earlier call takes no place in a wave. A failed warm-up is said in one line
        and stops nothing; a failed start stops the experiment (the reason, as :meth:`_starts`)."""
        todo = [b for b in blocks if b in self.schedule.starts and b not in self.starts]
        made, wave = [self.schedule.starts[b] for b in todo], self.schedule.compile_warmups
        ordered = [*made[:1], *wave, *made[1:]]
        statuses = dict(zip([r.directory for r in ordered], self._in_waves(ordered), strict=True))
        self.warmups = {r.arm: statuses[r.directory] for r in wave}
        if wave:
            say(warmed_words(list(self.warmups.values())))
        return self._started(todo, [statuses[r.directory] for r in made])

    def _in_waves(self, runs: Sequence[Run]) -> list[dict[str, Any]]:
        """``runs`` at once, K at a time, each wave after the last has ended; their statuses in order.
        A run finished in an earlier call is only reported (done earlier) and takes no place in a wave."""
        port, k, done = self._first_port, self.schedule.at_once, self.schedule.done
        earlier = [r for r in runs if r.directory in done]
        fresh = [r for r in runs if r.directory not in done]
        statuses = dict(zip([r.directory for r in earlier],
                            execute_together(earlier, self.environ, port, 0, len(runs), done), strict=True))
        for i in range(0, len(fresh), k):
            batch = fresh[i:i + k]
            statuses.update(zip([r.directory for r in batch],
                                execute_together(batch, self.environ, port, len(earlier) + i, len(runs), done),
                                strict=True))
        return [statuses[r.directory] for r in runs]

    def _starts(self, blocks: Sequence[int], progress: Progress) -> str | None:
        """--common-start, one at a time: the start runs of ``blocks`` not made yet (None: made, or
        no common start; else why the experiment stops: the blocks' runs could not load it)."""
        todo = [b for b in blocks if b in self.schedule.starts and b not in self.starts]
        done = self.schedule.done
        statuses = [execute(self.schedule.starts[b], self.environ, progress, len(self.measured) + 1, 0,
                            previous=done.get(self.schedule.starts[b].directory)) for b in todo]
        return self._started(todo, statuses)

    def _started(self, todo: Sequence[int], statuses: Sequence[dict[str, Any]]) -> str | None:
        """The start runs of blocks ``todo`` made (their ``statuses``): None, else why the experiment stops."""
        if not todo:
            return None
        self.starts.update(zip(todo, statuses, strict=True))
        failed = [b for b, st in zip(todo, statuses, strict=True) if st.get("status") != "done"]
        if failed:
            seed = (self.spec.block_seeds or 0) + failed[0]
            return f"the common start of seed {seed} failed (log: {self.starts[failed[0]].get('log')})"
        return None
