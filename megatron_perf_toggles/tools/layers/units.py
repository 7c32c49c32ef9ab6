"""Where each toggle acts: the units the layer-level check builds and times for it.

A toggle names its units in the registry (``Toggle.acts_in``: most act in one module, gradient
accumulation fusion in two, every layer's weight gradients and the output layer's); this table says
what each unit is, how often it runs in one micro-batch's forward and backward on one rank (so that
the time it saves per call becomes a share of a step), and whether one GPU can measure it at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core.registry import TOGGLES, Toggle


@dataclass(frozen=True, slots=True)
class Unit:
    """One module the check builds: what it is, and how many run per micro-batch on one rank."""

    name: str
    what: str  # one line for people: the module built and what is timed
    per: str  # "layer" (each layer of the rank's stage), "moe_layer" (its MoE layers), "model" (once), "ranks"
    needs_ranks: bool = False  # acts only between data-parallel ranks: one GPU cannot measure it


UNITS: dict[str, Unit] = {u.name: u for u in (
    Unit("router", "the MoE router (TopKRouter: gate GEMM, score function, top-k, aux loss or expert bias "
         "as configured), forward and backward", "moe_layer"),
    Unit("dispatcher", "the dispatcher's permute and unpermute of the rank's tokens over all experts "
         "(moe_utils.permute/unpermute as the alltoall and allgather dispatchers call them at EP 1), "
         "forward and backward", "moe_layer"),
    Unit("moe_layer", "one MoE layer (router, dispatcher at EP 1 and the rank's local experts), forward and "
         "backward", "moe_layer"),
    Unit("attention", "self-attention (QKV projection, RoPE, core attention, output projection), forward "
         "and backward with RoPE embeddings", "layer"),
    Unit("output_loss", "the output layer's GEMM and the vocab-parallel cross entropy (Megatron's own loss "
         "function), forward and backward", "model"),
    Unit("layer_wgrad", "one transformer layer (attention and its MLP, or its MoE block with the rank's local "
         "experts), forward and backward, weight gradients accumulated into fp32 (or bf16) main_grad buffers as "
         "Megatron's DDP does; the output layer's weight gradient is the output_wgrad unit", "layer"),
    Unit("output_wgrad", "the output layer as the last stage builds it (Megatron's ColumnParallelLinear over the "
         "rank's vocabulary slice, its weight with a main_grad buffer), forward and backward, the fused arm's weight "
         "gradient through APEX's kernel or the plugin's torch fallback as a run installs it; tied embeddings "
         "(no --untie-embeddings-and-output-weights) lend it the word embedding's weight and accumulate into that "
         "weight's main_grad through the same GEMM, so it acts either way", "model"),
    Unit("dp_reduce", "the data-parallel gradient reduction", "ranks", needs_ranks=True),
)}


def units_of(toggle: Toggle) -> tuple[Unit, ...]:
    """The units a toggle acts in, in the registry's order (none: a choice measured with its toggle)."""
    return tuple(UNITS[name] for name in toggle.acts_in)


def measurable() -> tuple[Toggle, ...]:
    """The default-on on/off toggles, in registry order: those the check can be asked about."""
    return tuple(t for t in TOGGLES if t.kind == "bool" and t.default is True and t.acts_in)


def units_per_microbatch(unit: Unit, args: Mapping[str, Any]) -> int:
    """How many times ``unit`` runs in one micro-batch on one rank of the layout in ``args``: every
    layer of the rank's pipeline stage, its MoE layers, or once for the model's output (the last
    stage)."""
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    layers = max(1, int(args.get("num_layers") or 1) // pp)
    if unit.per == "model":
        return 1
    if unit.per == "moe_layer":
        return moe_layers_per_stage(args, layers)
    return layers


def moe_layers_per_stage(args: Mapping[str, Any], layers: int) -> int:
    """MoE layers on one stage: all of them unless ``--moe-layer-freq`` names a pattern or a period
    (every freq-th layer from the first, as Megatron counts ``i % freq == 0``: rounded up)."""
    freq = args.get("moe_layer_freq")
    if isinstance(freq, int) and freq > 1:
        return max(1, -(-layers // freq))
    if isinstance(freq, (list, tuple)) and freq:
        pp = int(args.get("pipeline_model_parallel_size") or 1)
        return max(1, sum(1 for x in freq if x) // pp)
    return layers
