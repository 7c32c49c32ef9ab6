"""``Experiment``: a spec's arms checked for confounds, then run in blocks until a stopping rule.

1. :meth:`Experiment.check` resolves every arm (and each variable's single-change probe) through
   the plugin's dry run and refuses confounded arms (confounds.py).
2. :meth:`Experiment.run` runs one unmeasured warm-up run, then blocks: each block runs every arm
   once in an order shuffled by the seed, so drift and warm-up hit every arm alike. It stops
   after ``repeats`` blocks, or, with ``target_ci``, once every interval is that narrow or
   ``max_repeats`` is reached; no block starts that would end after ``budget``.
3. The result compares each arm with the baseline block by block (report.py, on stats.py).

``ablate`` runs one experiment; ``tune`` runs one per phase. Both go through this class alone.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import runs, world
from .argv import set_args
from .confounds import dry_run_world, resolve_and_check, resolve_arm
from .design import Arm, baseline_of
from .loss import common_start
from .loss.loss_test import compare_losses
from .report import compare, measure_run, sizing, widest_interval, without_speed, write_results
from .spec import ExperimentSpec
from .world import logged_world_size, world_size

Resolver = Callable[..., dict[str, Any]]


def say(text: str) -> None:
    print(f"[ablate] {text}", file=sys.stderr, flush=True)


class Experiment:
    """One experiment: ``spec`` over ``arms``, its runs under ``out``, with ``environ`` for every
    run. ``resolver`` (the dry run, planned for the runs' world) and ``clock`` are stand-ins in
    tests; ``prior_seconds`` (run times from an earlier experiment on the same job: tune's later
    phases, which have no warm-up run) price a block until this experiment has timed a run."""

    def __init__(self, spec: ExperimentSpec, arms: Sequence[Arm], out: Path, environ: dict[str, str],
                 resolver: Resolver = resolve_arm, clock: Callable[[], float] = time.monotonic,
                 prior_seconds: Sequence[float] = ()) -> None:
        # a plain `python` launch gets what torchrun would set (world.single_process_env)
        environ = {**world.single_process_env(spec.launch, spec.world_size, environ), **environ}
        self.spec, self.arms, self.out, self.environ = spec, list(arms), out, environ
        self.resolver, self.clock, self.prior_seconds = resolver, clock, list(prior_seconds)
        self.args = spec.run_args()
        self.records: list[dict[str, Any]] = []
        self.derived: dict[str, set[str]] = {}
        self.statuses: list[dict[str, Any]] = []
        self.orders: list[list[str]] = []
        self.blocks = 0
        self.across_calls: list[int] = []  # blocks (1-based) whose runs ran in two calls (--split-blocks)
        self.starts: dict[int, dict[str, Any]] = {}  # --common-start: each seed's start run's status

    # --- before the first run ------------------------------------------------------------------

    def check(self) -> None:
        """Dry-run every arm and probe, refuse confounds and runs with nothing to measure."""
        self.records, self.derived = resolve_and_check(self.resolver, self.spec.script, self.args, self.arms,
                                                       self.environ)
        self.spec.check_measurable(self.iters)
        if self.spec.common_start:
            common_start.check_record(self.record_of(self.baseline))

    @property
    def baseline(self) -> Arm:
        return baseline_of(self.arms)

    def record_of(self, arm: Arm) -> dict[str, Any]:
        return self.records[self.arms.index(arm)]

    @property
    def iters(self) -> Any:
        """Iterations per run: ``--iters``, else what the baseline's arguments resolve to."""
        if self.spec.iters is not None:
            return self.spec.iters
        return self.record_of(self.baseline).get("effective_args", {}).get("train_iters")

    def runs_of_block(self, block: int) -> list[runs.Run]:
        """Block ``block``'s runs in their seeded order (-1: the warm-up run, the baseline's)."""
        if block < 0:
            return [self._run(self.baseline, -1)]
        return [self._run(self.arms[i], block) for i in runs.block_order(self.spec.seed, block, len(self.arms))]

    def _run(self, arm: Arm, block: int) -> runs.Run:
        return runs.make_run(self.out, arm, block, self.spec.launch, self.spec.script, self.args_of(block),
                             self.record_of(arm).get("effective_args", {}), together=self.together)

    def args_of(self, block: int) -> list[str]:
        """Block ``block``'s Megatron arguments: with --block-seeds, its own --seed (the warm-up run, block -1,
        has the base seed)."""
        if self.spec.block_seeds is None:
            return self.args
        seed = self.spec.block_seeds + max(block, 0)
        args = set_args(self.args, {"--seed": str(seed)})
        return common_start.loading(args, self.out, seed) if self.spec.common_start else args

    def seeds(self) -> list[int] | None:
        """The Megatron seed of each block run (None: every block has the arguments' own)."""
        base = self.spec.block_seeds
        return None if base is None else [base + b for b in range(self.blocks)]

    @property
    def together(self) -> bool:
        """--concurrent: runs share the GPU, so none is timed (and none is a warm-up run)."""
        return self.spec.concurrent > 1

    def planned_runs(self) -> int:
        return self.spec.repeats * len(self.arms) + (1 if self.spec.warmup_run and not self.together else 0)

    # --- running -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Warm-up run, then blocks until a stopping rule; the result (also written by :meth:`write`)."""
        start = self.clock()
        if self.together:
            return self._result(self._run_together(start), self.clock() - start)
        progress = runs.Progress(self.planned_runs())
        failed = self._start(0, progress)
        if failed:
            return self._result(failed, self.clock() - start)
        if self.spec.warmup_run:
            self._warm_up(progress)
        stop_reason = None
        while True:
            stop, stop_reason = self._enough()
            if stop:
                break
            stop_reason = self._start(self.blocks, progress)
            if stop_reason:
                break
            block = self.runs_of_block(self.blocks)
            stop_reason = None if self.spec.split_blocks else self._over_budget(block, start)
            if stop_reason:
                break
            self.orders.append([r.arm.name for r in block])
            progress.total = max(progress.total, len(self.statuses) + len(block))
            stop_reason = self._run_block(block, progress, start)
            if stop_reason:
                break
            self.blocks += 1
        if stop_reason:
            say(f"stopped: {stop_reason}")
        return self._result(stop_reason, self.clock() - start)

    def _run_block(self, block: list[runs.Run], progress: runs.Progress, start: float) -> str | None:
        """Each run of the block; with --split-blocks, none starts that would end after --budget
        (the stop reason; the same command resumes the block there). A block that a call resumed
        part-way is named in the results: its runs ran in two calls."""
        earlier = sum(runs.finished_earlier(r.directory, r.arm, r.command) is not None for r in block)
        for i, run in enumerate(block):
            why = self._over_budget([run], start) if self.spec.split_blocks else None
            if why:
                return f"{why}: stopped before run {i + 1} of {len(block)} of the block, which the same command resumes"
            self._execute(run, progress)
        if 0 < earlier < len(block):
            self.across_calls.append(self.blocks + 1)
        return None

    def _run_together(self, start: float) -> str | None:
        """--concurrent K: every block's runs, K at a time, in block order; no batch starts that
        would end after --budget (priced by the batches before it). The stop reason, if any."""
        spec, total = self.spec, self.spec.repeats * len(self.arms)
        todo = [r for b in range(spec.repeats) for r in self.runs_of_block(b)]
        self.orders = [[r.arm.name for r in self.runs_of_block(b)] for b in range(spec.repeats)]
        say(f"--concurrent {spec.concurrent}: {total} runs, {spec.concurrent} at a time, no warm-up run; they "
            "share the GPU, so the result keeps losses and memory but no speed figures")
        port = int(self.environ.get("MASTER_PORT", "29500")) + 1
        reason = None
        reason = self._starts(range(spec.repeats), runs.Progress(spec.repeats, live=False))
        if reason:
            say(f"stopped: {reason}")
            return reason
        for first in range(0, total, spec.concurrent):
            batch = todo[first:first + spec.concurrent]
            reason = self._batch_over_budget(batch, start)
            if reason:
                break
            self.statuses += runs.execute_together(batch, self.environ, port, len(self.statuses), total)
        self.blocks = len(self.statuses) // len(self.arms)
        if reason:
            say(f"stopped: {reason}")
        return reason

    def _batch_over_budget(self, batch: list[runs.Run], start: float) -> str | None:
        """Why a batch of runs at once would not end within --budget: it takes about as long as
        the slowest run of the batches before it (None: it fits, or nothing prices it yet)."""
        budget = self.spec.budget
        to_run = [r for r in batch if runs.finished_earlier(r.directory, r.arm, r.command) is None]
        seconds = runs.run_seconds(self.statuses)
        if budget is None or not to_run or not seconds:
            return None
        used = self.clock() - start
        if used + max(seconds) <= budget * 60:
            return None
        return (f"--budget {budget:g} min: the next {len(to_run)} runs at once (about {max(seconds) / 60:.1f} min) "
                f"would not fit after {used / 60:.1f} min")

    def _start(self, block: int, progress: runs.Progress) -> str | None:
        """--common-start: the seed's start run of ``block``, unless made already (None: made, or no
        common start; else why the experiment stops: the block's runs could not load it)."""
        return self._starts([block], progress)

    def start_run(self, block: int) -> runs.Run:
        """--common-start: the run that saves the start of ``block``'s seed (common_start.py)."""
        seed = (self.spec.block_seeds or 0) + block
        return common_start.start_run(self.out, self.baseline, seed, self.spec.launch, self.spec.script,
                                      set_args(self.args, {"--seed": str(seed)}))

    def _starts(self, blocks: Sequence[int], progress: runs.Progress) -> str | None:
        """The start runs of ``blocks`` not made yet: one at a time, or --concurrent K at a time."""
        todo = [b for b in blocks if b not in self.starts] if self.spec.common_start else []
        if not todo:
            return None
        seeds = {b: (self.spec.block_seeds or 0) + b for b in todo}
        made = [self.start_run(b) for b in todo]
        if self.together:
            port = int(self.environ.get("MASTER_PORT", "29500")) + 1
            k = self.spec.concurrent
            statuses = [s for i in range(0, len(made), k)
                        for s in runs.execute_together(made[i:i + k], self.environ, port, i, len(made))]
        else:
            statuses = [runs.execute(r, self.environ, progress, len(self.statuses) + 1, 0) for r in made]
        self.starts.update(zip(todo, statuses, strict=True))
        failed = [b for b, st in zip(todo, statuses, strict=True) if st.get("status") != "done"]
        if failed:
            return f"the common start of seed {seeds[failed[0]]} failed (log: {self.starts[failed[0]].get('log')})"
        return None

    def _execute(self, run: runs.Run, progress: runs.Progress) -> None:
        index = len(self.statuses) + 1
        self.statuses.append(runs.execute(run, self.environ, progress, index, max(progress.total - index, 0)))

    def _warm_up(self, progress: runs.Progress) -> None:
        """The unmeasured warm-up run; it times the runs still to do, which it says."""
        warm = self.runs_of_block(-1)[0]
        earlier = runs.finished_earlier(warm.directory, warm.arm, warm.command) is not None
        self._execute(warm, progress)
        per_run = self.statuses[-1]["seconds"]
        if self.statuses[-1]["status"] != "done":
            say(f"the warm-up run failed after {per_run:.0f}s: it prices nothing")
            return
        to_do = sum(runs.finished_earlier(r.directory, r.arm, r.command) is None
                    for b in range(self.spec.repeats) for r in self.runs_of_block(b))
        more = (" (--target-ci may add blocks)"
                if self.spec.target_ci is not None and self.spec.max_repeats > self.spec.repeats else "")
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
        width = widest_interval(self._rows())
        if width <= spec.target_ci:
            return True, f"every interval within +-{spec.target_ci * 100:g} % after {self.blocks} blocks"
        if self.blocks >= spec.max_repeats:
            return True, f"--max-repeats {spec.max_repeats} reached (widest interval +-{width * 100:.2f} %)"
        return False, None

    def _over_budget(self, block: list[runs.Run], start: float) -> str | None:
        """Why ``block`` would not end within --budget (None: it would, or nothing prices it).

        A resumed block costs only its runs not done earlier; one with none left costs nothing and
        is never the reason to stop. Priced by this call's finished runs, else (no warm-up run) by
        this block's runs done earlier, else by the caller's prior times."""
        spec = self.spec
        previous = [runs.finished_earlier(r.directory, r.arm, r.command) for r in block]
        to_run = [r for r, done in zip(block, previous, strict=True) if done is None]
        seconds = runs.run_seconds(self.statuses) or runs.run_seconds(previous) or self.prior_seconds
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

    # --- the result ----------------------------------------------------------------------------

    def _gpus(self) -> int | None:
        return world_size(self.statuses, self.baseline.name, self.spec.launch, self.spec.world_size)

    def _rows(self) -> list[dict[str, Any]]:
        seq = self.records[0].get("effective_args", {}).get("seq_length")
        measured = [measure_run(s, self.spec.warmup) for s in self.statuses]
        return compare(self.arms, measured, self.blocks, seq, self._gpus(), self.spec.confidence, self.spec.effect)

    def commands(self) -> dict[str, dict[str, Any]]:
        """Each arm's environment and command (with a candidate's additions), as the results keep them."""
        spec = self.spec
        return {a.name: {"env": a.env(), "argv": runs.arm_command(spec.launch, spec.script, self.args, a),
                         **({"candidate_env": a.added_env(), "candidate_args": a.added_args()} if a.adds else {})}
                for a in self.arms}

    def _result(self, stop_reason: str | None, seconds: float) -> dict[str, Any]:
        spec = self.spec
        planned = dry_run_world(spec.launch, spec.world_size)
        logged = logged_world_size(self.statuses, self.baseline.name)
        if logged is not None and logged != planned:
            say(f"warning: the runs had a world of {logged}, the dry runs planned for {planned}: "
                f"say --world-size {logged}")
        rows = self._rows()
        measured = [measure_run(s, spec.warmup) for s in self.statuses]
        loss = self.loss_test(measured) if spec.loss_test else None
        if loss:
            rows = [{**r, "loss_test": loss["arms"][r["arm"]]} for r in rows]
        speed: dict[str, Any] = {}
        if self.together:
            rows = without_speed(rows)
            speed = {"concurrent": spec.concurrent, "speed_note": f"not measured: {spec.concurrent} runs shared the "
                     "GPU at once, so their step times measure the sharing, not the arms"}
        return {"design": spec.design, "seed": spec.seed, "repeats": spec.repeats, "blocks_run": self.blocks,
                "block_seeds": self.seeds(), "loss_window": spec.loss_window,
                "common_start": {str(b): s for b, s in self.starts.items()} if spec.common_start else None,
                "loss_test": None if loss is None else loss["settings"], **speed,
                "blocks_across_calls": self.across_calls,
                "block_order": self.orders, "world_size": self._gpus(), "planned_world_size": planned,
                "warmup_run": self._warmed(), "iters": self.iters, "warmup": spec.warmup,
                "confidence": spec.confidence, "target_ci": spec.target_ci, "budget_min": spec.budget,
                "stop_reason": stop_reason, "derived": {n: sorted(k) for n, k in self.derived.items()},
                "rows": rows, "sizing": None if self.together else sizing(rows, spec.effect, spec.confidence),
                "runs": measured, "commands": self.commands(),
                "seconds": seconds}

    def _warmed(self) -> bool:
        """Whether an unmeasured warm-up run finished before the blocks: this call's, or an earlier
        call's of the same ``--out`` (a resumed call with ``--no-warmup-run``); a failed one is not."""
        if self.together:
            return False
        warm = self.runs_of_block(-1)[0]
        return runs.finished_earlier(warm.directory, warm.arm, warm.command) is not None

    def loss_test(self, measured: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The loss test over the finished runs (loss_test.py), with the spec's measure, margin and level."""
        spec = self.spec
        return compare_losses(self.arms, measured, self.blocks, measure=spec.loss_measure, window=spec.loss_window,
                              margin=spec.loss_margin, alpha=spec.loss_alpha, seeds=self.seeds(),
                              common_start=spec.common_start)

    def write(self, result: dict[str, Any]) -> None:
        """results.json, results.md (and a plot where matplotlib is at hand) under ``out``."""
        write_results(self.out, result, self.records)
