"""Where a plan's peak is (which pipeline stage, which phase of the step), and each toggle's share of
its change against stock's peak.

The peak a plan reports is the largest of a few figures. For each pipeline stage priced (the last,
and where PP > 1 the first and any middle rank an uneven split gives other layers:
``Layout.priced_stages``) there are two: forward and backward (the stage's stock peak plus every toggle's
term on that stage) and the optimizer step (what outlives a step, the persistent toggles' terms and
the step's fp32 gradient copies: ``model.step_peak``). A toggle's term (``model.toggle_delta_mb``) is
what it changes where it acts, and that is not always what it changes in the reported peak: a term
on a stage or phase below the peak changes nothing there, and a term that lifts another figure above
the peak moves the peak to it (bf16 gradient reduction without the distributed optimizer: half the
gradient buffer in the backward, an fp32 copy of every gradient in the step).

So the tables show each toggle's *share*: the change in the reported peak as the plan's values
replace stock's one toggle at a time, in the table's order (an implementation before the fusion
that runs it: ``model.PRICED_WITH``). The shares add up to the planned peak less stock's peak,
exactly, and the row whose toggle moves the peak says where to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..registry import TOGGLES
from .model import PRICED_WITH, Estimate, step_peak, toggle_delta_mb

STAGE_WORDS = {"last": "the last pipeline stage", "first": "the first pipeline stage"}


def stage_words(stage: str) -> str:
    """``the first pipeline stage``; a middle one by its pipeline rank, counted from 0 as Megatron
    counts them: ``the rank 2 pipeline stage`` (an uneven split can make it the busiest)."""
    return STAGE_WORDS.get(stage) or f"the {stage} pipeline stage"


def is_stage(name: object) -> bool:
    """Whether a record's value names a pipeline stage (``last``, ``first``, ``rank N``)."""
    return isinstance(name, str) and (name in STAGE_WORDS or (name.startswith("rank ") and name[5:].isdigit()))
PHASE_WORDS = {"training": "in forward and backward", "step": "at the optimizer step"}
PLACE_WORDS = {"training": "forward and backward", "step": "the optimizer step"}


@dataclass(frozen=True, slots=True)
class Spot:
    """One figure a plan's peak is the largest of: a pipeline stage, a phase of the step, its MB."""

    stage: str  # last | first | rank N (core.memory.memory_layout names them)
    phase: str  # training (forward and backward) | step (the optimizer step)
    mb: float

    def words(self, pp: int) -> str:
        """``at the optimizer step``; with pipeline parallelism ``on the first pipeline stage, in
        forward and backward``."""
        return PHASE_WORDS[self.phase] if pp == 1 else f"on {stage_words(self.stage)}, {PHASE_WORDS[self.phase]}"

    def place(self, pp: int) -> str:
        """Where to, for a peak that moves: ``the optimizer step``; with pipeline parallelism
        ``the first stage's forward and backward`` (``the rank 2 stage's ...`` for a middle one)."""
        phase = PLACE_WORDS[self.phase]
        return phase if pp == 1 else f"the {self.stage} stage's {phase.removeprefix('the ')}"

    def same_place(self, other: Spot) -> bool:
        return (self.stage, self.phase) == (other.stage, other.phase)


def spots(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any, te: bool,
          dests: Iterable[str] | None = None) -> list[Spot]:
    """Every figure the peak is the largest of, under these toggle values (``dests``: the toggles
    priced, default the registry's): per stage, forward and backward, then the optimizer step."""
    names = list(dests) if dests is not None else [t.dest for t in TOGGLES]
    out = []
    for stage, stage_mb in (estimate.stages or {"last": estimate.peak_mb}).items():
        deltas = {d: toggle_delta_mb(d, values, stock, layout, te, stage=stage) for d in names}
        out.append(Spot(stage, "training", stage_mb + sum(d for d in deltas.values() if d is not None)))
        step = step_peak(estimate, deltas, layout, values, stage)
        if step is not None:
            out.append(Spot(stage, "step", step))
    return out


def planned_peak(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any, te: bool,
                 dests: Iterable[str] | None = None) -> float:
    """The plan's peak MB: the largest of the stages' and phases' figures (``peak``). Adding the last
    stage's changes to stock's peak would price a first-stage peak with logits it does not hold."""
    return peak(estimate, values, stock, layout, te, dests).mb


def peak(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any, te: bool,
         dests: Iterable[str] | None = None) -> Spot:
    """The plan's peak: the largest figure (the first of equal ones, forward and backward first)."""
    return max(spots(estimate, values, stock, layout, te, dests), key=lambda spot: spot.mb)


def stage_peaks(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
                te: bool, dests: Iterable[str] | None = None) -> dict[str, float]:
    """Each priced pipeline stage's peak, the larger of its two phases: ``last``, and ``first`` (and
    any ``rank N``) where PP > 1."""
    out: dict[str, float] = {}
    for spot in spots(estimate, values, stock, layout, te, dests):
        out[spot.stage] = max(out.get(spot.stage, spot.mb), spot.mb)
    return out


def share_order() -> list[str]:
    """The order the plan's values join stock's: the table's, with a toggle that another is priced
    with (its implementation) just before that one."""
    order = [t.dest for t in TOGGLES if t.dest not in PRICED_WITH.values()]
    for fused, impl in PRICED_WITH.items():
        order.insert(order.index(fused), impl)
    return order


@dataclass(slots=True)
class Shares:
    """Each toggle's share of the peak's change (``None``: its term is not modelled), where stock
    and the plan peak, and the toggles whose share moved the peak (dest -> where to)."""

    mb: dict[str, float | None] = field(default_factory=dict)
    stock: Spot | None = None
    planned: Spot | None = None
    moved: dict[str, Spot] = field(default_factory=dict)


def shares(estimate: Estimate, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Any,
           te: bool) -> Shares:
    """The plan's values replace stock's one toggle at a time (``share_order``); each toggle's share
    is what that step changes in the reported peak. They add up to the plan's peak less stock's."""
    current = {**values, **{dest: stock.get(dest) for dest in share_order()}}
    before = peak(estimate, current, stock, layout, te)
    out = Shares(stock=before)
    for dest in share_order():
        current[dest] = values.get(dest)
        after = peak(estimate, current, stock, layout, te)
        known = toggle_delta_mb(dest, values, stock, layout, te) is not None
        out.mb[dest] = round(after.mb - before.mb, 1) if known else None
        if not after.same_place(before):
            out.moved[dest] = after
        before = after
    out.planned = before
    return out
