"""Where a run's seconds go: each finished ablate run's wall time split into phases, from the
timestamps Megatron prints in its log and the run's total time in its status.json.

    python bench/run_breakdown.py DIR            # DIR: an ablate --out (its runs/*/*/) or a copy of it

Phases: start-up (the interpreter, imports of torch, Transformer Engine, Megatron and the plugin,
argument parsing and the plugin's plan, up to Megatron's first timestamp), library set-up,
Megatron's initialisation (distributed, compile of helpers), model and optimizer (a checkpoint
load included), data loaders, the first two iterations (warm-up: kernel selection, allocator
growth) and the remaining iterations; start-up and exit together (the log stamps neither).
Prints, for each arm (a common start's runs apart: they train one iteration and save; warm-up runs
apart too, as "warm-up (ARM)"), the number
of runs, the median total and the median of each phase; ``--json FILE`` also writes every run's
phases and the medians, so that a before and an after can be committed and set side by side.

    python bench/run_breakdown.py DIR [--json FILE]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

MARKS = [("library", r"\[before library-setup\] datetime: (\S+ \S+)"),
         ("init", r"\[before megatron-init\] datetime: (\S+ \S+)"),
         ("model", r"\[after megatron is initialized\] datetime: (\S+ \S+)"),
         ("data", r"\[after model, optimizer, and learning rate scheduler are built\] datetime: (\S+ \S+)"),
         ("train", r"\[before the start of training step\] datetime: (\S+ \S+)")]
ITERATION = re.compile(r"\[(\S+ \S+)\] iteration\s+(\d+)/\s*(\d+)")
PHASES = ("start-up and exit", "library set-up", "Megatron init", "model and optimizer", "data loaders",
          "iterations 1-2", "iterations 3-N")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.strip())


def phases(log: str, total_s: float) -> dict[str, float] | None:
    """The phases of one run, in seconds (None where the log lacks a mark)."""
    marks = {}
    for name, pattern in MARKS:
        found = re.search(pattern, log)
        if not found:
            return None
        marks[name] = _time(found.group(1))
    its = [(int(m.group(2)), _time(m.group(1))) for m in ITERATION.finditer(log)]
    later = [t for i, t in its if i >= 2]  # the first logged iteration after the first (--log-interval may skip)
    if len(its) < 3 or not later:
        return None
    second, last = later[0], its[-1][1]
    return {"start-up and exit": total_s - (last - marks["library"]).total_seconds(),  # the log stamps neither
            "library set-up": (marks["init"] - marks["library"]).total_seconds(),
            "Megatron init": (marks["model"] - marks["init"]).total_seconds(),
            "model and optimizer": (marks["data"] - marks["model"]).total_seconds(),
            "data loaders": (marks["train"] - marks["data"]).total_seconds(),
            "iterations 1-2": (second - marks["train"]).total_seconds(),
            "iterations 3-N": (last - second).total_seconds()}


def runs_of(directory: Path) -> list[dict]:
    """Every finished run under ``directory``'s runs/ (the warm-up and start runs too): its arm, label,
    total seconds and phases (None where the log lacks Megatron's marks, as a start run's may)."""
    out = []
    for status in sorted(directory.glob("runs/*/*/status.json")):
        data = json.loads(status.read_text())
        log = status.with_name("log.txt")
        if data.get("status") != "done" or not log.is_file():
            continue
        seconds = float(data["seconds"])
        arm = data.get("arm") or status.parent.name
        if isinstance(data.get("block"), int) and data["block"] < 0:  # a warm-up run: never an arm's median
            arm = f"warm-up ({arm})"
        out.append({"arm": arm, "label": data.get("label") or status.parent.name,
                    "block": data.get("block"), "seconds": round(seconds, 2),
                    "phases": phases(log.read_text(errors="replace"), seconds)})
    return out


def by_arm(runs: list[dict]) -> dict[str, dict]:
    """Per arm: how many runs, the median total and the median of each phase (over the runs with phases)."""
    out: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm]
        timed = [r["phases"] for r in mine if r["phases"]]
        out[arm] = {"runs": len(mine), "median_s": round(statistics.median(r["seconds"] for r in mine), 1),
                    "phases_median_s": {ph: round(statistics.median(t[ph] for t in timed), 1) for ph in PHASES}
                    if timed else None}
    return out


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="an ablate --out directory (its runs/*/*/), or a copy of it")
    ap.add_argument("--json", metavar="FILE", type=Path, help="also write every run's phases and the medians here")
    ns = ap.parse_args(argv)
    runs = runs_of(Path(ns.dir))
    if not any(r["phases"] for r in runs):
        print(f"no finished run with Megatron's timestamps under {ns.dir}/runs")
        return 1
    arms = by_arm(runs)
    for arm, row in arms.items():
        print(f"{arm}: {row['runs']} runs, median total {row['median_s']:.1f} s")
        for phase, med in (row["phases_median_s"] or {}).items():
            print(f"  {phase:<22} {med:6.1f} s  {100 * med / row['median_s']:5.1f} %")
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"source": ns.dir, "by_arm": arms, "runs": runs}, indent=1) + "\n")
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
