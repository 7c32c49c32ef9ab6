"""What the layer-level check prints and records: the plan's rows before anything runs (what will be
built, or why a toggle is not measured), then a row per measured toggle with its interval, time
saved per call, step share and peak memory, and the JSON record of it all."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .analysis import verdict_word
from .design import Row

FORMAT = "megatron-perf-toggles/layers"


def plan_lines(rows: Sequence[Row], shard_line: str, label: str, step: Mapping[str, Any]) -> list[str]:
    """The check's plan: what each toggle's unit is and whether it will be measured."""
    lines = [f"planned with: {label}", f"layout:       {shard_line}", f"step time:    {step['text']}", ""]
    width = max(len(r.toggle.dest) for r in rows) if rows else 10
    for r in rows:
        what = f"{r.unit.name} x{r.per_microbatch} per micro-batch" if r.measured else r.status
        lines.append(f"  {r.toggle.dest:<{width}}  {what}")
    return lines


def _interval(x: Mapping[str, Any], fmt: str) -> str:
    if x.get("low") is None:
        return f"{x.get('estimate') or 0:{fmt}} [too few blocks]"
    return f"{x['estimate']:{fmt}} [{x['low']:{fmt}}, {x['high']:{fmt}}]"


def result_line(dest: str, result: Mapping[str, Any], width: int) -> str:
    """One measured toggle: GPU speedup [95 %], wall speedup, ms saved per call, step share, peak memory."""
    if "error" in result:
        return f"  {dest:<{width}}  failed: {result['error']}"
    gpu, wall = result["gpu"], result["wall"]
    share = result.get("step_share")
    share_text = "step share: no step time"
    if share:
        pct = {k: (share[k] * 100 if share.get(k) is not None else None) for k in ("estimate", "low", "high")}
        share_text = f"{_interval(pct, '+.2f')} % of a step"
    peak = result.get("peak_mb") or {}
    return (f"  {dest:<{width}}  gpu x{_interval(gpu['speedup'], '.3f')} {verdict_word(gpu['speedup'])} "
            f"({gpu['stock_ms']:.3f} -> {gpu['toggle_ms']:.3f} ms); wall x{_interval(wall['speedup'], '.3f')}; "
            f"saves {_interval(gpu['saved_ms'], '.4f')} ms per call; {share_text}; "
            f"peak {peak.get('stock', 0):.0f} -> {peak.get('toggle', 0):.0f} MB")


def result_lines(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    if not results:
        return []
    width = max(len(d) for d in results)
    return ["", "measured (95 % intervals; x>1: the toggle is faster; GPU time by CUDA events, wall time with "
            "the launches):", *(result_line(d, r, width) for d, r in results.items())]


def write(out: Path, record: Mapping[str, Any]) -> Path:
    """The JSON record, written whole (a temporary file renamed over the old one)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "layers.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **record}, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
