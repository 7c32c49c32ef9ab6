"""``megatron-perf-toggles tune``: the options (the shared ones are :class:`ExperimentSpec`'s) and
the command, which runs the phases and writes the profile."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...errors import PerfTogglesError, fail
from ..ablate.design import DEFAULT_TOGGLES, Arm, DesignError
from ..ablate.runs import check_launcher, check_out, resolve_arm
from ..ablate.spec import POSITIONALS, SHARED, ExperimentSpec
from .output import write_profile
from .phases import Setup, runs_environ, tune
from .rule import DEFAULT_MAX_FACTORIAL, say

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
    ExperimentSpec.add_options(p, SHARED, {"out": "tune"})
    p.add_argument("--max-factorial", type=int, default=DEFAULT_MAX_FACTORIAL, metavar="N",
                   help=f"most unresolved toggles the factorial takes, 2^N arms (default {DEFAULT_MAX_FACTORIAL}); "
                   "with more, they stay on")
    p.add_argument("--memory-limit-gb", type=float, metavar="GB",
                   help="keep the choices' peak allocated memory per GPU (measured in leave-one-out) within this "
                   "many GB (of 1024 MB): while above it, the toggle whose removal saves most is turned off")
    ExperimentSpec.add_options(p, POSITIONALS)


def build_tune_parser() -> argparse.ArgumentParser:
    from ...errors import OneLineArgumentParser

    p = OneLineArgumentParser(prog="megatron-perf-toggles tune", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


def prepared(ns: argparse.Namespace) -> ExperimentSpec:
    """Every check before the first dry run; the experiment's spec."""
    spec = ExperimentSpec.from_options(ns)
    spec.check()
    if ns.memory_limit_gb is not None and not ns.memory_limit_gb > 0:
        raise DesignError(f"--memory-limit-gb {ns.memory_limit_gb:g}: a positive number of GB per GPU")
    if not 1 <= ns.max_factorial <= 5:
        raise DesignError(f"--max-factorial {ns.max_factorial}: between 1 and 5 (2 to 32 arms a block)")
    check_out(Path(spec.out))
    # tune's runs set every on/off toggle's variable (those taking part, and the others pinned)
    check_launcher(spec, [Arm("every toggle", dict.fromkeys(DEFAULT_TOGGLES, True))])
    return spec


def run_tune(ns: argparse.Namespace, resolver: Callable[..., dict[str, Any]] = resolve_arm,
             clock: Callable[[], float] = time.monotonic) -> int:
    """The command: every phase, then the profile. Exit 0, 1 where a run failed (the profile is
    still written, from the runs that finished, unless the baseline never finished), 2 for bad
    input or a confound."""
    try:
        spec = prepared(ns)
        setup = Setup(spec, runs_environ(os.environ), resolver, clock, clock(), spec.world_words, ns.max_factorial,
                      ns.memory_limit_gb)
        profile, excluded, results = tune(setup)
        path = write_profile(Path(spec.out), profile, excluded, results)
    except PerfTogglesError as error:
        fail(error)
    print((Path(spec.out) / "profile.md").read_text())
    say(f"wrote {path} (and profile.md beside it); use it with MEGATRON_PERF_TOGGLES_PROFILE={path}")
    failed = any(r.get("status") == "failed" for res in results.values() for r in res["runs"])
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None, resolver: Callable[..., dict[str, Any]] = resolve_arm,
         clock: Callable[[], float] = time.monotonic) -> int:
    try:
        ns = build_tune_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except PerfTogglesError as error:
        fail(error)
    return run_tune(ns, resolver, clock)


if __name__ == "__main__":
    raise SystemExit(main())
