"""The memory guard: no default may turn a job that fits stock Megatron's memory into one that does not.

Runs after the other guards (``decide.decide`` calls ``guard_memory`` once, at the end). It prices
every decision with ``core.memory`` against stock's value, estimates stock's own peak for the layout,
and where stock fits the GPU (less the headroom) but stock plus the decisions would not, backs off
the memory-increasing defaults that tip it, costliest first, each with the numbers in its reason.
Values asked for (command line, environment, profile) are kept, with a warning naming the expected
peak. Where the layout or the GPU's memory is unknown, the plan says so instead of guessing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import EnvValueError
from .env import EnvSettings
from .facts import Capabilities
from .guards import NEEDS
from .memory import Estimate, Unknown, layout_from_args, stock_peak, toggle_delta_mb
from .plan import Context, Decision, Message
from .registry import BY_DEST, TOGGLES, format_value

HEADROOM_VAR = "MEGATRON_PERF_TOGGLES_MEMORY_HEADROOM"
DEFAULT_HEADROOM = "10%"
HEADROOM_ACCEPTED = "a percentage of the GPU's memory (10%) or an amount in GB (8 or 8GB), 0 or more"


def headroom_mb(env: EnvSettings, capacity_mb: float) -> float:
    """The memory kept free per GPU: MEGATRON_PERF_TOGGLES_MEMORY_HEADROOM, default 10 %."""
    raw = (env.memory_headroom or DEFAULT_HEADROOM).strip()
    text = raw.lower().removesuffix("gb").removesuffix("%").strip()
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0 or (raw.endswith("%") and value >= 100):
        raise EnvValueError(HEADROOM_VAR, raw, HEADROOM_ACCEPTED)
    return capacity_mb * value / 100 if raw.endswith("%") else value * 1024


def size_words(mb: float) -> str:
    """A peak or a change as people read it: GB (of 1024 MB) from 1 GB up, else MB."""
    return f"{mb / 1024:.1f} GB" if abs(mb) >= 1024 else f"{mb:.0f} MB"


def delta_words(mb: float | None) -> str:
    """A decision's memory change for the tables: ``+4.0 GB peak per GPU``."""
    if mb is None:
        return "peak memory change unknown"
    if abs(mb) < 0.5:
        return "no change in peak memory"
    return f"{'+' if mb > 0 else '-'}{size_words(abs(mb))} peak per GPU"


def summary(memory: Mapping[str, Any]) -> str:
    """One line for the tables: stock's estimated peak, the plan's change, the limit, or why not."""
    stock, total = memory.get("stock_peak_mb"), memory.get("total_peak_memory_delta_mb")
    if stock is None:
        return f"memory: {memory.get('note') or 'no estimate'}"
    line = f"memory: stock's estimated peak {size_words(stock)} per GPU ({memory.get('stock_estimate_source')})"
    if total is not None:
        line += f", this plan {'+' if total >= 0 else '-'}{size_words(abs(total))}"
        unknown = [d for d, mb in (memory.get("peak_memory_delta_mb") or {}).items() if mb is None]
        if unknown:
            line += f" (not counting {', '.join(unknown)}: unknown)"
        planned = memory.get("planned_peak_mb")
        if planned is not None:  # per pipeline stage: not always stock's peak plus the last stage's change
            line += f", planned peak {size_words(planned)}"
    limit = memory.get("limit_mb")
    line += f"; limit {size_words(limit)}" if limit else ""
    note = memory.get("note")
    return line + (f"; {note}" if note else "")


def stock_values(stock: Mapping[str, Any], caps: Capabilities) -> dict[str, Any]:
    """What stock Megatron runs with: its own defaults, and gradient accumulation fusion only where
    APEX's kernel is there (stock raises at model build otherwise, so such a job runs without it)."""
    out = {t.dest: stock.get(t.dest, t.stock_default) for t in TOGGLES}
    out["gradient_accumulation_fusion"] = bool(out["gradient_accumulation_fusion"]) and caps.apex_fused_wgrad
    return out


@dataclass(slots=True)
class MemoryPlan:
    """The record of what the plan does to peak memory (``Plan.memory``)."""

    deltas: dict[str, float | None] = field(default_factory=dict)
    stock: Estimate | None = None
    gpu_memory_mb: float | None = None
    limit_mb: float | None = None
    note: str = ""
    planned_mb: float | None = None  # the busier pipeline stage's, with the decisions (planned_peak)

    @property
    def total_mb(self) -> float | None:
        known = [d for d in self.deltas.values() if d is not None]
        return round(sum(known), 1) if known else None

    def to_record(self) -> dict[str, Any]:
        stock = self.stock
        return {
            "peak_memory_delta_mb": self.deltas, "total_peak_memory_delta_mb": self.total_mb,
            "unit": "MB of 2**20 bytes, per GPU, against stock Megatron",
            "stock_peak_mb": None if stock is None else stock.peak_mb,
            "stock_estimate_source": None if stock is None else stock.source,
            "stock_parts_mb": None if stock is None else stock.parts,
            "planned_peak_mb": None if self.planned_mb is None else round(self.planned_mb, 1),
            "gpu_memory_mb": self.gpu_memory_mb, "limit_mb": self.limit_mb, "note": self.note or None,
        }


def _deltas(values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any, te: bool) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for t in TOGGLES:
        delta = toggle_delta_mb(t.dest, values, stock, layout, te)
        out[t.dest] = None if delta is None else round(delta, 1)
    return out


def planned_peak(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
                 te: bool) -> float:
    """The plan's peak: each pipeline stage's own stock peak plus the decisions' changes on that
    stage (the logits' terms are the last stage's alone), the larger of the two. Adding the last
    stage's changes to stock's peak would price a first-stage peak with logits it does not hold."""
    out = []
    for name, stage_mb in (estimate.stages or {"last": estimate.peak_mb}).items():
        deltas = (toggle_delta_mb(t.dest, values, stock, layout, te, last_stage=name == "last") for t in TOGGLES)
        out.append(stage_mb + sum(d for d in deltas if d is not None))
    return max(out)


def guard_memory(args: Mapping[str, Any], decisions: dict[str, Decision], caps: Capabilities, env: EnvSettings,
                 stock: Mapping[str, Any]) -> tuple[MemoryPlan, list[Message]]:
    """Price the decisions, and back off the defaults that would tip a job stock fits out of memory
    (``decisions`` is changed in place). Returns the memory record and the messages for the table."""
    headroom_mb(env, 1.0)  # a bad setting is reported on every plan, not only where the guard gets to use it
    memory = MemoryPlan(gpu_memory_mb=caps.gpu_memory_mb)
    base = stock_values(stock, caps)
    te = caps.te_version is not None
    try:
        layout = layout_from_args(args)
        layout.last_stage_params()  # a layout whose numbers do not divide (e.g. heads by TP) is not modelled
    except (Unknown, ArithmeticError, TypeError, ValueError) as why:
        memory.deltas = {t.dest: None for t in TOGGLES}
        memory.note = f"no memory estimate: {why}; each decision's memory change is unknown"
        return memory, []
    values = {dest: d.value for dest, d in decisions.items()}
    memory.deltas = _deltas(values, base, layout, te)
    memory.stock = estimate = stock_peak(layout, bool(base["gradient_accumulation_fusion"]), te)
    memory.planned_mb = planned = planned_peak(estimate, values, base, layout, te)
    if caps.gpu_memory_mb is None:
        memory.note = "the GPU's memory is not known here: no memory guard"
        return memory, []
    kept_free = headroom_mb(env, caps.gpu_memory_mb)
    limit = caps.gpu_memory_mb - kept_free
    memory.limit_mb = round(limit, 1)
    setting = (env.memory_headroom or DEFAULT_HEADROOM).strip()
    where = (f"{caps.gpu_name or 'the GPU'}: {size_words(caps.gpu_memory_mb)} less "
             f"{setting + ' (' + size_words(kept_free) + ')' if setting.endswith('%') else size_words(kept_free)} "
             f"headroom = {size_words(limit)}")
    messages: list[Message] = []
    if planned <= limit:
        return memory, messages
    if estimate.peak_mb > limit:
        memory.note = (f"stock's own estimated peak {size_words(estimate.peak_mb)} is above the limit ({where}); "
                       "the guard only keeps the defaults from tipping a job that fits")
        return memory, [Message("warning", f"memory: {memory.note}")]
    for dest in sorted((d for d, mb in memory.deltas.items() if mb and mb > 0), key=lambda d: -(memory.deltas[d] or 0)):
        if planned <= limit:
            break
        decision, cost = decisions[dest], memory.deltas[dest] or 0.0
        if decision.source != "default" or not env.plugin_enabled or _needed(dest, Context(args, values, caps, env)):
            continue
        if planned_peak(estimate, {**values, dest: base[dest]}, base, layout, te) >= planned:
            continue  # it does not add to the stage that peaks (the logits' terms where the first stage peaks)
        reason = (f"memory: stock's estimated peak {size_words(estimate.peak_mb)} fits the limit ({where}), but with "
                  f"the defaults the peak would be {size_words(planned)}; this default adds {delta_words(cost)}, "
                  f"so it is backed off to stock's {format_value(base[dest])} ({HEADROOM_VAR} sets the headroom)")
        decisions[dest] = Decision(base[dest], "guard", reason)
        values[dest] = base[dest]
        memory.deltas = _deltas(values, base, layout, te)
        memory.planned_mb = planned = planned_peak(estimate, values, base, layout, te)
    if planned > limit:
        asked = [d for d, mb in memory.deltas.items() if mb and mb > 0 and decisions[d].source != "default"]
        words = ", ".join(f"{BY_DEST[d].dest} ({decisions[d].source}, {delta_words(memory.deltas[d])})" for d in asked)
        messages.append(Message("warning", f"memory: expected peak {size_words(planned)} per GPU is above the limit "
                                           f"({where}); kept as asked: {words or 'nothing the guard may change'}"))
    return memory, messages


def _needed(dest: str, ctx: Context) -> bool:
    """A feature asked for needs the toggle (``guards.NEEDS``, where each need is declared once): it stays."""
    return any(need.dest == dest and need.feature(ctx) for need in NEEDS)
