"""Re-analyse an existing ``ablate --out`` directory without running or resolving anything.

The loss test can be asked again with another margin, level or measure, and results written by an
earlier version of ablate (their per-run logs and ``results.json``) get today's loss test: every
run's log is read again (the validation loss too), and ``results.json`` and ``results.md`` are
rewritten, the first ``results.json`` kept once as ``results.before-reanalysis.json``. Running the
same ``ablate`` command again does this too (it skips finished runs), but needs the Megatron
checkout its dry runs resolve arms through; this needs only the directory. It is the experiment's
pipeline from its end: the runs measured again (stage 5's reading), the loss test (stage 6's),
the report (stage 7's).

    python -m megatron_perf_toggles.tools.ablate.reanalyse OUT [--loss-margin 0.5] [--loss-measure validation]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...core.registry import TOGGLES
from ...errors import PerfTogglesError, fail
from .design import Arm, DesignError
from .execution import measure
from .loss.loss_test import compare_losses
from .report import markdown, verdict_lines
from .runs import run_dir
from .spec import ExperimentSpec

LOSS_OPTIONS = ("loss_window", "loss_measure", "loss_margin", "loss_alpha")
BY_ENV = {t.env: t.dest for t in TOGGLES if t.kind == "bool"}


def arms_of(result: Mapping[str, Any]) -> list[Arm]:
    """The arms as the results recorded them: each arm's toggle variables, and a candidate's additions."""
    base = next((r["arm"] for r in result["rows"] if r.get("baseline")), None)
    arms = []
    for name, command in result["commands"].items():
        toggles = {BY_ENV[k]: v == "1" for k, v in command.get("env", {}).items() if k in BY_ENV}
        words = [f"{k}={v}" for k, v in command.get("candidate_env", {}).items()] + command.get("candidate_args", [])
        adds = {name.lstrip("+"): tuple(words)} if "candidate_args" in command else {}
        arms.append(Arm(name, toggles, baseline=name == base, adds=adds))
    return arms


def _log_of(out: Path, run: Mapping[str, Any], arms: Sequence[Arm]) -> str | None:
    """The run's log: where it was written, else where ablate puts it under ``out`` (a directory
    copied from the machine that ran it)."""
    if run.get("log") and Path(run["log"]).is_file():
        return str(run["log"])
    arm = next((a for a in arms if a.name == run.get("arm")), None)
    here = run_dir(out, arm, run.get("block", -1)) / "log.txt" if arm else None
    return str(here) if here is not None and here.is_file() else None


def loss_test_of(result: Mapping[str, Any], spec: ExperimentSpec | None = None,
                 runs: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The loss test of recorded results, computed again from their runs (``runs``: the runs as
    measured again; default: as recorded), with ``spec``'s loss options (default: ablate's; the
    window, where not given, the one the results recorded)."""
    spec = spec or ExperimentSpec()
    arms = arms_of(result)
    if not arms or not any(a.baseline for a in arms):
        raise DesignError("the results record no arms or no baseline")
    window = spec.loss_window if spec.loss_window is not None else result.get("loss_window")
    return compare_losses(arms, result["runs"] if runs is None else runs, result["blocks_run"],
                          measure=spec.loss_measure, window=window, margin=spec.loss_margin, alpha=spec.loss_alpha,
                          seeds=result.get("block_seeds"), common_start=bool(result.get("common_start")))


def reanalyse(out: Path, spec: ExperimentSpec) -> dict[str, Any]:
    """``out``'s results with today's loss test (and its runs' logs read again where they are)."""
    try:
        result = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as error:
        raise DesignError(f"{out}: no readable results.json ({error})",
                          "give the --out directory of an ablate run") from None
    arms = arms_of(result)
    runs = []
    for run in result["runs"]:
        log = _log_of(out, run, arms)
        runs.append(measure({**run, "log": log}, result.get("warmup", 3))[0] if log else run)
    loss = loss_test_of(result, spec, runs)
    window = spec.loss_window if spec.loss_window is not None else result.get("loss_window")
    rows = []
    for row in result["rows"]:
        kept = {k: v for k, v in row.items() if k != "loss_window"}  # an earlier version's band verdict
        if kept.get("loss"):
            kept["loss"] = {k: v for k, v in kept["loss"].items() if "noise_band" not in k}
        rows.append({**kept, "loss_test": loss["arms"][row["arm"]]})
    return {**result, "rows": rows, "runs": runs, "loss_window": window, "loss_test": loss["settings"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_perf_toggles.tools.ablate.reanalyse",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("out", help="an ablate --out directory (with results.json and runs/)")
    ExperimentSpec.add_options(p, LOSS_OPTIONS)
    ns = p.parse_args(argv)
    try:
        spec = ExperimentSpec(**{k: getattr(ns, k) for k in LOSS_OPTIONS})
        spec.check_options()
        out = Path(ns.out)
        result = reanalyse(out, spec)
        backup = out / "results.before-reanalysis.json"
        if not backup.exists():
            backup.write_text((out / "results.json").read_text())
        (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        (out / "results.md").write_text(markdown(result))
    except PerfTogglesError as error:
        fail(error)
    except OSError as error:
        fail(PerfTogglesError(f"{ns.out}: cannot write the re-analysis ({error.strerror or error})"))
    except (KeyError, TypeError, AttributeError) as error:
        fail(PerfTogglesError(f"{ns.out}/results.json is not an ablate result ({type(error).__name__}: {error})"))
    settings = result["loss_test"]
    print(f"re-analysed {out}: loss test on {settings['measure']}, margin +-{settings['margin']:g} %, "
          f"{settings['interval'] * 100:g} % intervals ({shlex.quote(str(out / 'results.md'))})")
    for line in verdict_lines({"settings": settings, "arms": {r["arm"]: r["loss_test"] for r in result["rows"]}}):
        print(f"loss: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
