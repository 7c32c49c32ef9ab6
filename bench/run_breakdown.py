"""Where a run's seconds go: each finished ablate run's wall time split into phases, from the
timestamps Megatron prints in its log and the run's total time in its status.json.

    python bench/run_breakdown.py DIR            # DIR: an ablate --out (its runs/*/*/) or a copy of it

Phases: start-up (the interpreter, imports of torch, Transformer Engine, Megatron and the plugin,
argument parsing and the plugin's plan, up to Megatron's first timestamp), library set-up,
Megatron's initialisation (distributed, compile of helpers), model and optimizer (a checkpoint
load included), data loaders, the first two iterations (warm-up: kernel selection, allocator
growth) and the remaining iterations; start-up and exit together (the log stamps neither).
Prints the median of each phase over the runs, and
the share of the total.
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


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    rows = []
    for status in sorted(Path(argv[0]).glob("runs/*/*/status.json")):
        data = json.loads(status.read_text())
        log = status.with_name("log.txt")
        if data.get("status") != "done" or not log.is_file():
            continue
        got = phases(log.read_text(errors="replace"), float(data["seconds"]))
        if got:
            rows.append((data.get("label") or status.parent.name, float(data["seconds"]), got))
    if not rows:
        print(f"no finished run with Megatron's timestamps under {argv[0]}/runs")
        return 1
    total = statistics.median(r[1] for r in rows)
    print(f"{len(rows)} runs; median total {total:.1f} s")
    for phase in PHASES:
        med = statistics.median(r[2][phase] for r in rows)
        print(f"  {phase:<22} {med:6.1f} s  {100 * med / total:5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
