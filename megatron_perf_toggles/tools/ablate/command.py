"""``megatron-perf-toggles ablate``: controlled toggle experiments that cannot be confounded.

The command is a caller of :class:`~.experiment.Experiment`: it expands the design into arms
(design.py), leaves out toggles a guard turns off for this model (guarded.py), checks every arm
for confounds, then runs the blocks or, with ``--dry-run``, prints them. Its shared options are
:class:`~.spec.ExperimentSpec`'s; the design's own are declared here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...errors import PerfTogglesError, fail
from .argv import repeated_flags
from .confounds import dry_run_world, planned_for, resolve_arm
from .design import DESIGNS, OTHERS, Arm, expand, parse_candidates, parse_toggles, parse_vary
from .experiment import Experiment, say
from .runs import check_launcher, check_out
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


def main(argv: Sequence[str] | None = None, resolver: Callable[..., dict[str, Any]] = resolve_arm,
         clock: Callable[[], float] = time.monotonic) -> int:
    return run_ablation(build_ablate_parser().parse_args(list(sys.argv[1:] if argv is None else argv)), resolver, clock)


def run_ablation(ns: argparse.Namespace, resolver: Callable[..., dict[str, Any]] = resolve_arm,
                 clock: Callable[[], float] = time.monotonic) -> int:
    """The experiment the parsed options ask for (``main``'s body; also the cli subcommand's):
    every check a run must pass before the first GPU minute is spent, then the runs."""
    try:
        spec = ExperimentSpec.from_options(ns)
        spec.check()
        arms = design_arms(ns, spec)
        if not ns.dry_run:
            check_out(Path(spec.out))
        experiment = checked_experiment(spec, arms, resolver, clock)
        if ns.dry_run:
            print_dry_run(experiment)
            return 0
        result = experiment.run()
        experiment.write(result)
        return 1 if any(r.get("status") == "failed" for r in result["runs"]) else 0
    except PerfTogglesError as error:
        fail(error)


def design_arms(ns: argparse.Namespace, spec: ExperimentSpec) -> list[Arm]:
    """The design's arms; a toggle a guard turns off for this model can be on in no arm, so it is
    left out before any dry run (the candidates design names no toggles)."""
    dests, flags = _known_args()
    toggles = parse_toggles(spec.toggles, spec.megatron_args)
    rest: tuple[str, ...] | None = None
    if ns.design != "candidates":
        from .guarded import leave_out

        # each-alone's defaults arm turns on the toggles not named too: those a guard turns off are
        # left out of it as well (pinned off in every arm)
        named = (tuple(dict.fromkeys((*toggles, *parse_toggles(None, spec.megatron_args))))
                 if ns.design == "each-alone" else toggles)
        kept = leave_out(named, spec.script, spec.megatron_args, dry_run_world(spec.launch, spec.world_size),
                         say=lambda line: print(line, file=sys.stderr, flush=True))
        rest = tuple(d for d in kept if d not in toggles)
        toggles = tuple(d for d in toggles if d in kept)
    return expand(ns.design, toggles, parse_vary(ns.vary, dests), ns.others, parse_candidates(ns.candidate, flags),
                  rest=rest if ns.design == "each-alone" else None)


def checked_experiment(spec: ExperimentSpec, arms: list[Arm], resolver: Callable[..., dict[str, Any]],
                       clock: Callable[[], float]) -> Experiment:
    """The experiment, its arms resolved and checked for confounds, its launcher checked."""
    repeated = repeated_flags(spec.megatron_args)
    if repeated:
        say(f"note: given more than once (Megatron takes the last): {', '.join(repeated)}")
    resolver, world = planned_for(resolver, spec.launch, spec.world_size)
    experiment = Experiment(spec, arms, Path(spec.out), dict(os.environ), resolver, clock)
    say(f"{len(arms)} arms ({spec.design}); resolving each through Megatron's parser and validate_args, "
        f"for {world}...")
    experiment.check()
    explained = {n: sorted(k) for n, k in experiment.derived.items() if k}
    say("confound check passed: arms differ only in " + ", ".join(sorted({n for a in arms for n in a.intended()}))
        + (" and what they derive: " + "; ".join(f"{n} -> {', '.join(k)}" for n, k in explained.items())
           if explained else ""))
    check_launcher(spec.launch, spec.script, experiment.args, arms)
    warm = "1 unmeasured warm-up run, then " if spec.warmup_run and spec.concurrent == 1 else ""
    say(f"{experiment.planned_runs()} runs: {warm}{spec.repeats} block(s) x {len(arms)} arms (seed {spec.seed}); "
        f"{experiment.iters} iterations per run, the first {spec.warmup} left out of the medians")
    return experiment


def print_dry_run(experiment: Experiment) -> None:
    """--dry-run: each block's order, (with --common-start) the run that saves block 1's start, then
    each arm's environment and command."""
    for b in range(experiment.spec.repeats):
        print(f"block {b + 1}: " + ", ".join(r.arm.name for r in experiment.runs_of_block(b)))
    if experiment.spec.common_start:
        start = experiment.start_run(0)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in start.arm.env().items())
        print(f"common start of block 1 (the baseline, one iteration, saved):\n  {env} {shlex.join(start.command)}")
    for run in experiment.runs_of_block(0):
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run.arm.env().items())
        print(f"{run.arm.name}{' (baseline)' if run.arm.baseline else ''}:\n  {env} {shlex.join(run.command)}")


def _known_args() -> tuple[set[str] | None, set[str] | None]:
    """Megatron's argument dests and flags (``--no-...`` switches store into a dest of another
    name), from the recorded main surface: catches typos before any run."""
    from ...runtime import surface_replay as replay

    try:
        actions = replay.load_surface("main")["actions"]
    except Exception:  # noqa: BLE001 - without the record, Megatron's parser reports unknown flags
        return None, None
    return {a["dest"] for a in actions}, {f for a in actions for f in a["flags"]}
