"""Peak allocated memory per GPU: what each toggle value adds to stock Megatron's, and stock's own.

Pure arithmetic over the parsed arguments (no torch, no Megatron): a plan can show, before anything
runs, what every decision costs in memory. Units are MB of 2**20 bytes, as torch's
``max_memory_allocated`` and Megatron's memory report count them. Every figure is for one GPU of a
pipeline stage (``stage``: ``last``, ``first`` or ``rank N``, ``core.memory.memory_layout``), by
default the last (it holds the output layer and the logits); stock's peak is worked out for every
stage that may hold the most (``Layout.priced_stages``), with each stage's own layers, so an uneven
pipeline split is priced as it is built.

Each term below names the code path in Megatron-LM (and Transformer Engine) that creates the tensor
it counts; docs/memory.md has the derivations and the H200 validation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import memory_moe
from .memory_layout import Layout, Unknown, layout_from_args, padded_vocab
from .memory_moe import BF16, FP32, MB, MOE_DESTS, Moe

__all__ = ["BF16", "FP32", "MB", "MOE_DESTS", "PRICED_WITH", "Estimate", "Layout", "Moe", "Unknown",
           "layout_from_args", "padded_vocab", "stock_peak", "toggle_delta_mb"]


# --- the toggles' terms: each one's change in peak allocated MB against its stock value ----------


def fp32_logits_mb(layout: Layout) -> float:
    """One fp32 copy of one micro-batch's logits on one rank: 4 B x tokens x vocabulary / TP."""
    return FP32 * layout.tokens * layout.vocab_per_rank / MB


def cross_entropy_mb(layout: Layout, fused: bool, impl: str) -> float:
    """Cross entropy against stock's unfused path, which upcasts the bf16 logits once (the
    ``.float()`` at the start of the vocab-parallel cross entropy) and keeps that fp32 tensor, turned
    into the softmax in place, for the backward.

    native: Megatron's fused version (fusions/fused_cross_entropy.py) runs the same steps inside
    ``jit_fuser`` functions, which are ``torch.compile``d (torch >= 2.2). The forward keeps the
    upcast tensor, as stock does. The backward's compiled function changes the saved fp32 softmax in
    place (subtract one at the target, scale by the incoming gradient) and returns it cast to bf16;
    the compiled graph computes that result into a fresh fp32 buffer of the logits' size and copies
    it back into the saved tensor, so for a moment the softmax, that buffer and the bf16 gradient
    are all alive: one more fp32 copy of the logits than stock's eager in-place steps.
    +4 B x tokens x vocab / TP.

    te: Transformer Engine's parallel cross entropy (a Triton kernel) reads the bf16 logits, keeps
    its sums in fp32 registers and writes the gradient into a bf16 tensor: no fp32 copy of the
    logits at all. Its peak holds two bf16 logits-sized tensors where stock's holds the fp32
    softmax and a bf16 one: -2 B x tokens x vocab / TP, as measured on the H200 (Megatron 0.18,
    TE 2.20: te 24000 MB below native on a 16384-token, 256000-vocabulary micro-batch, where
    native is +4 B and te -2 B).
    """
    if not fused:
        return 0.0
    return fp32_logits_mb(layout) if impl == "native" else -fp32_logits_mb(layout) / 2


def dummy_wgrads_mb(layout: Layout, stage: str = "last") -> float:
    """What gradient accumulation fusion adds where Transformer Engine is installed.

    With fusion, a linear layer's weight-gradient GEMM accumulates into ``main_grad`` directly, and
    the autograd function still returns a placeholder gradient of the weight's shape (in the
    activations' dtype) so the DDP backward hooks fire on the main thread. Megatron's own layers
    (the output layer, tensor_parallel/layers.py) and TE's linear modules take that placeholder from
    TE's ``get_dummy_wgrad``, which caches ONE tensor per (shape, dtype) for the rest of the job. So
    the cost is one bf16 weight-sized tensor per distinct weight shape on the stage's rank: the
    output layer's (vocab/TP x hidden) on the last stage plus one of each of its layers' QKV,
    projection, FC1 and FC2 weights.

    Without fusion the weight gradient is a transient bf16 tensor that the hook adds into
    ``main_grad`` and frees: nothing persists. Reference model (hidden 4096, ffn 14336, 32 heads,
    8 KV groups, vocab 128256, TP 1): 2 B x (128256x4096 + 6144x4096 + 4096x4096 + 28672x4096 +
    4096x14336) = 1002 + 416 = 1418 MB.
    """
    shapes = layout.weight_shapes(stage)  # experts too: TE's grouped linear asks the same one-per-shape cache
    if stage == "last":  # tied too: the output layer then runs the shared embedding weight through the same path
        shapes.add((layout.vocab_per_rank, layout.hidden))
    return BF16 * sum(r * c for r, c in shapes) / MB


def grad_reduce_bf16_mb(layout: Layout, stage: str = "last") -> float:
    """bf16 gradient reduction: the distributed data-parallel gradient buffers
    (distributed/param_and_grad_buffer.py) hold every parameter's gradient in bf16 instead of fp32
    (stock bf16 training sets accumulate_allreduce_grads_in_fp32). -2 B x parameters on the rank.

    The optimizer step then upcasts the bf16 gradients into fp32 main gradients (``step_upcast_mb``);
    that is a peak of its own, after the activations are gone, priced beside the training peak
    (``step_peak``), so the term here is the buffer's saving alone."""
    if not layout.fp32_grad_buffer:  # fp16/fp32 training, or bf16 main grads: the flag changes nothing
        return 0.0
    return -BF16 * layout.stage_params(stage) / MB


def step_upcast_mb(layout: Layout, values: Mapping[str, Any], stage: str = "last") -> float:
    """The optimizer step's fp32 copies of bf16 gradients: with a bf16 gradient buffer, Megatron's
    optimizers hand each main parameter ``grad.float()`` (optimizer/distrib_optimizer.py
    ``_copy_model_grads_to_main_grads``: the rank's shard, over DP x CP for dense parameters and over
    the expert data-parallel group for the experts'; optimizer.py: every parameter), alive together
    until the step ends. With stock's fp32 buffer ``.float()`` is the buffer itself: nothing."""
    if not layout.fp32_grad_buffer or not values.get("grad_reduce_in_bf16"):
        return 0.0
    dense, expert = layout.stage_param_split(stage)
    if layout.distributed_optimizer:
        shard = dense / (layout.dp * layout.cp) + (expert / layout.moe.edp if layout.moe is not None else 0)
    else:
        shard = dense + expert
    return FP32 * shard / MB


ZERO_TERMS = ("ddp_average_in_collective", "fused_single_qkv_rope")  # measured 0 MB on the H200
# A toggle priced with another's value as the plan sets it (the fusion with the plan's
# implementation): fused dest -> the dest it is priced with (core.memory.peaks orders by it).
PRICED_WITH = {"cross_entropy_loss_fusion": "cross_entropy_fusion_impl"}
# The toggles whose change persists through the optimizer step (buffers, cached placeholders,
# workspaces); the others change what a micro-batch holds, gone by the step.
PERSISTENT_TERMS = ("gradient_accumulation_fusion", "grad_reduce_in_bf16", "moe_grouped_gemm")
PERSISTENT_PARTS = ("weights_and_optimizer", "fp8_weights", "placeholder_wgrads", "moe_buffers")


def toggle_delta_mb(dest: str, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Layout,
                    te_installed: bool, stage: str = "last") -> float | None:
    """The change in peak MB that ``values[dest]`` makes against ``stock[dest]`` on a rank of the
    pipeline stage (the last by default; another holds no logits). The terms add
    up to the plan's change: the cross-entropy pair is priced as the fusion (with this plan's
    implementation) plus the implementation (where stock fuses too). None: not modelled."""
    if dest in ZERO_TERMS:
        return 0.0
    if dest in MOE_DESTS:
        return moe_toggle_delta_mb(dest, values, stock, layout, te_installed, stage)
    if dest == "gradient_accumulation_fusion":
        now, before = bool(values.get(dest)), bool(stock.get(dest))
        if now == before:
            return 0.0
        if not te_installed:
            return None  # without TE, Megatron makes a fresh placeholder per call: not modelled
        return (now - before) * dummy_wgrads_mb(layout, stage)
    if dest == "grad_reduce_in_bf16":
        now, before = bool(values.get(dest)), bool(stock.get(dest))
        return (now - before) * grad_reduce_bf16_mb(layout, stage)
    if stage != "last" and dest in ("cross_entropy_loss_fusion", "cross_entropy_fusion_impl"):
        return 0.0  # only the last stage computes the loss
    fused, impl = bool(values.get("cross_entropy_loss_fusion")), str(values.get("cross_entropy_fusion_impl", "native"))
    stock_fused = bool(stock.get("cross_entropy_loss_fusion"))
    if dest == "cross_entropy_loss_fusion":  # with this plan's implementation
        return cross_entropy_mb(layout, fused, impl) - cross_entropy_mb(layout, stock_fused, impl)
    if dest == "cross_entropy_fusion_impl":  # only where stock fuses too: the two add up to the pair's change
        return cross_entropy_mb(layout, stock_fused, impl) - cross_entropy_mb(
            layout, stock_fused, str(stock.get(dest, "native")))
    return None


def moe_toggle_delta_mb(dest: str, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Layout,
                        te_installed: bool, stage: str = "last") -> float | None:
    """An MoE toggle's change (``core.memory.memory_moe.toggle_delta_mb``) on the stage's MoE layers, each
    holding the activations of the micro-batches in flight there (``Layout.in_flight``: one on the
    last stage, PP on the first, PP - rank on a middle one): 0 where the stage has no MoE layer (a
    dense model included); None without Transformer Engine, whose kernels all three toggles run
    (Megatron's own fallbacks are not modelled)."""
    moe_layers = layout.moe_layers(stage)
    if layout.moe is None or not moe_layers or bool(values.get(dest)) == bool(stock.get(dest)):
        return 0.0
    if not te_installed:
        return None
    in_flight = moe_layers * layout.in_flight(stage)
    return memory_moe.toggle_delta_mb(dest, values, stock, layout.moe, layout.hidden, layout.tokens, layout.tp,
                                      layout.sequence_parallel, in_flight)


# --- stock's own peak ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Estimate:
    """Stock Megatron's peak allocated MB for a layout, the parts it adds up, and whose formula."""

    peak_mb: float
    source: str
    parts: dict[str, float]
    # each priced stage's peak (Layout.priced_stages): "last", and "first" and any "rank N" where PP > 1
    stages: dict[str, float] = field(default_factory=dict)
    kept: dict[str, float] = field(default_factory=dict)  # each stage's memory that outlives a step (PERSISTENT_PARTS)


def step_peak(estimate: Estimate, deltas: Mapping[str, float | None], layout: Layout, values: Mapping[str, Any],
              stage: str) -> float | None:
    """A stage's peak in the optimizer step, under these toggle values (``deltas``: each toggle's
    change on that stage): what outlives the step plus the persistent toggles' changes and the
    step's fp32 gradient copies. Where the activations are small against the parameters (MoE
    models often) this, not the backward, is the peak. None where the estimate has no such figure."""
    kept = estimate.kept.get(stage)
    if kept is None:
        return None
    persistent = sum(v for d, v in deltas.items() if v is not None and d in PERSISTENT_TERMS)
    return kept + persistent + step_upcast_mb(layout, values, stage)


MEGATRON_FORMULA = ("Megatron's theoretical memory formula (training/theoretical_memory_usage.py) for weights, "
                    "optimizer and layer activations, with the plugin's logits term")
PLUGIN_ESTIMATE = "the plugin's own estimate: Megatron's weight and optimizer formula, the plugin's activations"


def bytes_per_param(layout: Layout) -> float:
    """Megatron's theoretical memory report: bf16 weight, fp32 gradient, fp32 main weight and two
    Adam moments = 18 B, of which the distributed optimizer shards the 12 B of optimizer state. It
    shards them over the data- and context-parallel ranks together (the optimizer's intra_dp_cp
    group), where the report divides by the data-parallel size alone."""
    return 6 + 12 / (layout.dp * layout.cp) if layout.distributed_optimizer else 18


def layer_activation_bytes(layout: Layout) -> tuple[float, bool]:
    """One layer's saved activations for one micro-batch, and whether Megatron's own formula applies.

    Megatron's formula (Korthikanti et al., Table 2, as its theoretical memory report writes it) is
    s*b*h*(18 + 4*ffn/h) / TP, for sequence parallelism with selective recompute. Without sequence
    parallelism the 10*s*b*h of norms, residuals and dropout masks is not divided by TP; with flash
    attention (TE's default) there is no s^2 term to recompute, so plain and selective are alike.
    Full recompute keeps only each layer's input."""
    sbh = layout.seq // layout.cp * layout.micro_batch * layout.hidden
    if layout.recompute == "full":
        return BF16 * sbh / (layout.tp if layout.sequence_parallel else 1), False
    split = 8 + 4 * layout.ffn / layout.hidden
    if layout.sequence_parallel:
        return sbh * (10 + split) / layout.tp, layout.recompute == "selective"
    return sbh * (10 + split / layout.tp), False


def moe_layer_activation_bytes(layout: Layout, values: Mapping[str, Any]) -> float:
    """One MoE layer's saved activations for one micro-batch: the dense layer's without its MLP
    (attention, the norms, residuals and masks: ``layer_activation_bytes`` with no FFN) plus the
    MoE part under the MoE toggles' ``values`` (``core.memory.memory_moe.moe_layer_bytes``). Full
    recompute keeps the layer's input only, as for a dense layer."""
    if layout.moe is None:
        raise ValueError("a dense layout has no MoE layer")
    if layout.recompute == "full":
        return layer_activation_bytes(layout)[0]
    attention = layer_activation_bytes(dataclasses.replace(layout, ffn=0))[0]
    return attention + memory_moe.moe_layer_bytes(layout.moe, layout.hidden, layout.tokens, layout.tp,
                                                  layout.sequence_parallel, layout.swiglu, values)


def _stage_parts(layout: Layout, stage: str, grad_accum_fusion: bool, te_installed: bool,
                 moe_values: Mapping[str, Any]) -> dict[str, float]:
    """One pipeline stage's parts of stock's peak (``stock_peak``): its own layers (``Layout``'s
    split), the micro-batches in flight there, the embedding's output on the first stage and the
    logits on the last."""
    rank = layout.stage_rank(stage)
    last, first, in_flight = rank == layout.pp - 1, rank == 0, layout.in_flight(stage)
    per_layer = layer_activation_bytes(layout)[0]
    sbh = layout.tokens * layout.hidden
    dense, expert = layout.stage_param_split(stage)
    moe_n = layout.moe_layers(stage)
    weights = dense * bytes_per_param(layout)
    if layout.moe is not None:
        weights += expert * memory_moe.expert_bytes_per_param(layout.moe, layout.distributed_optimizer)
    activations = (layout.layer_count(stage) - moe_n) * per_layer
    if moe_n:
        activations += moe_n * moe_layer_activation_bytes(layout, moe_values)
    parts = {"weights_and_optimizer": weights / MB, "activations": in_flight * activations / MB}
    if last:
        parts["logits"] = (FP32 + BF16) * layout.tokens * layout.vocab_per_rank / MB + FP32 * sbh / MB
    if first:
        parts["embedding_output"] = in_flight * BF16 * sbh / MB
    if layout.fp8:  # 1 B per linear weight of the stage's layers (the output layer stays bf16)
        parts["fp8_weights"] = layout.stage_linear_weights(stage) / MB
    if grad_accum_fusion and te_installed:
        parts["placeholder_wgrads"] = dummy_wgrads_mb(layout, stage)
    if moe_n and layout.moe is not None:
        buffers = memory_moe.persistent_mb(layout.moe, layout.hidden, layout.tokens, layout.tp,
                                           layout.sequence_parallel, moe_values)
        if buffers:
            parts["moe_buffers"] = sum(buffers.values())
    return parts


def stock_peak(layout: Layout, grad_accum_fusion: bool, te_installed: bool,
               moe_values: Mapping[str, Any] | None = None) -> Estimate:
    """Stock's peak on the busiest pipeline stage (of ``Layout.priced_stages``: the last, the first,
    and a middle rank whose layers differ from theirs): weights and optimizer state of its layers,
    their saved activations (PP - rank micro-batches in flight: PP on the first stage, one on the
    last; MoE layers priced under stock's MoE toggles, ``moe_values``, Megatron's defaults (all off)
    where not given), on the last stage the logits as stock's unfused cross entropy holds them (the
    bf16 output plus its fp32 copy, 6 B x tokens x vocab / TP), the placeholder gradients if fusion
    is on, and the buffers MoE layers keep."""
    megatron_applies = layer_activation_bytes(layout)[1] and layout.moe is None
    stages = {name: _stage_parts(layout, name, grad_accum_fusion, te_installed, moe_values or {})
              for name in layout.priced_stages()}
    parts = max(stages.values(), key=lambda p: sum(p.values()))
    source = MEGATRON_FORMULA if megatron_applies else PLUGIN_ESTIMATE
    totals = {name: round(sum(p.values()), 1) for name, p in stages.items()}
    kept = {name: round(sum(v for k, v in p.items() if k in PERSISTENT_PARTS), 1) for name, p in stages.items()}
    return Estimate(round(sum(parts.values()), 1), source, {k: round(v, 1) for k, v in parts.items()}, totals, kept)
