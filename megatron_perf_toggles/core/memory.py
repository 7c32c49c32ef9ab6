"""Peak allocated memory per GPU: what each toggle value adds to stock Megatron's, and stock's own.

Pure arithmetic over the parsed arguments (no torch, no Megatron): a plan can show, before anything
runs, what every decision costs in memory. Units are MB of 2**20 bytes, as torch's
``max_memory_allocated`` and Megatron's memory report count them. Every figure is for the GPU that
holds the most, which for the toggles' terms is a rank of the last pipeline stage (it holds the
output layer and the logits).

Each term below names the code path in Megatron-LM (and Transformer Engine) that creates the tensor
it counts; docs/memory.md has the derivations and the H200 validation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import memory_moe
from .memory_moe import BF16, FP32, MB, MOE_DESTS, Moe, MoeUnknown, moe_from_args


@dataclass(frozen=True, slots=True)
class Layout:
    """The few facts about a dense GPT job that peak memory depends on, per rank."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    query_groups: int
    kv_channels: int
    seq: int
    micro_batch: int
    padded_vocab: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    untied: bool = True
    swiglu: bool = True
    distributed_optimizer: bool = False
    recompute: str | None = None  # None | "selective" | "full"
    bias: bool = False
    fp8: bool = False  # TE keeps an fp8 copy of each transformer layer's linear weights
    fp32_grad_buffer: bool = True  # stock's gradient buffer is fp32 (bf16 training with fp32 main grads)
    unfused_attention: bool = False  # --transformer-impl local: attention scores are materialised
    moe: Moe | None = None  # the mixture-of-experts layers (core.memory_moe); None: a dense model

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank: the logits' rows (the output layer gathers the
        sequence-parallel shards back, so SP does not divide them; CP does)."""
        return self.seq // self.cp * self.micro_batch

    @property
    def vocab_per_rank(self) -> int:
        return self.padded_vocab // self.tp

    @property
    def stage_layers(self) -> int:
        return math.ceil(self.layers / self.pp)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """Each distinct weight matrix of one transformer layer on this rank (rows, columns)."""
        q = self.heads * self.kv_channels
        kv = 2 * self.query_groups * self.kv_channels
        fc1 = self.ffn * (2 if self.swiglu else 1)
        return {"qkv": ((q + kv) // self.tp, self.hidden), "proj": (self.hidden, q // self.tp),
                "fc1": (fc1 // self.tp, self.hidden), "fc2": (self.hidden, self.ffn // self.tp)}

    def layer_params(self) -> int:
        """One dense layer's parameters on this rank."""
        weights = sum(r * c for r, c in self.linear_shapes().values())
        return weights + 2 * self.hidden  # two RMSNorm/LayerNorm weights (replicated across TP)

    def attention_params(self) -> int:
        shapes = self.linear_shapes()
        return sum(r * c for name, (r, c) in shapes.items() if name in ("qkv", "proj"))

    def moe_layer_params(self) -> tuple[int, int]:
        """One MoE layer's parameters on this rank: (outside the experts: attention, the norms, the
        router and the shared experts; the local experts'), which the distributed optimizer shards
        over different groups."""
        moe = self.moe
        assert moe is not None
        dense = self.attention_params() + 2 * self.hidden + memory_moe.moe_dense_params(moe, self.hidden, self.swiglu, self.tp)
        return dense, memory_moe.expert_params(moe, self.hidden, self.swiglu)

    def stage_start(self, last: bool) -> int:
        """The first layer of the last (or the first) pipeline stage."""
        return max(self.layers - self.stage_layers, 0) if last else 0

    def moe_layers(self, last: bool = True) -> int:
        """The MoE layers on the last (or the first) pipeline stage."""
        return 0 if self.moe is None else self.moe.layers_in(self.stage_start(last), self.stage_layers)

    def stage_param_split(self, last: bool) -> tuple[int, int]:
        """Parameters on one rank of the last (or the first) stage: (dense, expert). Dense: its
        layers outside the experts, the final norm and the output layer on the last stage (its own
        weight when untied; a copy of the embedding when tied and PP > 1), the input embedding on
        the first (both when PP == 1)."""
        moe_n = self.moe_layers(last)
        dense = (self.stage_layers - moe_n) * self.layer_params()
        expert = 0
        if moe_n:
            moe_dense, expert_layer = self.moe_layer_params()
            dense, expert = dense + moe_n * moe_dense, moe_n * expert_layer
        if last:
            dense += self.hidden + self.embedding_params()
            if self.pp == 1 and self.untied:
                dense += self.embedding_params()
        elif self.pp > 1:
            dense += self.embedding_params()
        else:
            return self.stage_param_split(True)
        return dense, expert

    def weight_shapes(self) -> set[tuple[int, int]]:
        """Each distinct linear weight shape of the model's layers on this rank: attention's, the
        dense MLP's where a dense layer exists, the experts' and the shared experts' where MoE layers do."""
        shapes = self.linear_shapes()
        out = {shapes["qkv"], shapes["proj"]}
        if self.moe is None or not all(self.moe.pattern):
            out |= {shapes["fc1"], shapes["fc2"]}
        if self.moe is not None:
            out |= set(memory_moe.expert_shapes(self.moe, self.hidden, self.swiglu).values())
            out |= set(memory_moe.shared_shapes(self.moe, self.hidden, self.swiglu, self.tp).values())
        return out

    def stage_linear_weights(self, last: bool) -> int:
        """The linear layers' weights of the stage's layers (what FP8 keeps a 1-byte copy of)."""
        moe_n = self.moe_layers(last)
        dense = (self.stage_layers - moe_n) * sum(r * c for r, c in self.linear_shapes().values())
        if not moe_n:
            return dense
        moe_dense, expert = self.moe_layer_params()
        return dense + moe_n * (moe_dense - 2 * self.hidden - self.moe.experts * self.hidden + expert)  # type: ignore[union-attr]

    def embedding_params(self) -> int:
        return self.vocab_per_rank * self.hidden

    def last_stage_params(self) -> int:
        """Parameters on one rank of the last stage (``stage_param_split``), experts included."""
        return sum(self.stage_param_split(True))

    def first_stage_params(self) -> int:
        return sum(self.stage_param_split(False))


class Unknown(Exception):
    """The arguments do not describe a layout the model covers; the message says why."""


def _int(args: Mapping[str, Any], dest: str, default: int | None = None) -> int:
    value = args.get(dest)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise Unknown(f"--{dest.replace('_', '-')} is not known")
    return value


def padded_vocab(args: Mapping[str, Any]) -> int:
    """Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP
    (training/tokenizer: the padded size is computed where the tokenizer is built)."""
    padded = args.get("padded_vocab_size")
    if isinstance(padded, int) and padded > 0:
        return padded
    vocab = args.get("vocab_size")
    if not isinstance(vocab, int) or vocab <= 0:
        raise Unknown("the vocabulary size is not known before the tokenizer loads (pass --vocab-size)")
    multiple = (args.get("make_vocab_size_divisible_by") or 128) * (args.get("tensor_model_parallel_size") or 1)
    return -(-vocab // multiple) * multiple


def layout_from_args(args: Mapping[str, Any]) -> Layout:
    """The layout Megatron's parsed (and validated) namespace describes; raises Unknown for what the
    model does not cover (MLA, hybrid models, a vocabulary not known yet, the MoE variants
    ``core.memory_moe`` leaves out)."""
    for dest, words in (("multi_latent_attention", "multi-latent attention"),
                        ("hybrid_override_pattern", "hybrid (Mamba) layers"), ("mtp_num_layers", "multi-token prediction")):
        if args.get(dest):
            raise Unknown(f"{words} are not in the memory model")
    hidden = _int(args, "hidden_size")
    heads = _int(args, "num_attention_heads")
    groups = _int(args, "num_query_groups", heads) if args.get("group_query_attention") else heads
    tp = _int(args, "tensor_model_parallel_size", 1)
    pp, cp = _int(args, "pipeline_model_parallel_size", 1), _int(args, "context_parallel_size", 1)
    world = args.get("world_size")
    # validate_args sets data_parallel_size; before it, the world size (parse_args reads WORLD_SIZE) gives it
    dp_default = world // (tp * pp * cp) if isinstance(world, int) and world >= tp * pp * cp else 1
    recompute = args.get("recompute_granularity")
    dp = _int(args, "data_parallel_size", max(dp_default, 1))
    ffn, layers = _int(args, "ffn_hidden_size", 4 * hidden), _int(args, "num_layers")
    try:
        moe = moe_from_args(args, layers, ffn, tp, pp, dp * tp * pp * cp)
    except MoeUnknown as why:
        raise Unknown(str(why)) from None
    return Layout(
        hidden=hidden, ffn=ffn, layers=layers,
        heads=heads, query_groups=groups, kv_channels=_int(args, "kv_channels", hidden // heads),
        seq=_int(args, "seq_length"), micro_batch=_int(args, "micro_batch_size"), padded_vocab=padded_vocab(args),
        tp=tp, pp=pp, cp=cp, dp=dp,
        sequence_parallel=bool(args.get("sequence_parallel")) and tp > 1,
        untied=bool(args.get("untie_embeddings_and_output_weights")), swiglu=bool(args.get("swiglu")),
        distributed_optimizer=bool(args.get("use_distributed_optimizer")),
        recompute=recompute if recompute in ("selective", "full") else None,
        bias=bool(args.get("add_bias_linear", False)), fp8=bool(args.get("fp8") or args.get("fp8_format")),
        fp32_grad_buffer=_fp32_grad_buffer(args), unfused_attention=args.get("transformer_impl") == "local",
        moe=moe,
    )


def _fp32_grad_buffer(args: Mapping[str, Any]) -> bool:
    """Whether stock keeps the gradient buffer in fp32, which is what --grad-reduce-in-bf16 halves.
    validate_args reads --grad-reduce-in-bf16 only under --bf16 (there it clears
    accumulate_allreduce_grads_in_fp32); fp16 and fp32 training keep the buffer in the parameters'
    dtype either way, and --main-grads-dtype bf16 has it in bf16 already."""
    main_grads = str(args.get("main_grads_dtype") or "fp32").lower()
    return bool(args.get("bf16")) and "bf16" not in main_grads and "bfloat16" not in main_grads


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


def dummy_wgrads_mb(layout: Layout, last_stage: bool = True) -> float:
    """What gradient accumulation fusion adds where Transformer Engine is installed.

    With fusion, a linear layer's weight-gradient GEMM accumulates into ``main_grad`` directly, and
    the autograd function still returns a placeholder gradient of the weight's shape (in the
    activations' dtype) so the DDP backward hooks fire on the main thread. Megatron's own layers
    (the output layer, tensor_parallel/layers.py) and TE's linear modules take that placeholder from
    TE's ``get_dummy_wgrad``, which caches ONE tensor per (shape, dtype) for the rest of the job. So
    the cost is one bf16 weight-sized tensor per distinct weight shape: the output layer's
    (vocab/TP x hidden) plus one of each of a layer's QKV, projection, FC1 and FC2 weights.

    Without fusion the weight gradient is a transient bf16 tensor that the hook adds into
    ``main_grad`` and frees: nothing persists. Reference model (hidden 4096, ffn 14336, 32 heads,
    8 KV groups, vocab 128256, TP 1): 2 B x (128256x4096 + 6144x4096 + 4096x4096 + 28672x4096 +
    4096x14336) = 1002 + 416 = 1418 MB.
    """
    shapes = layout.weight_shapes()  # experts too: TE's grouped linear asks the same one-per-shape cache
    if last_stage:  # tied too: the output layer then runs the shared embedding weight through the same path
        shapes.add((layout.vocab_per_rank, layout.hidden))
    return BF16 * sum(r * c for r, c in shapes) / MB


def grad_reduce_bf16_mb(layout: Layout, last_stage: bool = True) -> float:
    """bf16 gradient reduction: the distributed data-parallel gradient buffers
    (distributed/param_and_grad_buffer.py) hold every parameter's gradient in bf16 instead of fp32
    (stock bf16 training sets accumulate_allreduce_grads_in_fp32). -2 B x parameters on the rank.

    With the distributed optimizer, the optimizer step then upcasts its shard of the bf16 gradients
    into fp32 main gradients (4 B x parameters / DP, transient); that step is not where a dense
    model peaks, so the term is the buffer's saving alone."""
    if not layout.fp32_grad_buffer:  # fp16/fp32 training, or bf16 main grads: the flag changes nothing
        return 0.0
    params = layout.last_stage_params() if last_stage else layout.first_stage_params()
    return -BF16 * params / MB


ZERO_TERMS = ("ddp_average_in_collective", "fused_single_qkv_rope")  # measured 0 MB on the H200


def toggle_delta_mb(dest: str, values: Mapping[str, Any], stock: Mapping[str, Any], layout: Layout,
                    te_installed: bool, last_stage: bool = True) -> float | None:
    """The change in peak MB that ``values[dest]`` makes against ``stock[dest]`` on a rank of the
    last pipeline stage (``last_stage=False``: of the first, which holds no logits). The terms add
    up to the plan's change: the cross-entropy pair is priced as the fusion (with this plan's
    implementation) plus the implementation (where stock fuses too). None: not modelled."""
    if dest in ZERO_TERMS:
        return 0.0
    if dest in MOE_DESTS:
        return moe_toggle_delta_mb(dest, values, stock, layout, te_installed, last_stage)
    if dest == "gradient_accumulation_fusion":
        now, before = bool(values.get(dest)), bool(stock.get(dest))
        if now == before:
            return 0.0
        if not te_installed:
            return None  # without TE, Megatron makes a fresh placeholder per call: not modelled
        return (now - before) * dummy_wgrads_mb(layout, last_stage)
    if dest == "grad_reduce_in_bf16":
        now, before = bool(values.get(dest)), bool(stock.get(dest))
        return (now - before) * grad_reduce_bf16_mb(layout, last_stage)
    if not last_stage and dest in ("cross_entropy_loss_fusion", "cross_entropy_fusion_impl"):
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
                        te_installed: bool, last_stage: bool = True) -> float | None:
    """An MoE toggle's change (``core.memory_moe.toggle_delta_mb``) on the stage's MoE layers, each
    holding one micro-batch's activations on the last stage and PP of them on the first: 0 where the
    stage has no MoE layer (a dense model included); None without Transformer Engine, whose kernels
    all three toggles run (Megatron's own fallbacks are not modelled)."""
    moe_layers = layout.moe_layers(last_stage)
    if layout.moe is None or not moe_layers or bool(values.get(dest)) == bool(stock.get(dest)):
        return 0.0
    if not te_installed:
        return None
    in_flight = moe_layers * (1 if last_stage else layout.pp)
    return memory_moe.toggle_delta_mb(dest, values, stock, layout.moe, layout.hidden, layout.tokens, layout.tp,
                                      layout.sequence_parallel, in_flight)


# --- stock's own peak ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Estimate:
    """Stock Megatron's peak allocated MB for a layout, the parts it adds up, and whose formula."""

    peak_mb: float
    source: str
    parts: dict[str, float]
    stages: dict[str, float] = field(default_factory=dict)  # "last" (and "first" where PP > 1): each one's peak


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
    MoE part under the MoE toggles' ``values`` (``core.memory_moe.moe_layer_bytes``). Full
    recompute keeps the layer's input only, as for a dense layer."""
    if layout.moe is None:
        raise ValueError("a dense layout has no MoE layer")
    if layout.recompute == "full":
        return layer_activation_bytes(layout)[0]
    attention = layer_activation_bytes(dataclasses.replace(layout, ffn=0))[0]
    return attention + memory_moe.moe_layer_bytes(layout.moe, layout.hidden, layout.tokens, layout.tp,
                                                  layout.sequence_parallel, layout.swiglu, values)


def _stage_parts(layout: Layout, last: bool, in_flight: int, grad_accum_fusion: bool, te_installed: bool,
                 moe_values: Mapping[str, Any]) -> dict[str, float]:
    """One pipeline stage's parts of stock's peak (``stock_peak``)."""
    per_layer = layer_activation_bytes(layout)[0]
    sbh = layout.tokens * layout.hidden
    dense, expert = layout.stage_param_split(last)
    moe_n = layout.moe_layers(last)
    weights = dense * bytes_per_param(layout)
    if layout.moe is not None:
        weights += expert * memory_moe.expert_bytes_per_param(layout.moe, layout.distributed_optimizer)
    activations = (layout.stage_layers - moe_n) * per_layer
    if moe_n:
        activations += moe_n * moe_layer_activation_bytes(layout, moe_values)
    parts = {"weights_and_optimizer": weights / MB, "activations": in_flight * activations / MB}
    if last:
        parts["logits"] = (FP32 + BF16) * layout.tokens * layout.vocab_per_rank / MB + FP32 * sbh / MB
    if not last or layout.pp == 1:
        parts["embedding_output"] = in_flight * BF16 * sbh / MB
    if layout.fp8:  # 1 B per linear weight of the stage's layers (the output layer stays bf16)
        parts["fp8_weights"] = layout.stage_linear_weights(last) / MB
    if grad_accum_fusion and te_installed:
        parts["placeholder_wgrads"] = dummy_wgrads_mb(layout, last_stage=last)
    if moe_n and layout.moe is not None:
        buffers = memory_moe.persistent_mb(layout.moe, layout.hidden, layout.tokens, layout.tp,
                                           layout.sequence_parallel, moe_values)
        if buffers:
            parts["moe_buffers"] = sum(buffers.values())
    return parts


def stock_peak(layout: Layout, grad_accum_fusion: bool, te_installed: bool,
               moe_values: Mapping[str, Any] | None = None) -> Estimate:
    """Stock's peak on the busier of the first and last pipeline stage: weights and optimizer state,
    saved activations (PP micro-batches in flight on the first stage, one on the last; MoE layers
    priced under stock's MoE toggles, ``moe_values``, Megatron's defaults (all off) where not given),
    on the last stage the logits as stock's unfused cross entropy holds them (the bf16 output plus
    its fp32 copy, 6 B x tokens x vocab / TP), the placeholder gradients if fusion is on, and the
    buffers MoE layers keep."""
    megatron_applies = layer_activation_bytes(layout)[1] and layout.moe is None
    stages: list[dict[str, float]] = []
    for last, in_flight in ((True, 1), (False, layout.pp)):
        stages.append(_stage_parts(layout, last, in_flight, grad_accum_fusion, te_installed, moe_values or {}))
        if layout.pp == 1:
            break
    parts = max(stages, key=lambda p: sum(p.values()))
    source = MEGATRON_FORMULA if megatron_applies else PLUGIN_ESTIMATE
    totals = {name: round(sum(p.values()), 1) for name, p in zip(("last", "first"), stages, strict=False)}
    return Estimate(round(sum(parts.values()), 1), source, {k: round(v, 1) for k, v in parts.items()}, totals)
