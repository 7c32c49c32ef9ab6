"""What the layer-level check prints and records: the plan's rows before anything runs (what will be
built, or why a unit is not measured), then a line per measured unit with its interval, time saved
per call, step share and peak memory (and, for a toggle acting in several units, a line with the
sum of their shares), and the JSON record of it all.

The record (``layers.json``, schema 2) keys ``rows`` and ``results`` by toggle, each toggle's units
under ``units`` by unit name::

    "rows":    {dest: {"units": {unit: {"status", "per_microbatch", "what"}}}}
    "results": {dest: {"units": {unit: {"gpu", "wall", "step_share", "peak_mb", ... or "error"}},
                       "step_share": the units' shares summed (analysis.summed_share) or null,
                       "not_measured": [units of the toggle that were not measured]}}

Schema 1 (records without ``schema``: the ones under docs/benchmarks/raw/layers) had one unit per
toggle, its fields straight under the toggle; ``unit_results`` reads both.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...launcher.screen import table
from .analysis import summed_share, verdict_word
from .design import Row, by_toggle

FORMAT = "megatron-perf-toggles/layers"
SCHEMA = 2


def plan_lines(rows: Sequence[Row], shard_line: str, label: str, step: Mapping[str, Any],
               size: int | None = None) -> list[str]:
    """The check's plan: a line per unit of each toggle, what it is and whether it will be measured."""
    cells = [[r.toggle.dest, f"{r.unit.name}, {r.per_microbatch} per micro-batch" if r.measured
              else f"{r.unit.name}: {r.status}"] for r in rows]
    return [f"planned with: {label}", f"layout:       {shard_line}", f"step time:    {step['text']}", "",
            *table(cells, ["toggle", "measured on (calls per micro-batch on one rank), or why not"], size)]


def rows_record(todo: Sequence[Row]) -> dict[str, Any]:
    """The plan's rows as the record keeps them: each toggle's units, measured or why not."""
    return {dest: {"units": {r.unit.name: {"status": r.status, "per_microbatch": r.per_microbatch,
                                           "what": r.unit.what} for r in rows}}
            for dest, rows in by_toggle(todo).items()}


def grouped(todo: Sequence[Row], measured: Mapping[tuple[str, str], Mapping[str, Any]]) -> dict[str, Any]:
    """Each toggle with a measured unit: its units' results (``measured``, keyed by toggle and unit),
    the units not measured, and its step share, the sum of its units' (``summed_share``); where a
    unit was not measured, the sum is marked ``partial`` with the units it is ``without``."""
    out: dict[str, Any] = {}
    for dest, rows in by_toggle(todo).items():
        units = {r.unit.name: dict(measured[dest, r.unit.name]) for r in rows if (dest, r.unit.name) in measured}
        if not units:
            continue
        missing = [r.unit.name for r in rows if r.unit.name not in units]
        share = summed_share([u.get("step_share") for u in units.values()])
        if share is not None and missing:  # the measured units' sum: a part of the toggle's share, said so
            share = {**share, "partial": True, "without": missing}
        out[dest] = {"units": units, "not_measured": missing, "step_share": share}
    return out


def unit_results(record: Mapping[str, Any]) -> Iterator[tuple[str, str | None, Mapping[str, Any]]]:
    """Every unit's result of a record, as (toggle, unit, result): schema 2's units, or schema 1's one
    result per toggle (its unit where it named one)."""
    for dest, entry in (record.get("results") or {}).items():
        if "units" in entry:
            for unit, result in entry["units"].items():
                yield dest, unit, result
        else:
            yield dest, entry.get("unit"), entry


def _interval(x: Mapping[str, Any], fmt: str) -> str:
    if x.get("low") is None:
        return f"{x.get('estimate') or 0:{fmt}} [too few blocks]"
    return f"{x['estimate']:{fmt}} [{x['low']:{fmt}}, {x['high']:{fmt}}]"


def _share(share: Mapping[str, Any] | None) -> str:
    if not share:
        return "no step time"
    pct = {k: (share[k] * 100 if share.get(k) is not None else None) for k in ("estimate", "low", "high")}
    return f"{_interval(pct, '+.2f')} %"


def _cells(result: Mapping[str, Any]) -> list[str]:
    """One measured unit: GPU and wall speedup [95 %], ms saved per call, step share, peak memory."""
    if "error" in result:
        return ["failed", "", "", "", result["error"]]
    gpu, wall = result["gpu"], result["wall"]
    peak = result.get("peak_mb") or {}
    return [f"x{_interval(gpu['speedup'], '.3f')} {verdict_word(gpu['speedup'])}",
            f"x{_interval(wall['speedup'], '.3f')}",
            f"{gpu['stock_ms']:.3f} -> {gpu['toggle_ms']:.3f} ms, saves {_interval(gpu['saved_ms'], '.4f')}",
            _share(result.get("step_share")),
            f"{peak.get('stock', 0):.0f} -> {peak.get('toggle', 0):.0f} MB"]


def _sum_row(dest: str, entry: Mapping[str, Any]) -> list[str]:
    """A toggle of several units: the sum of their step shares (or why there is none)."""
    missing = entry.get("not_measured") or []
    label = f"sum of {len(entry['units'])}" + (f", without {', '.join(missing)}" if missing else "")
    failed = any("error" in r for r in entry["units"].values())
    share = _share(entry["step_share"]) if entry.get("step_share") or not failed else "a unit failed"
    return [dest, label, "", "", "", share, ""]


def result_lines(results: Mapping[str, Mapping[str, Any]], size: int | None = None) -> list[str]:
    """The measured units as a table, a line each (a failed one: its one-line reason in the last
    column), and under a toggle of several units the sum of their step shares."""
    if not results:
        return []
    rows = []
    for dest, entry in results.items():
        rows += [[dest, unit, *_cells(r)] for unit, r in entry["units"].items()]
        if len(entry["units"]) + len(entry.get("not_measured") or []) > 1:
            rows.append(_sum_row(dest, entry))
    header = ["toggle", "unit", "GPU time [95 %]", "wall time", "per call", "step share",
              "peak memory (stock -> toggle)"]
    return ["", "measured (x>1: the toggle is faster; GPU time by CUDA events, wall time with the launches; a "
            "toggle's sum: estimates added, intervals in quadrature):", *table(rows, header, size)]


def write(out: Path, record: Mapping[str, Any]) -> Path:
    """The JSON record, written whole (a temporary file renamed over the old one)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "layers.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "schema": SCHEMA, **record}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
