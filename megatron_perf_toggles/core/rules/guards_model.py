"""The guards of the model's kernels: cross-entropy loss fusion and its impl, the fused
single-QKV RoPE path, and averaging in the DDP collective.

Each guard is declared with ``@guard``: the toggles it may move and the Megatron rules it answers
(``guard_base``). The order they run in is ``guards.GUARDS``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..decision.plan import Change, Context
from ..registry import flag_of
from .guard_base import carries, declared_in, graph_modules, guard, is_on, lacking, rule, te_at_least

PACKED_SEQUENCE_DESTS = ("sft", "rl_use_sequence_packing", "hybrid_context_parallel", "dataloader_inter_document_masking")
GTP_DESTS = ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards")
CE_TE_FULL_GRAPH_MIN_TE = (2, 7)  # TE's cross-entropy inside a full-iteration CUDA graph
DETERMINISTIC_CE = rule("deterministic_ce_fusion")
DETERMINISTIC_CE_019 = rule("deterministic_ce_fusion_019")
CE_TE_DISTILLATION = rule("ce_te_impl_distillation")
CE_TE_FULL_GRAPH = rule("ce_te_full_iteration_graph_old_te")
CE_TE_STABILITY = rule("ce_te_impl_stability")
DDP_AVERAGE_VS_GTP = rule("ddp_average_vs_gtp")
CE = ("cross_entropy_loss_fusion", "cross_entropy_fusion_impl")


@guard(moves=("cross_entropy_loss_fusion",), answers=(DETERMINISTIC_CE, DETERMINISTIC_CE_019))
def cross_entropy_fusion_deterministic(ctx: Context) -> Iterator[Change]:
    """Cross-entropy loss fusion goes off under `--deterministic-mode`, where Megatron rejects it; an
    explicit `--cross-entropy-loss-fusion` with it is refused."""
    if ctx.args.get("deterministic_mode") and is_on(ctx.values, "cross_entropy_loss_fusion") \
            and (carries(ctx, DETERMINISTIC_CE) or carries(ctx, DETERMINISTIC_CE_019)):
        yield Change(
            "cross_entropy_loss_fusion", False,
            "--deterministic-mode: Megatron rejects cross-entropy loss fusion there (the fused kernel is "
            "not deterministic)",
            hint="drop --cross-entropy-loss-fusion or --deterministic-mode",
        )


def _te_fused_cross_entropy_on(ctx: Context) -> bool:
    return is_on(ctx.values, "cross_entropy_loss_fusion") and ctx.values.get("cross_entropy_fusion_impl") == "te"


def _te_impl_cannot_stay(ctx: Context, reason: str, hint: str, capability: str = "") -> Change:
    """Fused te cross-entropy cannot run: the impl goes native, unless te was asked for by name and
    the fusion only by default. Stock Megatron (fusion off by default) accepts that command line,
    so then the fusion default yields instead."""
    if ctx.sources.get("cross_entropy_fusion_impl") == "cli" and ctx.sources.get("cross_entropy_loss_fusion") != "cli":
        return Change("cross_entropy_loss_fusion", False, f"{reason}, and --cross-entropy-fusion-impl te was "
                      "given explicitly", hint="pass --cross-entropy-fusion-impl native", capability=capability)
    return Change("cross_entropy_fusion_impl", "native", reason, hint=hint, capability=capability)


@guard(moves=CE, answers=(CE_TE_STABILITY,))
def cross_entropy_te_asserted(ctx: Context) -> Iterator[Change]:
    """The cross-entropy impl `te` becomes `native` where Megatron asserts against it with loss fusion
    (0.18.2 and later); if `te` was asked for by name, the fusion default yields instead."""
    if _te_fused_cross_entropy_on(ctx) and carries(ctx, CE_TE_STABILITY):
        reason = (f"Megatron {ctx.caps.megatron.version or ''} rejects the te impl with "
                  "--cross-entropy-loss-fusion (stability assertion in validate_args)").replace("  ", " ")
        yield _te_impl_cannot_stay(ctx, reason, hint="use --cross-entropy-fusion-impl native")


@guard(moves=("cross_entropy_fusion_impl",), answers=(CE_TE_DISTILLATION,))
def cross_entropy_te_distillation(ctx: Context) -> Iterator[Change]:
    """The impl `te` becomes `native` with ModelOpt distillation (`--export-kd-teacher-load`), which does
    not take TE's cross entropy."""
    if ctx.args.get("export_kd_teacher_load") and ctx.values.get("cross_entropy_fusion_impl") == "te" \
            and carries(ctx, CE_TE_DISTILLATION):
        yield Change("cross_entropy_fusion_impl", "native",
                     "--export-kd-teacher-load: ModelOpt distillation does not take TE's cross-entropy",
                     hint="use --cross-entropy-fusion-impl native")


@guard(moves=("cross_entropy_fusion_impl",), answers=(CE_TE_FULL_GRAPH,))
def cross_entropy_te_full_iteration_graph(ctx: Context) -> Iterator[Change]:
    """The impl `te` becomes `native` under a full-iteration CUDA graph with Transformer Engine older than
    2.7."""
    a = ctx.args
    full = a.get("cuda_graph_impl") == "full_iteration" or "full_iteration" in graph_modules(a)
    if full and _te_fused_cross_entropy_on(ctx) and not te_at_least(ctx.caps, CE_TE_FULL_GRAPH_MIN_TE) \
            and carries(ctx, CE_TE_FULL_GRAPH):
        have = f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"
        yield Change("cross_entropy_fusion_impl", "native",
                     f"a full-iteration CUDA graph needs Transformer Engine >= 2.7 for TE's cross-entropy ({have})",
                     hint="use --cross-entropy-fusion-impl native")


@guard(moves=CE, answers=(rule("ce_te_kernel_missing"),))
def cross_entropy_te_missing(ctx: Context) -> Iterator[Change]:
    """The impl `te` becomes `native` where Transformer Engine lacks its parallel cross-entropy kernel."""
    need = lacking(ctx, "cross_entropy_fusion_impl") if _te_fused_cross_entropy_on(ctx) else None
    if need:
        why = ctx.caps.notes.get(need) or ctx.caps.notes.get("te") or (
            "Transformer Engine's parallel cross-entropy kernel is not available"
        )
        yield _te_impl_cannot_stay(ctx, why, hint="install Transformer Engine or use --cross-entropy-fusion-impl "
                                   "native", capability=need)


@guard(moves=("cross_entropy_fusion_impl",))  # no rule: keeps an unused te impl out of their way
def cross_entropy_impl_unused(ctx: Context) -> Iterator[Change]:
    # Without the fusion the impl is never used: leave Megatron's own value, so no rule about the
    # te impl (distillation, graphs, stability) can reject a setting that does nothing.
    """With loss fusion off the impl is unused, so Megatron's own value (`native`) stands and no rule about
    `te` can reject it."""
    if not is_on(ctx.values, "cross_entropy_loss_fusion") and ctx.values.get("cross_entropy_fusion_impl") == "te" \
            and ctx.sources.get("cross_entropy_fusion_impl") == "default":
        yield Change("cross_entropy_fusion_impl", "native",
                     "cross-entropy loss fusion is off, so the impl is unused: Megatron's default stands")





# Settings that take Megatron off the fused single-QKV RoPE path (its first-forward assertion, or a
# silent difference), in the order they are reported: (dest, why).
FUSED_QKV_ROPE_BLOCKERS: tuple[tuple[str, str], ...] = (
    ("qk_layernorm", ": q/k are normalised after the split, so QKV cannot stay packed"),
    ("attention_output_gate", " is not supported by the fused QKV RoPE path"),
    ("flash_decode", " takes its own RoPE path"),
    ("qk_l2_norm", ": q/k are normalised after the split, so QKV cannot stay packed"),
    ("no_rope_freq", ": layers without RoPE get no rotary embedding, which the fused path requires"),
    ("rotary_interleaved", ": the fused kernel is not told about interleaving, so results would differ"),
    ("perform_rl_step", ": rollouts run with an inference context, which the fused path does not take"),
    *((dest, " uses packed (THD) sequences, which the fused path does not take") for dest in PACKED_SEQUENCE_DESTS),
)


def _groups_below_tp(a: Mapping[str, Any]) -> str:
    """Why the fused path cannot run where each TP rank holds one query group of fewer (core 0.16 on):
    it hands QKV on unsplit, before the step that picks the rank's own query heads."""
    groups, tp = a.get("num_query_groups"), a.get("tensor_model_parallel_size") or 1
    if a.get("group_query_attention") and isinstance(groups, int) and 0 < groups < tp:
        return (f"--num-query-groups {groups} is below tensor parallelism {tp}: the fused path skips picking "
                "each rank's query heads")
    return ""


@guard(moves=("fused_single_qkv_rope",), answers=tuple(rule(i) for i in (
    "fqr_field", "fqr_gated_attention", "fqr_forward_assert", "fqr_qk_l2_norm", "fqr_no_rope_layers",
    "fqr_packed_sequences", "fqr_inference_context", "fqr_rotary_interleaved", "fqr_groups_below_tp")))
def fused_qkv_rope_unsupported(ctx: Context) -> Iterator[Change]:
    """Fused single-QKV RoPE goes off without the TransformerConfig field (before core 0.15) or TE's fused
    QKV RoPE kernel, and with q/k layer norm or L2 norm, packed (THD) sequences, flash-decode, an
    attention output gate, RoPE-free layers, `--rotary-interleaved`, RL rollouts, fewer query groups
    than TP ranks, or a position embedding other than RoPE."""
    if not is_on(ctx.values, "fused_single_qkv_rope"):
        return
    a, caps = ctx.args, ctx.caps
    reason, capability = "", ""
    rope = a.get("position_embedding_type") == "rope" or (
        a.get("use_rotary_position_embeddings") and a.get("position_embedding_type") in (None, "learned_absolute")
    )
    need = lacking(ctx, "fused_single_qkv_rope")
    if need == "megatron_fused_single_qkv_rope_field":
        reason = f"Megatron {caps.megatron.version or ''} TransformerConfig has no fused_single_qkv_rope field (added in core 0.15)"
    elif need:
        reason = caps.notes.get(need) or caps.notes.get("te") or (
            "Transformer Engine's fused QKV RoPE kernel is not available"
        )
        capability = need
    elif not rope:
        reason = f"position embedding {a.get('position_embedding_type')!r} is not RoPE"
    else:
        reason = next((f"{flag_of(dest)}{why}" for dest, why in FUSED_QKV_ROPE_BLOCKERS if a.get(dest)), "") \
            or _groups_below_tp(a)
    if reason:
        yield Change(
            "fused_single_qkv_rope",
            False,
            reason.replace("  ", " "),
            hint="pass --no-fused-single-qkv-rope",
            capability=capability,
        )


@guard(moves=("ddp_average_in_collective",), answers=(
    rule("ddp_average_vs_per_token_loss"), DDP_AVERAGE_VS_GTP, rule("ddp_average_vs_gtp_ddp")))
def ddp_average_unsupported(ctx: Context) -> Iterator[Change]:
    """Averaging inside the data-parallel collective goes off with `--calculate-per-token-loss` or GTP
    weight shards."""
    if not is_on(ctx.values, "ddp_average_in_collective"):
        return
    if ctx.args.get("calculate_per_token_loss"):
        yield Change(
            "ddp_average_in_collective",
            False,
            "--calculate-per-token-loss already normalises by token count; Megatron's DDP "
            "rejects averaging in the collective with it",
            hint="pass --no-ddp-average-in-collective",
        )
        return
    shards = [d for d in GTP_DESTS if (ctx.args.get(d) or 1) > 1]
    if shards and carries(ctx, DDP_AVERAGE_VS_GTP):
        yield Change(
            "ddp_average_in_collective",
            False,
            f"{flag_of(shards[0])} > 1 enables GTP, which rejects averaging in the collective",
            hint="pass --no-ddp-average-in-collective",
        )

GUARDS = declared_in(globals())  # in the order they are declared above
