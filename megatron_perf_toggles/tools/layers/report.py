"""What the layer-level check prints and records: the plan's rows before anything runs (what will be
built, or why a toggle is not measured), then a row per measured toggle with its interval, time
saved per call, step share and peak memory, and the JSON record of it all."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...launcher.screen import table
from .analysis import verdict_word
from .design import Row

FORMAT = "megatron-perf-toggles/layers"


def plan_lines(rows: Sequence[Row], shard_line: str, label: str, step: Mapping[str, Any],
               size: int | None = None) -> list[str]:
    """The check's plan: what each toggle's unit is and whether it will be measured."""
    cells = [[r.toggle.dest, f"{r.unit.name}, {r.per_microbatch} per micro-batch" if r.measured else r.status]
             for r in rows]
    return [f"planned with: {label}", f"layout:       {shard_line}", f"step time:    {step['text']}", "",
            *table(cells, ["toggle", "measured on (calls per micro-batch on one rank), or why not"], size)]


def _interval(x: Mapping[str, Any], fmt: str) -> str:
    if x.get("low") is None:
        return f"{x.get('estimate') or 0:{fmt}} [too few blocks]"
    return f"{x['estimate']:{fmt}} [{x['low']:{fmt}}, {x['high']:{fmt}}]"


def _cells(result: Mapping[str, Any]) -> list[str]:
    """One measured toggle: GPU and wall speedup [95 %], ms saved per call, step share, peak memory."""
    gpu, wall = result["gpu"], result["wall"]
    share = result.get("step_share")
    pct = {k: (share[k] * 100 if share.get(k) is not None else None) for k in ("estimate", "low", "high")} \
        if share else None
    peak = result.get("peak_mb") or {}
    return [f"x{_interval(gpu['speedup'], '.3f')} {verdict_word(gpu['speedup'])}",
            f"x{_interval(wall['speedup'], '.3f')}",
            f"{gpu['stock_ms']:.3f} -> {gpu['toggle_ms']:.3f} ms, saves {_interval(gpu['saved_ms'], '.4f')}",
            f"{_interval(pct, '+.2f')} %" if pct else "no step time",
            f"{peak.get('stock', 0):.0f} -> {peak.get('toggle', 0):.0f} MB"]


def result_lines(results: Mapping[str, Mapping[str, Any]], size: int | None = None) -> list[str]:
    """The measured toggles as a table (a failed one: its one-line reason in the last column)."""
    if not results:
        return []
    rows = [[dest, *(_cells(r) if "error" not in r else ["failed", "", "", "", r["error"]])]
            for dest, r in results.items()]
    header = ["toggle", "GPU time [95 %]", "wall time", "per call", "step share", "peak memory (stock -> toggle)"]
    return ["", "measured (x>1: the toggle is faster; GPU time by CUDA events, wall time with the launches):",
            *table(rows, header, size)]


def write(out: Path, record: Mapping[str, Any]) -> Path:
    """The JSON record, written whole (a temporary file renamed over the old one)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "layers.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **record}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
