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

With ``--with PART ... --out DIR`` it pools one experiment's seeds run over several sessions
(loss/pool.py: each session a part, with later --block-seeds): the loss test over every seed and
each part's own, written to DIR, from the parts' results.json alone. A pooled DIR re-analyses in
place, and pools again with the next session's part.

    python -m megatron_perf_toggles.tools.ablate.reanalyse OUT --with OUT2 [OUT3 ...] --out POOLED [--loss-margin 0.5]
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._version import __version__
from ...core.registry import TOGGLES
from ...errors import OneLineArgumentParser, PerfTogglesError, fail
from .design import Arm, DesignError
from .execution import measure
from .loss import pool
from .loss.equivalence import equivalent, seeds_to_fit
from .loss.loss_test import compare_losses
from .report import interval_text, loss_markdown_lines, loss_of, markdown, verdict_lines
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


# --- pooling the parts of one experiment ----------------------------------------------------------


def pooled_there(out: Path) -> dict[str, Any] | None:
    """The pooled result ``out`` holds (None: none there, or not a pooled one)."""
    try:
        there = json.loads((out / pool.RESULTS).read_text())
    except (OSError, ValueError):
        return None
    return there if isinstance(there, dict) and there.get("pool") else None


def is_pooled(out: Path) -> bool:
    """Whether ``out`` holds a pooled result (re-analysed by pooling its parts again)."""
    return pooled_there(out) is not None


def check_into(into: Path, parts: Sequence[pool.Part]) -> None:
    """The pooled result goes to a directory of its own and loses no seed there: never over an
    ablate run's own results, nor over a pool holding a seed these parts do not."""
    if not (into / pool.RESULTS).exists():
        return
    there = pooled_there(into)
    if there is None:
        raise DesignError(f"--out {into} holds a results.json that is not a pooled one, which pooling would overwrite",
                          "give the pooled result a directory of its own")
    lost = sorted(set(there.get("block_seeds") or []) - {s for p in parts for s in p.seeds})
    if lost:
        raise DesignError(f"--out {into} holds a pool with seeds {pool.seed_words(lost)} these parts do not: "
                          "pooling there would drop them", f"pool onto it: {into} --with PART ... --out DIR")


def pooled(given: Sequence[str], into: Path, spec: ExperimentSpec) -> dict[str, Any]:
    """The parts ``given`` pooled: the loss test over every seed, each part's own in its record
    (at the pooled test's measure, so that they compare), and where the seeds ran."""
    parts = pool.read_parts(given)
    pool.check_one_experiment(parts)
    check_into(into, parts)
    result = pool.pooled(parts, pool.loss_window(parts, spec.loss_window))
    loss = loss_test_of(result, spec)
    alike = dataclasses.replace(spec, loss_measure=loss["settings"]["measure"])
    records = [{**rec, "loss_test": loss_test_of(part.result, alike)["arms"]}
               for rec, part in zip(result["pool"]["parts"], parts, strict=True)]
    rows = [{**row, "loss_test": loss["arms"][row["arm"]]} for row in result["rows"]]
    return {**result, "rows": rows, "loss_test": loss["settings"],
            "pool": {"parts": records, "where": pool.where_summary(parts), "by": __version__}}


def fit_line(name: str, e: Mapping[str, Any]) -> str | None:
    """Where an arm's interval is not yet inside the margin: the seeds at which it would be, at the
    mean and spread measured so far (equivalence.seeds_to_fit), or that none would do."""
    if "verdict" not in e or e["verdict"] == equivalent(e["margin"]) or e.get("sd") is None:
        return None
    paired = bool(e.get("paired"))
    sd = e["sd"] if paired else e["sd"] * math.sqrt(2.0)  # unpaired: a difference of two runs, seeds per arm
    need, have, margin = seeds_to_fit(e["estimate"], sd, e["margin"], e["alpha"]), e["seeds_compared"], e["margin"]
    head = f"{e['toggle']} ({name}): "
    if need is None:
        return head + (f"+-{margin:g} % cannot be reached: the mean difference, {e['estimate']:+.2f} %, "
                       "is not inside it")
    per = "" if paired else " per arm"
    return head + (f"the interval would fit inside +-{margin:g} % from about {need} seeds{per} "
                   f"({max(0, need - have)} more than the {have} so far), at the mean difference "
                   f"({e['estimate']:+.2f} %) and spread (sd {sd:.2f} %) measured so far")


def fit_lines(loss: Mapping[str, Any] | None) -> list[str]:
    return [line for n, e in ((loss or {}).get("arms") or {}).items() if (line := fit_line(n, e))]


def part_lines(result: Mapping[str, Any]) -> list[str]:
    """Each part's own verdict per arm, in a line: whether the parts agree."""
    out = []
    for part in result["pool"]["parts"]:
        head = f"part {part['source']} ({pool.seed_words(part['seeds'])}, {pool.gpu_words(part['where'])})"
        out += [f"{head}: {e['toggle']} ({n}): {interval_text(e)}, {e.get('seeds_compared', 0)} seeds: {e['verdict']}"
                for n, e in part["loss_test"].items() if "verdict" in e]
    return out


def pooled_markdown(result: Mapping[str, Any]) -> str:
    """The pooled report: where the seeds ran, the loss test over all of them (report.py's table),
    the seeds the margin still needs, and each part's own test."""
    parts, seeds = result["pool"]["parts"], result["block_seeds"]
    lines = [f"# Pooled loss test ({result.get('design')}): {len(seeds)} seeds from {len(parts)} parts", "",
             f"Seeds {pool.seed_words(seeds)}: {result['pool']['where']}. Each seed's arms ran in one part, on one "
             "card: the pairs are within a seed and a card, so what a card or its software does to every arm alike "
             "cancels in each seed's difference. The parts' own tests, at the end, show whether they agree.", "",
             "| part | seeds | card | software |", "|---|---|---|---|"]
    lines += [f"| {p['source']} | {pool.seed_words(p['seeds'])} | {pool.gpu_words(p['where'])} "
              f"| {pool.stack_words(p['where'])} |" for p in parts]
    loss = loss_of(result)
    lines += loss_markdown_lines(loss)
    fits = fit_lines(loss)
    if fits:
        lines += ["", "Seeds to reach the margin at the mean and spread measured so far:", "", *(f"- {f}" for f in fits)]
    lines += ["", "## Each part alone", "", *(f"- {line}" for line in part_lines(result))]
    return "\n".join(lines).rstrip() + "\n"


def pool_into(given: Sequence[str], into: Path, spec: ExperimentSpec) -> list[str]:
    """Pool, write results.json and results.md under ``into``; the lines to print."""
    result = pooled(given, into, spec)
    into.mkdir(parents=True, exist_ok=True)
    (into / pool.RESULTS).write_text(json.dumps(result, indent=1, default=str) + "\n")
    (into / "results.md").write_text(pooled_markdown(result))
    s = result["loss_test"]
    loss = loss_of(result)
    return [f"pooled {len(result['block_seeds'])} seeds of {len(result['pool']['parts'])} parts "
            f"({result['pool']['where']}) into {into}: loss test on {s['measure']}, margin +-{s['margin']:g} %, "
            f"{s['interval'] * 100:g} % intervals ({shlex.quote(str(into / 'results.md'))})",
            *(f"loss: {line}" for line in verdict_lines(loss)), *(f"loss: {line}" for line in part_lines(result)),
            *(f"seeds: {line}" for line in fit_lines(loss))]


# --- the command -----------------------------------------------------------------------------------


def reanalysed_in_place(out: Path, spec: ExperimentSpec) -> list[str]:
    """Re-analyse ``out`` and rewrite its results (the first kept once); the lines to print."""
    result = reanalyse(out, spec)
    backup = out / "results.before-reanalysis.json"
    if not backup.exists():
        backup.write_text((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(result))
    settings = result["loss_test"]
    return [f"re-analysed {out}: loss test on {settings['measure']}, margin +-{settings['margin']:g} %, "
            f"{settings['interval'] * 100:g} % intervals ({shlex.quote(str(out / 'results.md'))})",
            *(f"loss: {line}" for line in verdict_lines(
                {"settings": settings, "arms": {r["arm"]: r["loss_test"] for r in result["rows"]}}))]


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineArgumentParser(prog="python -m megatron_perf_toggles.tools.ablate.reanalyse",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("out", help="an ablate --out directory (with results.json and runs/), or a pooled one")
    p.add_argument("--with", dest="parts", nargs="+", metavar="PART",
                   help="pool OUT with these parts of the same experiment (--out directories or their "
                   "results.json, each session's seeds its own) into --out")
    p.add_argument("--out", dest="into", metavar="DIR", help="with --with: where the pooled results go")
    ExperimentSpec.add_options(p, LOSS_OPTIONS)
    try:
        ns = p.parse_args(argv)
    except PerfTogglesError as error:
        fail(error)
    try:
        spec = ExperimentSpec(**{k: getattr(ns, k) for k in LOSS_OPTIONS})
        spec.check_options()
        out = Path(ns.out)
        if (ns.parts is None) != (ns.into is None):
            raise DesignError("--with and --out go together", "pool with: OUT --with PART ... --out DIR")
        if ns.parts is not None or is_pooled(out):
            lines = pool_into([ns.out, *(ns.parts or [])], Path(ns.into) if ns.into else out, spec)
        else:
            lines = reanalysed_in_place(out, spec)
    except PerfTogglesError as error:
        fail(error)
    except OSError as error:
        fail(PerfTogglesError(f"{ns.into or ns.out}: cannot write the re-analysis ({error.strerror or error})"))
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        which = "a part's results.json" if ns.parts else f"{ns.out}/results.json"
        fail(PerfTogglesError(f"{which} is not an ablate result ({type(error).__name__}: {error})"))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
