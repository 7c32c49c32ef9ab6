"""The memory guard: no default may turn a job that fits stock Megatron's memory into one that does not.

Runs after the other guards (``decide.decide`` calls ``guard_memory`` once, at the end). It prices
every decision with ``core.memory.model`` against stock's value, estimates stock's own peak for the layout,
and where stock fits the GPU (less the headroom) but stock plus the decisions would not, backs off
the memory-increasing defaults that tip it, costliest first, each with the numbers in its reason.
Values asked for (command line, environment, profile) are kept, with a warning naming the expected
peak. Where the layout or the GPU's memory is unknown, the plan says so instead of guessing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import EnvValueError
from .. import stock_off
from ..decision.plan import Context, Decision, Message
from ..env import EnvSettings
from ..facts import Capabilities
from ..registry import TOGGLES, format_value
from ..rules.guards import NEEDS
from .allocator import (
    EXPANDABLE,
    LAUNCH_VAR,
    VERDICT_WORDS,
    AllocConf,
    Largest,
    Verdict,
    expandable_segments_refused,
    largest_allocation,
    need_mb,
    te_cuda_graphs,
    verdict,
    worse,
)
from .model import MOE_DESTS, Estimate, Unknown, layout_from_args, step_peak, stock_peak, toggle_delta_mb

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


def stage_words(memory: Mapping[str, Any], stock: float, total: float) -> str:
    """The plan's change and peak, worded so that the screen adds up: with pipeline parallelism the
    table's figures are the last stage's while the peak may be another stage's (or the optimizer
    step's), so the peak's own change against stock's is said beside them."""
    def signed(mb: float) -> str:
        return f"{'+' if mb >= 0 else '-'}{size_words(abs(mb))}"

    unknown = [d for d, mb in (memory.get("peak_memory_delta_mb") or {}).items() if mb is None]
    counting = f" (not counting {', '.join(unknown)}: unknown)" if unknown else ""
    planned = memory.get("planned_peak_mb")
    if planned is None:
        return f", this plan {signed(total)}{counting}"
    if abs(stock + total - planned) < 1:
        return f", this plan {signed(total)}{counting}, planned peak {size_words(planned)}"
    return (f", planned peak {size_words(planned)} ({signed(planned - stock)} on the busier pipeline stage or "
            f"the optimizer step; the table's changes, {signed(total)} in all{counting}, are the last stage's)")


def summary(memory: Mapping[str, Any]) -> str:
    """One line for the tables: stock's estimated peak, the plan's change, its largest allocation,
    the limit and the verdicts, or why there is no estimate."""
    stock, total = memory.get("stock_peak_mb"), memory.get("total_peak_memory_delta_mb")
    if stock is None:
        return f"memory: {memory.get('note') or 'no estimate'}"
    line = f"memory: stock's estimated peak {size_words(stock)} per GPU ({memory.get('stock_estimate_source')})"
    if total is not None:
        line += stage_words(memory, stock, total)
    if memory.get("largest_allocation_mb") is not None:
        line += f"; largest allocation {size_words(memory['largest_allocation_mb'])}"
    limit = memory.get("limit_mb")
    line += f"; limit {size_words(limit)}" if limit else ""
    verdicts = memory.get("verdict") or {}
    if verdicts:
        said = ", ".join(f"{who} {VERDICT_WORDS[v]}" for who, v in verdicts.items())
        line += f": {said}" + (" (expandable segments set)" if memory.get("expandable_segments_set") else "")
    note = memory.get("note")
    return line + (f"; {note}" if note else "")


def stock_values(stock: Mapping[str, Any], caps: Capabilities, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What stock Megatron runs with: its own defaults, and gradient accumulation fusion only where
    APEX's kernel is there (stock raises at model build otherwise, so such a job runs without it).
    The MoE toggles the registry does not hold are what the command line gave (``args``): the
    plugin does not move them, so stock and the plan both run with that."""
    out = {d: bool((args or {}).get(d)) for d in MOE_DESTS}
    out.update({t.dest: stock.get(t.dest, t.stock_default) for t in TOGGLES})
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
    largest: Largest | None = None  # the plan's largest allocation per step, on its neediest stage (core.memory.allocator)
    needs: dict[str, float] | None = None  # what the allocator needs: fixed_segments, expandable_segments
    stock_largest: Largest | None = None
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # "stock" and "plan"
    expandable_set: bool = False  # PYTORCH_CUDA_ALLOC_CONF already turns expandable segments on
    expandable_refused: str | None = None  # Megatron refuses them for this layout (why)
    launch: list[dict[str, str]] = field(default_factory=list)  # variables the launch should export

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
            "largest_allocation_mb": None if self.largest is None else self.largest.mb,
            "largest_allocation": None if self.largest is None else self.largest.what,
            "stock_largest_allocation_mb": None if self.stock_largest is None else self.stock_largest.mb,
            # what the caching allocator needs for this plan: its peak plus its largest allocation with
            # fixed segments, the peak alone with expandable segments (core.memory.allocator)
            "allocator_need_mb": self.needs,
            "verdict": dict(self.verdicts) or None,
            "expandable_segments_set": self.expandable_set, "expandable_segments_refused": self.expandable_refused,
            "launch_environment": self.launch,
            "gpu_memory_mb": self.gpu_memory_mb, "limit_mb": self.limit_mb, "note": self.note or None,
        }


def _deltas(values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any, te: bool) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for t in TOGGLES:
        delta = toggle_delta_mb(t.dest, values, stock, layout, te)
        out[t.dest] = None if delta is None else round(delta, 1)
    return out


def stage_peaks(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
                te: bool, dests: Iterable[str] | None = None) -> dict[str, float]:
    """Each pipeline stage's own stock peak plus the decisions' changes on that stage (the logits'
    terms are the last stage's alone), or its optimizer step's peak where that is larger
    (``memory.step_peak``): ``last``, and ``first`` where PP > 1. ``dests``: the toggles priced
    (default: the registry's)."""
    out = {}
    for name, stage_mb in (estimate.stages or {"last": estimate.peak_mb}).items():
        deltas = {d: toggle_delta_mb(d, values, stock, layout, te, last_stage=name == "last")
                  for d in (dests if dests is not None else [t.dest for t in TOGGLES])}
        training = stage_mb + sum(d for d in deltas.values() if d is not None)
        step = step_peak(estimate, deltas, layout, values, name)
        out[name] = training if step is None else max(training, step)
    return out


def planned_peak(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
                 te: bool, dests: Iterable[str] | None = None) -> float:
    """The plan's peak: the larger of the stages' (``stage_peaks``). Adding the last stage's changes
    to stock's peak would price a first-stage peak with logits it does not hold."""
    return max(stage_peaks(estimate, values, stock, layout, te, dests).values())


def allocator_stages(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
                     te: bool) -> list[tuple[float, Largest]]:
    """Each stage's peak with its own largest allocation (the first stage holds no logits), for what
    the caching allocator needs (``allocator.need_mb``)."""
    return [(peak, largest_allocation(layout, values, last_stage=name == "last"))
            for name, peak in stage_peaks(estimate, values, stock, layout, te).items()]


@dataclass(slots=True)
class _Fit:
    """The verdict of one set of toggle values on one layout and limit (core.memory.allocator)."""

    layout: Any
    estimate: Estimate
    base: Mapping[str, Any]
    te: bool
    limit: float
    expandable_set: bool
    refused: str | None

    def peak(self, values: Mapping[str, Any]) -> float:
        return planned_peak(self.estimate, values, self.base, self.layout, self.te)

    def stages(self, values: Mapping[str, Any]) -> list[tuple[float, Largest]]:
        return allocator_stages(self.estimate, values, self.base, self.layout, self.te)

    def verdict(self, values: Mapping[str, Any]) -> Verdict:
        stages = self.stages(values)
        return verdict(need_mb(stages, False), need_mb(stages, True), self.limit, self.expandable_set,
                       expandable_allowed=self.refused is None)

    def need(self, values: Mapping[str, Any]) -> float:
        return need_mb(self.stages(values), self.expandable_set)


def _neediest(stages: list[tuple[float, Largest]]) -> tuple[float, Largest]:
    """The stage whose peak plus largest allocation is the largest: where fixed segments run short first."""
    return max(stages, key=lambda stage: stage[0] + stage[1].mb)


def _allocator_record(memory: MemoryPlan, stages: list[tuple[float, Largest]]) -> None:
    """The plan's largest allocation (its neediest stage's) and what the allocator needs, into the record."""
    memory.largest = _neediest(stages)[1]
    memory.needs = {"fixed_segments": round(need_mb(stages, False), 1),
                    "expandable_segments": round(need_mb(stages, True), 1)}


def guard_memory(args: Mapping[str, Any], decisions: dict[str, Decision], caps: Capabilities, env: EnvSettings,
                 stock: Mapping[str, Any]) -> tuple[MemoryPlan, list[Message]]:
    """Price the decisions, and back off the defaults that would leave the job worse off than
    stock: out of memory where stock fits, or needing expandable segments where stock does not
    (``decisions`` is changed in place). Returns the memory record and the messages for the table."""
    headroom_mb(env, 1.0)  # a bad setting is reported on every plan, not only where the guard gets to use it
    memory = MemoryPlan(gpu_memory_mb=caps.gpu_memory_mb, expandable_set=env.expandable_segments)
    base = stock_values(stock, caps, args)
    te = caps.te_version is not None
    try:
        layout = layout_from_args(args)
        layout.last_stage_params()  # a layout whose numbers do not divide (e.g. heads by TP) is not modelled
    except (Unknown, ArithmeticError, TypeError, ValueError) as why:
        memory.deltas = {t.dest: None for t in TOGGLES}
        memory.note = f"no memory estimate: {why}; each decision's memory change is unknown"
        return memory, []
    values = {**{d: base[d] for d in MOE_DESTS}, **{dest: d.value for dest, d in decisions.items()}}
    values = stock_off.priced(values, base, caps, env)  # a wgrad kernel nobody provides: priced as stock runs
    memory.deltas = _deltas(values, base, layout, te)
    memory.stock = estimate = stock_peak(layout, bool(base["gradient_accumulation_fusion"]), te,
                                         {d: base[d] for d in MOE_DESTS})
    memory.planned_mb = planned_peak(estimate, values, base, layout, te)
    _allocator_record(memory, allocator_stages(estimate, values, base, layout, te))
    memory.stock_largest = _neediest(allocator_stages(estimate, base, base, layout, te))[1]
    if caps.gpu_memory_mb is None:
        memory.note = "the GPU's memory is not known here: no memory guard"
        return memory, []
    limit = caps.gpu_memory_mb - headroom_mb(env, caps.gpu_memory_mb)
    memory.limit_mb = round(limit, 1)
    refused = expandable_segments_refused(args, caps)
    memory.expandable_refused = None if env.expandable_segments else refused
    fit = _Fit(layout, estimate, base, te, limit, env.expandable_segments, memory.expandable_refused)
    memory.verdicts = {"stock": fit.verdict(base), "plan": fit.verdict(values)}
    messages = _back_off(fit, memory, decisions, values, Context(args, values, caps, env), _where(caps, env, limit))
    memory.verdicts["plan"] = fit.verdict(values)
    memory.launch = _launch(memory, fit, args, caps, env.alloc)
    messages += _verdict_messages(memory, fit, values)
    if env.alloc.expandable and refused:
        messages.append(Message("warning", f"memory: {env.alloc.var} turns expandable segments on, but {refused}: "
                                           "Megatron will stop this launch"))
    if env.alloc.async_backend:
        memory.note = "backend:cudaMallocAsync: not the caching allocator; the need is taken as the peak alone"
    return memory, messages


def _where(caps: Capabilities, env: EnvSettings, limit: float) -> str:
    """``NVIDIA H100: 80.0 GB less 10% (8.0 GB) headroom = 72.0 GB``: the limit, as reasons say it."""
    capacity = caps.gpu_memory_mb or 0.0
    kept_free = capacity - limit
    setting = (env.memory_headroom or DEFAULT_HEADROOM).strip()
    kept = f"{setting} ({size_words(kept_free)})" if setting.endswith("%") else size_words(kept_free)
    return f"{caps.gpu_name or 'the GPU'}: {size_words(capacity)} less {kept} headroom = {size_words(limit)}"


def _eligible(memory: MemoryPlan, decisions: Mapping[str, Decision], ctx: Context) -> list[str]:
    """The defaults the guard may back off, costliest first: memory-increasing, nobody asked for them."""
    costly = sorted((d for d, mb in memory.deltas.items() if mb and mb > 0), key=lambda d: -(memory.deltas[d] or 0))
    return [d for d in costly if decisions[d].source == "default" and ctx.env.plugin_enabled and not _needed(d, ctx)]


def _cannot_help(memory: MemoryPlan, decisions: Mapping[str, Decision], eligible: list[str], where: str) -> Message:
    """Nothing the guard may change improves the outcome: say what takes the job past stock's need."""
    costly = [d for d, mb in memory.deltas.items() if mb and mb > 0 and d not in eligible]
    words = ", ".join(f"{d} ({decisions[d].source if decisions[d].source != 'default' else 'needed by a feature asked for'}"
                      f", {delta_words(memory.deltas[d])})" for d in costly)
    return Message("warning", f"memory: what was asked for ({words or 'the layout itself'}) takes the job past what "
                              f"stock needs ({where}); backing off a default would not change that, so the defaults "
                              "are kept")


def _back_off(fit: _Fit, memory: MemoryPlan, decisions: dict[str, Decision], values: dict[str, Any],
              ctx: Context, where: str) -> list[Message]:
    """Back off defaults, costliest first, only where that changes the outcome: until the plan is
    no worse than stock, or as good as backing off every eligible default makes it."""
    stock_v, plan_v = memory.verdicts["stock"], memory.verdicts["plan"]
    if stock_v == "does_not_fit" or not worse(plan_v, stock_v):
        return []
    eligible = _eligible(memory, decisions, ctx)
    best = fit.verdict({**values, **{d: fit.base[d] for d in eligible}})
    if not worse(plan_v, best):
        return [_cannot_help(memory, decisions, eligible, where)]
    target = best if worse(best, stock_v) else stock_v  # the better of these two the guard cannot beat
    for dest in eligible:
        now = fit.verdict(values)
        if not worse(now, target):
            break
        trial = {**values, dest: fit.base[dest]}
        if fit.need(trial) >= fit.need(values) and fit.peak(trial) >= fit.peak(values):
            continue  # it does not add to what is short (the logits' terms where the first stage peaks)
        goal = ("fit with expandable segments" if target == "fits_with_expandable_segments" else
                "fit without expandable segments" if now == "fits_with_expandable_segments" else "fit")
        reason = (f"memory: stock (estimated peak {size_words(fit.estimate.peak_mb)}) {VERDICT_WORDS[stock_v]} "
                  f"({where}), but with the defaults the job {VERDICT_WORDS[now]} (planned peak "
                  f"{size_words(fit.peak(values))}); this default adds {delta_words(memory.deltas[dest])}, so it is "
                  f"backed off to stock's {format_value(fit.base[dest])} to {goal} ({HEADROOM_VAR} sets the headroom)")
        decisions[dest] = Decision(fit.base[dest], "guard", reason)
        values[dest] = fit.base[dest]
        memory.deltas = _deltas(values, fit.base, fit.layout, fit.te)
        memory.planned_mb = fit.peak(values)
        _allocator_record(memory, fit.stages(values))
    return []


def _verdict_messages(memory: MemoryPlan, fit: _Fit, values: Mapping[str, Any]) -> list[Message]:
    """A warning where the job, as planned, will not run as launched; none where it fits."""
    plan_v, stock = memory.verdicts["plan"], memory.stock
    if plan_v == "fits" or stock is None:
        return []
    if plan_v == "fits_with_expandable_segments":
        var = memory.launch[0] if memory.launch else {"name": LAUNCH_VAR, "value": EXPANDABLE}
        return [Message("warning", f"memory: this job {VERDICT_WORDS[plan_v]}: export "
                                   f"{var['name']}={var['value']} (the launch environment says why)")]
    why = (f"; {memory.expandable_refused}, which expandable segments would need"
           if memory.expandable_refused and min(stock.peak_mb, fit.peak(values)) <= fit.limit else "")
    return [Message("warning", f"memory: this job does not fit: planned peak {size_words(fit.peak(values))}, "
                               f"allocator's need {size_words(fit.need(values))}, limit {size_words(fit.limit)}"
                               f" (stock: {VERDICT_WORDS[memory.verdicts['stock']]}){why}")]


def _launch(memory: MemoryPlan, fit: _Fit, args: Mapping[str, Any], caps: Capabilities,
            alloc: AllocConf) -> list[dict[str, str]]:
    """What the launch must export for the plan to fit: expandable segments where only they make it
    fit (and NCCL_GRAPH_REGISTER=0 beside them with Transformer Engine's CUDA graphs)."""
    if memory.verdicts.get("plan") != "fits_with_expandable_segments" or memory.largest is None:
        return []
    without = (memory.needs or {}).get("fixed_segments", 0.0)
    name, value = alloc.with_expandable()  # the variable torch reads, the user's other options kept
    out = [{"name": name, "value": value,
            "why": (f"fits only with expandable segments: the peak plus the largest allocation "
                    f"{size_words(memory.largest.mb)} ({memory.largest.what}) needs {size_words(without)} of "
                    f"fixed segments; limit {size_words(fit.limit)}")}]
    if te_cuda_graphs(args, caps):
        out.append({"name": "NCCL_GRAPH_REGISTER", "value": "0",
                    "why": "Transformer Engine's CUDA graphs with expandable segments: Megatron asserts it"})
    return out


def _needed(dest: str, ctx: Context) -> bool:
    """A feature asked for needs the toggle (``guards.NEEDS``, where each need is declared once): it stays."""
    return any(need.dest == dest and need.feature(ctx) for need in NEEDS)
