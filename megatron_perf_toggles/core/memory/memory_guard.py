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
from collections.abc import Mapping
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
from .memory_words import delta_words, signed, size_words
from .model import MOE_DESTS, Estimate, Unknown, layout_from_args, stock_peak, toggle_delta_mb
from .peaks import Spot, planned_peak, shares, stage_peaks

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


def stock_values(stock: Mapping[str, Any], caps: Capabilities, args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What stock Megatron runs with: its own defaults, and gradient accumulation fusion only where
    APEX's kernel is there (stock raises at model build otherwise, so such a job runs without it).
    The MoE toggles the registry does not hold are what the command line gave (``args``): the
    plugin does not move them, so stock and the plan both run with that."""
    out = {d: bool((args or {}).get(d)) for d in MOE_DESTS}
    out.update({t.dest: stock.get(t.dest, t.stock_default) for t in TOGGLES})
    out["gradient_accumulation_fusion"] = bool(out["gradient_accumulation_fusion"]) and caps.apex_fused_wgrad
    return out


# the toggles whose term is the logits' (the output layer and the loss live on the last stage alone)
LAST_STAGE_TERMS = ("cross_entropy_loss_fusion", "cross_entropy_fusion_impl")


@dataclass(slots=True)
class MemoryPlan:
    """The record of what the plan does to peak memory (``Plan.memory``)."""

    # Each toggle's share of the change in the reported peak (core.memory.peaks: they add up to it).
    deltas: dict[str, float | None] = field(default_factory=dict)
    # Each toggle's change where it acts (core.memory.model.toggle_delta_mb on the last stage):
    # what the guard may gain by backing it off once the peak is elsewhere.
    terms: dict[str, float | None] = field(default_factory=dict)
    stock: Estimate | None = None
    stock_at: Spot | None = None  # where stock peaks, and by how much
    planned_at: Spot | None = None  # where the plan peaks (the busiest pipeline stage, or its optimizer step)
    moved: dict[str, Spot] = field(default_factory=dict)  # the toggles whose share moved the peak: where to
    stages: int = 1  # pipeline stages (PP): where more than one, the places name the stage
    # each pipeline rank's transformer layers, as the split read from the arguments gives them
    # (core.memory.pipeline_split): the plan priced these, so a reader can hold them against the run's
    stage_layers: list[int] | None = None
    gpu_memory_mb: float | None = None
    limit_mb: float | None = None
    note: str = ""
    largest: Largest | None = None  # the plan's largest allocation per step, on its neediest stage (core.memory.allocator)
    largest_stage: str | None = None  # that stage: last | first | rank N
    needs: dict[str, float] | None = None  # what the allocator needs: fixed_segments, expandable_segments
    stock_largest: Largest | None = None
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # "stock" and "plan"
    expandable_set: bool = False  # PYTORCH_CUDA_ALLOC_CONF already turns expandable segments on
    expandable_refused: str | None = None  # Megatron refuses them for this layout (why)
    launch: list[dict[str, str]] = field(default_factory=list)  # variables the launch should export

    @property
    def planned_mb(self) -> float | None:
        return None if self.planned_at is None else self.planned_at.mb

    @property
    def total_mb(self) -> float | None:
        """The planned peak less stock's: what the shares add up to (None without an estimate)."""
        if self.planned_at is None or self.stock_at is None:
            return None
        return round(self.planned_at.mb - self.stock_at.mb, 1)

    def notes(self) -> dict[str, str]:
        """Where a row's share is not its term: the peak moved with it, or its term is off the peak."""
        out = {dest: f"moves the peak to {spot.place(self.stages)}" for dest, spot in self.moved.items()}
        planned = self.planned_at
        for dest, share in self.deltas.items():
            term = self.terms.get(dest)
            if dest in out or planned is None or share is None or term is None or abs(share) >= 0.5 \
                    or round(abs(term)) < 1:  # a term that reads "0 MB" is no note
                continue
            where = ("on the last stage" if self.stages > 1 and planned.stage != "last" and dest in LAST_STAGE_TERMS
                     else "in forward and backward" if planned.phase == "step" else "elsewhere")
            out[dest] = f"its {signed(term)} is {where}"
        return out

    def to_record(self) -> dict[str, Any]:
        stock, at = self.stock, self.planned_at
        return {
            "peak_memory_delta_mb": self.deltas, "total_peak_memory_delta_mb": self.total_mb,
            "peak_memory_notes": self.notes(),
            "unit": "MB of 2**20 bytes, per GPU, against stock Megatron",
            "stock_peak_mb": None if self.stock_at is None else round(self.stock_at.mb, 1),
            "stock_peak_at": None if self.stock_at is None else self.stock_at.words(self.stages),
            "stock_estimate_source": None if stock is None else stock.source,
            "stock_parts_mb": None if stock is None else stock.parts,
            "planned_peak_mb": None if at is None else round(at.mb, 1),
            "planned_peak_at": None if at is None else at.words(self.stages),
            "pipeline_stages": self.stages, "pipeline_stage_layers": self.stage_layers,
            "largest_allocation_mb": None if self.largest is None else self.largest.mb,
            "largest_allocation": None if self.largest is None else self.largest.what,
            "largest_allocation_stage": self.largest_stage,
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


def allocator_stages(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
                     te: bool) -> list[tuple[str, float, Largest]]:
    """Each priced stage's name, peak and own largest allocation (only the last holds logits), for
    what the caching allocator needs (``allocator.need_mb``)."""
    return [(name, peak, largest_allocation(layout, values, stage=name))
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
        return [(peak, largest) for _, peak, largest in self.named_stages(values)]

    def named_stages(self, values: Mapping[str, Any]) -> list[tuple[str, float, Largest]]:
        return allocator_stages(self.estimate, values, self.base, self.layout, self.te)

    def verdict(self, values: Mapping[str, Any]) -> Verdict:
        stages = self.stages(values)
        return verdict(need_mb(stages, False), need_mb(stages, True), self.limit, self.expandable_set,
                       expandable_allowed=self.refused is None)

    def need(self, values: Mapping[str, Any]) -> float:
        return need_mb(self.stages(values), self.expandable_set)


def _neediest(stages: list[tuple[str, float, Largest]]) -> tuple[str, float, Largest]:
    """The stage whose peak plus largest allocation is the largest: where fixed segments run short first."""
    return max(stages, key=lambda stage: stage[1] + stage[2].mb)


def _priced(memory: MemoryPlan, fit: _Fit, values: Mapping[str, Any]) -> None:
    """The plan's memory into the record: each toggle's share of the peak's change and its term,
    where stock and the plan peak, the largest allocation (on the neediest stage, named) and what
    the allocator needs."""
    split = shares(fit.estimate, values, fit.base, fit.layout, fit.te)
    memory.deltas, memory.stock_at, memory.planned_at, memory.moved = split.mb, split.stock, split.planned, split.moved
    memory.terms = _deltas(values, fit.base, fit.layout, fit.te)
    stages = fit.named_stages(values)
    memory.largest_stage, _, memory.largest = _neediest(stages)
    plain = [(peak, largest) for _, peak, largest in stages]
    memory.needs = {"fixed_segments": round(need_mb(plain, False), 1),
                    "expandable_segments": round(need_mb(plain, True), 1)}


def guard_memory(args: Mapping[str, Any], decisions: dict[str, Decision], caps: Capabilities, env: EnvSettings,
                 stock: Mapping[str, Any]) -> tuple[MemoryPlan, list[Message]]:
    """Price the decisions, and back off the defaults that would leave the job worse off than
    stock: out of memory where stock fits, or needing expandable segments where stock does not
    (``decisions`` is changed in place). Returns the memory record and the messages for the table."""
    headroom_mb(env, 1.0)  # a bad setting is reported on every plan, not only where the guard gets to use it
    memory = MemoryPlan(gpu_memory_mb=caps.gpu_memory_mb, expandable_set=env.expandable_segments)
    pp = args.get("pipeline_model_parallel_size")
    memory.stages = pp if isinstance(pp, int) and pp > 0 else memory.stages  # said even where no estimate follows
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
    memory.stock = estimate = stock_peak(layout, bool(base["gradient_accumulation_fusion"]), te,
                                         {d: base[d] for d in MOE_DESTS})
    memory.stages = layout.pp
    memory.stage_layers = [len(layout.rank_layers(rank)) for rank in range(layout.pp)]
    refused = expandable_segments_refused(args, caps)
    memory.expandable_refused = None if env.expandable_segments else refused
    limit = None if caps.gpu_memory_mb is None else caps.gpu_memory_mb - headroom_mb(env, caps.gpu_memory_mb)
    fit = _Fit(layout, estimate, base, te, limit or 0.0, env.expandable_segments, memory.expandable_refused)
    _priced(memory, fit, values)
    memory.stock_largest = _neediest(fit.named_stages(base))[2]
    if limit is None:
        memory.note = "the GPU's memory is not known here: no memory guard"
        return memory, []
    memory.limit_mb = round(limit, 1)
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
    """The defaults the guard may back off, costliest first: memory-increasing, nobody asked for them.
    A toggle adds memory where its share of the peak's change is positive, or where its term is
    (a toggle whose term sits below the peak now may be the next to tip it once another is backed
    off); costliest by share, then by term."""
    def cost(dest: str) -> tuple[float, float]:
        return memory.deltas.get(dest) or 0.0, memory.terms.get(dest) or 0.0

    costly = sorted((d for d in memory.deltas if max(cost(d)) > 0), key=lambda d: tuple(-c for c in cost(d)))
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
        reason = (f"memory: stock (estimated peak {size_words(fit.peak(fit.base))}) {VERDICT_WORDS[stock_v]} "
                  f"({where}), but with the defaults the job {VERDICT_WORDS[now]} (planned peak "
                  f"{size_words(fit.peak(values))}); this default adds {delta_words(memory.deltas[dest])}, so it is "
                  f"backed off to stock's {format_value(fit.base[dest])} to {goal} ({HEADROOM_VAR} sets the headroom)")
        decisions[dest] = Decision(fit.base[dest], "guard", reason)
        values[dest] = fit.base[dest]
        _priced(memory, fit, values)
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
           if memory.expandable_refused and min(fit.peak(fit.base), fit.peak(values)) <= fit.limit else "")
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
