"""What the layer-level check will measure for one plan: a row per toggle asked about, each either
a measurement (the toggle, its unit, the two arms) or the one-line reason it is not measured.

Pure: it reads the plan's decisions and the parsed arguments, never Megatron or a GPU, so the
check's CPU mode prints exactly the list the GPU mode then runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...core.decision.plan import Plan
from ...core.registry import Toggle
from ...errors import PerfTogglesError, did_you_mean
from .shard import Shard
from .units import Unit, measurable, unit_of, units_per_microbatch

MEASURE = "measure"


@dataclass(frozen=True, slots=True)
class Row:
    """One toggle: measured (``status`` MEASURE) or why not, with the unit and its count per micro-batch."""

    toggle: Toggle
    unit: Unit
    status: str  # MEASURE, or the reason in one line
    per_microbatch: int  # how many units run per micro-batch on one rank

    @property
    def measured(self) -> bool:
        return self.status == MEASURE


def asked(names: Sequence[str] | None) -> tuple[Toggle, ...]:
    """The toggles named (registry dests, comma lists allowed), or every measurable one."""
    pool = measurable()
    if not names:
        return pool
    wanted = [n.strip() for name in names for n in name.split(",") if n.strip()]
    known = {t.dest for t in pool}
    for name in wanted:
        if name not in known:
            raise PerfTogglesError(f"--toggles: {name!r} is not a toggle the layer check measures; "
                                   f"{did_you_mean(name, sorted(known))}one of {', '.join(sorted(known))}")
    return tuple(t for t in pool if t.dest in wanted)


def why_not(toggle: Toggle, unit: Unit, plan: Plan, args: Mapping[str, Any], shard: Shard) -> str:
    """Empty where the toggle can be measured on one GPU for this plan, else the one-line reason."""
    if unit.needs_ranks:
        return "needs 2 or more ranks: it acts in the data-parallel reduction, which one GPU does not have"
    if toggle.dest in plan.not_applicable or (toggle.scope == "moe" and not shard.experts):
        return "does not apply to this model (no --num-experts)"
    decision = plan.decisions.get(toggle.dest)
    if decision is not None and decision.value is not True:
        return f"off in this plan ({decision.source}): {decision.reason}"
    return _unit_cannot(unit.name, args, shard)


def _unit_cannot(unit: str, args: Mapping[str, Any], shard: Shard) -> str:
    """Why this layout's unit cannot be built as one rank holds it ("" where it can)."""
    if args.get("transformer_impl") != "transformer_engine" and unit in ("layer_wgrad", "attention"):
        return "measured with Transformer Engine layers only (--transformer-impl transformer_engine)"
    if unit == "attention" and args.get("position_embedding_type") != "rope":
        return "acts only with RoPE (--position-embedding-type rope)"
    if unit in ("attention", "layer_wgrad") and shard.cp > 1:
        return (f"CP {shard.cp}: a rank attends its share of the queries to keys passed round the ring, which one "
                "GPU does not build")
    if unit == "output_loss" and not shard.vocab:
        return "the vocabulary's size is not known before the tokenizer is built: pass --vocab-size"
    topk = int(args.get("moe_router_topk") or 2)
    if unit in ("moe_layer", "layer_wgrad") and shard.experts and topk > shard.local_experts:
        return (f"top-{topk} over the rank's {shard.local_experts} local experts cannot be built at EP 1: "
                "measure at a smaller --expert-model-parallel-size")
    if unit == "dispatcher" and args.get("moe_token_dispatcher_type") == "allgather" and shard.etp * shard.ep > 1:
        return ("the allgather dispatcher permutes the tokens gathered over ETP x EP ranks for its local experts, "
                "which one GPU does not build")
    return ""


def rows(plan: Plan, args: Mapping[str, Any], shard: Shard, names: Sequence[str] | None = None) -> list[Row]:
    """A row per toggle asked about, in registry order."""
    out = []
    for toggle in asked(names):
        unit = unit_of(toggle)
        assert unit is not None  # measurable() keeps toggles with a unit
        reason = why_not(toggle, unit, plan, args, shard)
        out.append(Row(toggle, unit, reason or MEASURE, units_per_microbatch(unit, args)))
    return out


def microbatches_per_step(args: Mapping[str, Any]) -> int:
    """Micro-batches one rank runs per training step: global batch / (micro-batch x data-parallel size)."""
    world = int(args.get("world_size") or 1)
    model = 1
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        model *= int(args.get(dest) or 1)
    dp = max(1, world // model)
    mbs = int(args.get("micro_batch_size") or 1)
    gbs = int(args.get("global_batch_size") or mbs * dp)
    return max(1, gbs // (mbs * dp))


def bf16_main_grads(plan: Plan) -> bool:
    """Whether the plan keeps gradient buffers in bf16 (the main_grad dtype the wgrad unit uses)."""
    decision = plan.decisions.get("grad_reduce_in_bf16")
    return bool(decision and decision.value is True)

