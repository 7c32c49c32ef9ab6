"""Parse Megatron-LM's own training log lines (every supported version) into numbers.

One reader for every tool that reads a run's log: ``ablate`` measures each run with it once, and
the GPU benchmarks read their runs with it.

Megatron prints one ``iteration N/M | key: value | ...`` line per log interval and a
``[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated: ...`` line once, and
with ``--eval-iters`` > 0 a `` validation loss at iteration N | lm loss value: X | lm loss PPL: Y |``
line per evaluation (``... on validation set`` after the last iteration; ``... on test set`` is
the test split, and ``validation-NAME`` one of several validation sets: neither is kept).
The keys and number formats drifted between versions (timestamps with and without
microseconds, ``1.0E+01`` vs plain floats, memory with and without 2 decimals), so parsing is by
key name, not by position.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(?P<fields>.*)$")
VALIDATION = re.compile(r"\bvalidation loss at iteration\s+(\d+)(?P<where>[^|]*)\|(?P<fields>.*)$")
MEMORY = re.compile(r"memory \(MB\)(?P<fields>(\s*\|\s*[^|]+:\s*[-+0-9.eE]+)+)")
WORLD = re.compile(r"using world size: (\d+)")  # Megatron's own line at start-up
KEYS = {
    "elapsed time per iteration (ms)": "ms_per_iter",
    "throughput per GPU (TFLOP/s/GPU)": "tflops_per_gpu",
    "lm loss": "lm_loss",
    "grad norm": "grad_norm",
    "global batch size": "global_batch_size",
    "learning rate": "learning_rate",
    "loss scale": "loss_scale",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
}


def _number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


def _fields(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in text.split("|"):
        key, sep, value = part.rpartition(":")
        if not sep:
            continue
        number = _number(value)
        if number is not None:
            out[key.strip()] = number
    return out


@dataclass(slots=True)
class Iteration:
    iteration: int
    total: int
    values: dict[str, float]

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(slots=True)
class MegatronLog:
    iterations: list[Iteration] = field(default_factory=list)
    memory_mb: dict[str, float] = field(default_factory=dict)  # the report with the highest max allocated
    errors: list[str] = field(default_factory=list)  # tail lines that look like a crash
    validation: list[tuple[int, float]] = field(default_factory=list)  # (iteration, held-out lm loss)
    world_size: int | None = None  # the world Megatron said it uses at start-up (the run's own word)

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(it.iteration, it.values[name]) for it in self.iterations if name in it.values]

    def steady(self, name: str, skip_first: int) -> list[float]:
        """Values after the first ``skip_first`` iterations (warm-up, compile, allocator growth)."""
        return [v for i, v in self.series(name) if i > skip_first]

    def summary(self, skip_first: int = 3) -> dict[str, Any]:
        out: dict[str, Any] = {"iterations": len(self.iterations),
                               "last_iteration": self.iterations[-1].iteration if self.iterations else 0}
        for name in ("ms_per_iter", "tflops_per_gpu", "grad_norm"):
            values = self.steady(name, skip_first)
            if values:
                out[name] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                             "n": len(values)}
        loss = self.series("lm_loss")
        if loss:
            out["lm_loss_last"] = loss[-1][1]
        for name in ("skipped", "nan"):
            vals = [v for _, v in self.series(name)]
            out[f"{name}_iterations"] = int(sum(vals)) if vals else 0
        if self.memory_mb:
            out["memory_mb"] = dict(self.memory_mb)
        if self.validation:
            out["validation_loss_last"] = self.validation[-1][1]
        return out


def parse_lines(lines: Iterable[str]) -> MegatronLog:
    log = MegatronLog()
    for raw in lines:
        line = raw.rstrip("\n")
        m = ITERATION.search(line)
        if m:
            values = {KEYS.get(k, k): v for k, v in _fields(m.group("fields")).items()}
            log.iterations.append(Iteration(int(m.group(1)), int(m.group(2)), values))
            continue
        m = VALIDATION.search(line)
        if m:
            if "test set" not in m.group("where"):
                value = _fields(m.group("fields")).get("lm loss value")
                if value is not None:
                    log.validation.append((int(m.group(1)), value))
            continue
        m = WORLD.search(line)
        if m:
            log.world_size = log.world_size or int(m.group(1))
            continue
        m = MEMORY.search(line)
        if m:
            report = {k.replace(" ", "_"): v for k, v in _fields(m.group("fields")).items()}
            # Every pipeline and tensor-parallel rank with data-parallel rank 0 prints its own: keep the
            # GPU that peaks highest (per rank the peak only grows, so a later report wins a tie).
            kept = log.memory_mb.get("max_allocated")
            if kept is None or report.get("max_allocated", float("-inf")) >= kept:
                log.memory_mb = report
            continue
        if line.startswith(("Traceback", "RuntimeError", "AssertionError", "torch.OutOfMemoryError")) or (
            "Error:" in line and not line.startswith(" ")
        ):
            log.errors.append(line)
    return log


def parse_file(path: str) -> MegatronLog:
    with open(path, errors="replace") as fh:
        return parse_lines(fh)
