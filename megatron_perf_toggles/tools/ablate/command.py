"""``megatron-perf-toggles ablate``: controlled toggle experiments that cannot be confounded.

The command is the experiment's pipeline, one stage after the other, each handing the next its
value and none calling back:

1. ``spec.checked``: the options to a checked spec (a toggle a guard turns off for this model left out);
2. ``design.designed``: the spec to its arms;
3. ``runs.resolved``: the arms to runs, each arm resolved through Megatron's dry run once and
   checked for confounds, each run's command and environment;
4. ``schedule.scheduled``: the runs to a schedule (blocks, seeds, runs at once, budget, resume),
   which ``--dry-run`` prints and stops at;
5. ``execution.executed``: the schedule carried out, each run's log parsed once into its measurement;
6. ``analysis.analysed``: the measurements to speed intervals, the loss test and sizing;
7. ``report.reported``: results.json, results.md and the plot.

Its shared options are :class:`~.spec.ExperimentSpec`'s; the design's own are declared here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import PerfTogglesError, fail
from . import analysis, design, execution, report, runs, schedule, spec
from .design import DESIGNS, OTHERS
from .spec import POSITIONALS, SHARED, ExperimentSpec

DESCRIPTION = (
    "Run a controlled toggle experiment: every arm is resolved through Megatron's real "
    "parser first, and the run is refused if arms differ in anything but the intended variables. "
    "Arms run in blocks (each block every arm once, in a seeded shuffled order) after one unmeasured "
    "warm-up run; each arm is compared with the baseline block by block, with a confidence interval.")
EPILOG = ("example: megatron-perf-toggles ablate --design factorial --toggles grad_reduce_in_bf16 "
          "--vary adam_eps=1e-8,1e-5 --out runs/2x2 -- pretrain_gpt.py <megatron args>")
STOPPING = ("effect", "target_ci", "max_repeats")  # ablate's own fields of the spec
LOSS = ("block_seeds", "loss_window", "loss_measure", "loss_margin", "loss_alpha", "common_start", "concurrent",
        "split_blocks")  # ablate's loss and resume fields


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``ablate`` options, for :func:`main`'s parser and the ``megatron-perf-toggles ablate`` subcommand."""
    p.add_argument("--design", required=True, choices=DESIGNS,
                   help="one-at-a-time: all off, then each alone; leave-one-out: all on, then each off; "
                   "factorial: every combination (with --vary settings); headline: all off against all on; "
                   "each-alone: all off (stock), each toggle alone, and the plugin defaults (every toggle, those "
                   "not named in --toggles too) in the same blocks; "
                   "candidates: the command as given against each --candidate's additions")
    p.add_argument("--others", choices=OTHERS, default="inherit",
                   help="toggles not taking part: inherit the environment / plugin default (default), or pin "
                   "them off or on in every arm")
    p.add_argument("--vary", action="append", metavar="NAME=V1,V2", help="a Megatron setting to vary (factorial)")
    p.add_argument("--candidate", action="append", metavar="NAME='[VAR=value ...] ARGS'",
                   help="with --design candidates: an arm that adds these Megatron arguments to the common "
                   "ones, and sets the environment variables written before them (repeat for more arms), "
                   "compared with the command as given, e.g. --candidate overlap='--overlap-grad-reduce "
                   "--overlap-param-gather' --candidate alloc='PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True'")
    p.add_argument("--dry-run", action="store_true",
                   help="check confounds, print arms, block order and commands; run and write nothing")
    ExperimentSpec.add_options(p, (*SHARED, *STOPPING, *LOSS, *POSITIONALS), {"out": "ablation"})


def build_ablate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-perf-toggles ablate", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None, resolver: Callable[..., dict[str, Any]] = runs.resolve_arm,
         clock: Callable[[], float] = time.monotonic) -> int:
    return run_ablation(build_ablate_parser().parse_args(list(sys.argv[1:] if argv is None else argv)), resolver, clock)


def run_ablation(ns: argparse.Namespace, resolver: Callable[..., dict[str, Any]] = runs.resolve_arm,
                 clock: Callable[[], float] = time.monotonic) -> int:
    """The experiment the parsed options ask for (``main``'s body; also the cli subcommand's): every
    check a run must pass before the first GPU minute is spent, then the runs. ``resolver`` (the dry
    run of one arm) and ``clock`` are stand-ins in tests."""
    try:
        checked = spec.checked(ns)
        arms = design.designed(checked)
        resolved = runs.resolved(checked, arms, dict(os.environ), resolver, say=execution.say)
        planned = schedule.scheduled(resolved, say=execution.say)
        if checked.dry_run:
            print("\n".join(schedule.dry_run_lines(planned)))
            return 0
        measured = execution.executed(planned, clock)
        analysed = analysis.analysed(measured)
        result = report.reported(analysed)
        return 1 if any(r.get("status") == "failed" for r in result["runs"]) else 0
    except PerfTogglesError as error:
        fail(error)
