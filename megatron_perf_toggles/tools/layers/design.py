"""What the layer-level check will measure for one plan: a row per unit of each toggle asked about
(a toggle acting in two modules has two rows), each either a measurement (the toggle, the unit, the
two arms) or the one-line reason it is not measured.

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
from .units import Unit, measurable, units_of, units_per_microbatch

MEASURE = "measure"


@dataclass(frozen=True, slots=True)
class Row:
    """One unit of one toggle: measured (``status`` MEASURE) or why not, with its count per micro-batch."""

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
    if unit in ("output_loss", "output_wgrad") and not shard.vocab:
        return "the vocabulary's size is not known before the tokenizer is built: pass --vocab-size"
    if unit == "output_wgrad":
        return _output_layer_cannot(args)
    topk = int(args.get("moe_router_topk") or 2)
    if unit in ("moe_layer", "layer_wgrad") and shard.experts and topk > shard.local_experts:
        return (f"top-{topk} over the rank's {shard.local_experts} local experts cannot be built at EP 1: "
                "measure at a smaller --expert-model-parallel-size")
    if unit == "dispatcher" and args.get("moe_token_dispatcher_type") == "allgather" and shard.etp * shard.ep > 1:
        return ("the allgather dispatcher permutes the tokens gathered over ETP x EP ranks for its local experts, "
                "which one GPU does not build")
    return ""


def _output_layer_cannot(args: Mapping[str, Any]) -> str:
    """Why the output layer's unit cannot set stock against the fusion ("" where it can). Under TP the
    check builds the last stage's slice of the vocabulary (``shard``), so no layout is out of reach
    for its size; two settings change the layer itself."""
    if args.get("defer_embedding_wgrad_compute"):
        return ("--defer-embedding-wgrad-compute: the output layer's weight gradient waits for the pipeline flush "
                "and Megatron refuses it without the fusion, so there is no stock arm")
    if args.get("fp8_output_proj") and args.get("fp8") and str(args.get("fp8_recipe")).endswith("mxfp8"):
        return ("--fp8-output-proj with the mxfp8 recipe: the output layer is Transformer Engine's, which this "
                "unit does not build")
    return ""


def rows(plan: Plan, args: Mapping[str, Any], shard: Shard, names: Sequence[str] | None = None) -> list[Row]:
    """A row per unit of each toggle asked about, in registry order (a toggle's units in its order)."""
    return [Row(toggle, unit, why_not(toggle, unit, plan, args, shard) or MEASURE, units_per_microbatch(unit, args))
            for toggle in asked(names) for unit in units_of(toggle)]


def by_toggle(todo: Sequence[Row]) -> dict[str, list[Row]]:
    """The rows of each toggle, in order: what the record and the step-share sum group by."""
    out: dict[str, list[Row]] = {}
    for row in todo:
        out.setdefault(row.toggle.dest, []).append(row)
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

