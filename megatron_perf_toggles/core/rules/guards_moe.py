"""The guards of the mixture-of-experts toggles: grouped GEMM, permute fusion and router fusion.

Each answers rules of Megatron's (``megatron_rules_moe``) or of Transformer Engine's import gates,
as Megatron checks them in the version at hand (``carries``). They act on MoE models only: on a
dense model the decision leaves Megatron's own value before any guard runs (``decide``), so these
toggles are off here and no guard below has anything to do. Grouped GEMM changes the experts'
parameter layout (TEGroupedMLP or the legacy GroupedMLP instead of SequentialMLP), so one guard
keeps it as the checkpoint being resumed was saved where that layout cannot load the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..ckpt_layout import GRAD_DTYPE_KEYED, optimizer_layout
from ..decision.plan import Change, Context
from ..registry import is_moe
from .guard_base import as_saved, carries, declared_in, guard, is_on, lacking, resume_loads_optimizer, rule, te_at_least

GG, PF, RF = "moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion"
GG_BF16 = rule("moe_gg_bf16")
GG_CAPABILITY = rule("moe_gg_compute_capability")
GG_TE_BIAS = rule("moe_gg_te_bias")
GG_LEGACY_BIAS = rule("moe_gg_legacy_bias")
GG_BIAS_DROPOUT = rule("moe_gg_bias_dropout_fusion")
GG_FP8_TE = rule("moe_gg_fp8_old_te")
GG_GROUPED_LINEAR = rule("moe_gg_te_grouped_linear")
GG_LEGACY_PACKAGE = rule("moe_gg_legacy_package")
GG_LEGACY_LOCAL = rule("moe_gg_legacy_local_spec")
GG_OP_FUSER = rule("moe_gg_op_fuser")
GG_OP_FUSER_CUTEDSL = rule("moe_gg_op_fuser_cutedsl")
GG_OP_FUSER_SCALE_BIAS = rule("moe_gg_op_fuser_scale_bias")
GG_OP_FUSER_CLAMP = rule("moe_gg_op_fuser_clamp")
GG_SEQUENTIAL_FALLBACK = rule("moe_gg_te_sequential_fallback")
GG_LEGACY_BF16 = rule("moe_gg_legacy_bf16")
GG_LEGACY_GLU = rule("moe_gg_legacy_glu")
GG_LEGACY_LATENT = rule("moe_gg_legacy_latent")
GG_LEGACY_FP8_RECOMPUTE = rule("moe_gg_legacy_fp8_recompute")
GG_BY_MODULE = rule("moe_gg_by_module_formats")
PF_TE = rule("moe_pf_te")
PF_BATCH_INVARIANT = rule("moe_pf_batch_invariant")
RF_FIELD = rule("moe_rf_field")
RF_TE = rule("moe_rf_te")
RF_TE_IMPORT = rule("moe_rf_te_import")
RF_SQRTSOFTPLUS = rule("moe_rf_sqrtsoftplus")
RF_QUANTILE = rule("moe_rf_quantile_balancing")
RF_REPLAY = rule("moe_rf_routing_replay")

GG_FP8_MIN_TE = (1, 11)
OP_FUSER_MIN_TE = (2, 14)
OP_FUSER_CLAMP_MIN_TE = (2, 17)
# the formats that save the model by module name (state_dict_for_save_checkpoint); fsdp_dtensor exists
# from core 0.14 (0.13's parser rejects it) and renumbers expert indices only, never the layout
BY_MODULE_FORMATS = ("torch", "torch_dcp", "fsdp_dtensor")
ROUTER_MIN_TE = (2, 7)  # Megatron imports TE's router kernels only from here (2.7.0.dev)
SQRTSOFTPLUS_MIN_TE = (2, 13)
NO_GG = "pass --no-moe-grouped-gemm"
# Where the layer-level sweep measured permute fusion slower (wall time, launches included): routed
# elements per micro-batch on a rank (tokens x top-k x hidden) below these, by dispatcher; TP, EP and
# ETP 1, one H100 (CUDA), Megatron core 0.20, Transformer Engine 2.20 (docs/benchmarks/raw/layers/sweep.json).
PF_SLOWER_BELOW = {"alltoall": 64 * 2**20, "allgather": 96 * 2**20}


def _on(ctx: Context, dest: str) -> bool:
    """The toggle is on, for a MoE model (on a dense one an explicit flag is Megatron's to judge)."""
    return is_on(ctx.values, dest) and is_moe(ctx.args)


def _off(dest: str, reason: str, hint: str, capability: str = "") -> Change:
    return Change(dest, False, reason.replace("  ", " "), hint=hint, capability=capability)


def _megatron(ctx: Context) -> str:
    return f"Megatron {ctx.caps.megatron.version}" if ctx.caps.megatron.version else "Megatron"


def _te_words(ctx: Context) -> str:
    return f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"


def _legacy_path(ctx: Context) -> str:
    """Why this job would build the legacy GroupedMLP ("" where it builds TEGroupedMLP): the local
    spec, the legacy flag, or a Transformer Engine without GroupedLinear (where the Megatron at hand
    still has the legacy path at all)."""
    if not carries(ctx, GG_LEGACY_PACKAGE):
        return ""
    a = ctx.args
    if a.get("transformer_impl") == "local" and carries(ctx, GG_LEGACY_LOCAL):
        return "--transformer-impl local builds the legacy GroupedMLP"
    if a.get("moe_use_legacy_grouped_gemm"):
        return "--moe-use-legacy-grouped-gemm builds the legacy GroupedMLP"
    if ctx.caps.te_version is not None and lacking(ctx, GG) and carries(ctx, GG_GROUPED_LINEAR):
        return f"{_te_words(ctx)} has no GroupedLinear, so Megatron builds the legacy GroupedMLP"
    return ""


@guard(moves=(GG,), answers=(GG_GROUPED_LINEAR, GG_LEGACY_PACKAGE, GG_LEGACY_LOCAL, GG_SEQUENTIAL_FALLBACK))
def moe_grouped_gemm_kernel(ctx: Context) -> Iterator[Change]:
    """Grouped GEMM goes off where no grouped kernel can run: the legacy GroupedMLP (the local spec,
    `--moe-use-legacy-grouped-gemm`, or TE without GroupedLinear, up to core 0.16) without the
    grouped_gemm package; from core 0.17, TE without GroupedLinear, where Megatron builds
    SequentialMLP instead (no failure: an explicit `--moe-grouped-gemm` there is Megatron's to take)."""
    if not _on(ctx, GG):
        return
    legacy = _legacy_path(ctx)
    if legacy and ctx.caps.value_of("grouped_gemm_package") is False:
        note = ctx.caps.notes.get("grouped_gemm_package") or "the grouped_gemm package is not installed"
        yield _off(GG, f"{legacy}, which needs the grouped_gemm package ({note})", NO_GG,
                   capability="grouped_gemm_package")
        return
    need = lacking(ctx, GG)
    if need and not legacy and ctx.args.get("transformer_impl", "transformer_engine") != "local":
        why = ctx.caps.notes.get(need) or ctx.caps.notes.get("te") or "Transformer Engine's GroupedLinear is not available"
        if not carries(ctx, GG_SEQUENTIAL_FALLBACK):
            yield _off(GG, why, f"install Transformer Engine >= 1.9 or {NO_GG}", capability=need)
            return
        # from core 0.17 the TE spec falls back to SequentialMLP: nothing fails, nothing to refuse
        change = _off(GG, f"{why}, so Megatron builds SequentialMLP", "install Transformer Engine >= 1.9",
                      capability=need)
        change.yields_to_cli = True
        yield change


@guard(moves=(GG,), answers=(GG_BF16, GG_CAPABILITY, GG_FP8_TE))
def moe_grouped_gemm_precision(ctx: Context) -> Iterator[Change]:
    """Grouped GEMM goes off without `--bf16` (core 0.13 to 0.15 assert it), on a CUDA GPU older than
    sm_80, and under FP8 with Transformer Engine older than 1.11."""
    if not _on(ctx, GG):
        return
    a, arch = ctx.args, ctx.caps.gpu_arch or ""
    if not a.get("bf16") and carries(ctx, GG_BF16):
        yield _off(GG, f"{_megatron(ctx)} supports MoE grouped GEMM only with --bf16", NO_GG)
    elif arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) < 80 and carries(ctx, GG_CAPABILITY):
        yield _off(GG, f"grouped GEMM kernels need compute capability 8.0 or newer ({arch})", NO_GG)
    elif a.get("fp8") and not te_at_least(ctx.caps, GG_FP8_MIN_TE) and carries(ctx, GG_FP8_TE):
        yield _off(GG, f"FP8 grouped GEMM needs Transformer Engine >= 1.11 ({_te_words(ctx)})", NO_GG)


@guard(moves=(GG,), answers=(GG_TE_BIAS, GG_LEGACY_BIAS, GG_BIAS_DROPOUT))
def moe_grouped_gemm_bias(ctx: Context) -> Iterator[Change]:
    """Grouped GEMM goes off where linear layers keep their bias (no `--disable-bias-linear`) and the
    grouped experts cannot take one: always on the legacy path and in core 0.13/0.14, and with
    bias-dropout fusion (no `--no-bias-dropout-fusion`) from 0.15."""
    a = ctx.args
    if not _on(ctx, GG) or not a.get("add_bias_linear", True):
        return
    hint = f"pass --disable-bias-linear, or {NO_GG}"
    if _legacy_path(ctx) and carries(ctx, GG_LEGACY_BIAS):
        yield _off(GG, "the legacy GroupedMLP takes no bias, and --disable-bias-linear is not set", hint)
    elif carries(ctx, GG_TE_BIAS):
        yield _off(GG, f"{_megatron(ctx)}'s TEGroupedMLP takes no bias, and --disable-bias-linear is not set", hint)
    elif a.get("bias_dropout_fusion", True) and carries(ctx, GG_BIAS_DROPOUT):
        yield _off(GG, "TEGroupedMLP rejects bias-dropout fusion with biased linear layers "
                   "(--disable-bias-linear and --no-bias-dropout-fusion are both unset)",
                   f"pass --disable-bias-linear or --no-bias-dropout-fusion, or {NO_GG}")


def _legacy_blocker(ctx: Context) -> str:
    """Why the legacy GroupedMLP cannot take this model ("" if it can), as far as the rules above say."""
    a = ctx.args
    if not a.get("bf16") and carries(ctx, GG_LEGACY_BF16):
        return "asserts --bf16 at its first forward"
    if a.get("quick_geglu") and carries(ctx, GG_LEGACY_GLU):
        return "takes no gated activation but SwiGLU or GeGLU (--quick-geglu)"
    if a.get("moe_latent_size") and carries(ctx, GG_LEGACY_LATENT):
        return "takes no --moe-latent-size"
    selective = a.get("recompute_granularity") == "selective" and "moe_act" in (a.get("recompute_modules") or ())
    if selective and (a.get("fp8") or a.get("fp4")) and carries(ctx, GG_LEGACY_FP8_RECOMPUTE):
        return "takes no moe_act recompute under FP8 or FP4"
    return ""


@guard(moves=(GG,), answers=(GG_LEGACY_BF16, GG_LEGACY_GLU, GG_LEGACY_LATENT, GG_LEGACY_FP8_RECOMPUTE))
def moe_grouped_gemm_legacy(ctx: Context) -> Iterator[Change]:
    """Grouped GEMM goes off where the legacy GroupedMLP would be built (up to core 0.16) and cannot
    take the model: without `--bf16` (0.16), with `--quick-geglu`, with `--moe-latent-size` (0.16), and
    with moe_act recompute under FP8/FP4 (0.14 to 0.16)."""
    if not _on(ctx, GG):
        return
    legacy = _legacy_path(ctx)
    blocker = _legacy_blocker(ctx) if legacy else ""
    if blocker:
        yield _off(GG, f"{legacy}, which {blocker}", NO_GG)


def _op_fuser_activation(ctx: Context) -> str:
    """Why the fused grouped MLP cannot take these experts' activation or bias ("" if it can)."""
    a = ctx.args
    gated = a.get("swiglu") or a.get("quick_geglu")
    if not (gated or (a.get("squared_relu") and a.get("use_fused_weighted_squared_relu"))):
        return "it takes only SwiGLU, quick GeGLU or fused weighted squared ReLU experts"
    if a.get("swiglu") and a.get("activation_func_clamp_value") is not None \
            and not te_at_least(ctx.caps, OP_FUSER_CLAMP_MIN_TE) and carries(ctx, GG_OP_FUSER_CLAMP):
        return f"it takes a clamped SwiGLU only from Transformer Engine 2.17 ({_te_words(ctx)})"
    if gated and not ctx.env.cutedsl_grouped_mlp and carries(ctx, GG_OP_FUSER_CUTEDSL):
        return "it takes SwiGLU or quick GeGLU experts only with NVTE_CUTEDSL_FUSED_GROUPED_MLP set above 0"
    if a.get("add_bias_linear", True) and carries(ctx, GG_OP_FUSER_SCALE_BIAS):
        return "it takes biased experts only where TE's GroupedLinear op scales the bias (not known here)"
    return ""


def _op_fuser_blocker(ctx: Context) -> str:
    """Why TE's fused grouped MLP (``--use-transformer-engine-op-fuser``) cannot take this model ("" if it can)."""
    a = ctx.args
    if not te_at_least(ctx.caps, OP_FUSER_MIN_TE):
        return f"it needs Transformer Engine >= 2.14 ({_te_words(ctx)})"
    expert_tp = a.get("expert_tensor_parallel_size") or a.get("tensor_model_parallel_size") or 1
    if expert_tp > 1:
        return f"it takes no expert tensor parallelism (expert tensor-parallel size {expert_tp})"
    if a.get("moe_apply_probs_on_input"):
        return "it does not take --moe-apply-probs-on-input"
    offloaded = {"expert_fc1", "moe_act"} & set(a.get("offload_modules") or ())
    if a.get("fine_grained_activation_offloading") and offloaded:
        return f"it does not take fine-grained activation offloading of {', '.join(sorted(offloaded))}"
    return _op_fuser_activation(ctx)


@guard(moves=(GG,), answers=(GG_OP_FUSER, GG_OP_FUSER_CUTEDSL, GG_OP_FUSER_SCALE_BIAS, GG_OP_FUSER_CLAMP))
def moe_grouped_gemm_op_fuser(ctx: Context) -> Iterator[Change]:
    """Grouped GEMM goes off under `--use-transformer-engine-op-fuser` where TE's fused grouped MLP,
    which Megatron then asserts, cannot take the model (TE older than 2.14, expert tensor parallelism,
    probs applied on the input, offloading of expert_fc1 or moe_act, an activation other than SwiGLU,
    quick GeGLU or weighted squared ReLU; from core 0.19 SwiGLU/quick GeGLU, which need
    NVTE_CUTEDSL_FUSED_GROUPED_MLP, and biased experts; on main a clamped SwiGLU before TE 2.17).
    An explicit `--moe-grouped-gemm` beside the op fuser is kept: Megatron judges that request."""
    if not _on(ctx, GG) or not ctx.args.get("use_transformer_engine_op_fuser") \
            or not carries(ctx, GG_OP_FUSER):
        return
    blocker = _op_fuser_blocker(ctx)
    if blocker:
        # --moe-grouped-gemm named beside the op fuser asks for the fused grouped MLP itself: that
        # request is Megatron's to judge when it builds the experts, as stock does
        change = _off(GG, f"--use-transformer-engine-op-fuser builds TE's fused grouped MLP, and {blocker}",
                      f"drop --use-transformer-engine-op-fuser or {NO_GG}")
        change.yields_to_cli = True
        yield change


def _layout(ctx: Context, grouped: bool) -> str:
    """The experts' parameter layout a run with grouped GEMM at ``grouped`` builds."""
    if not grouped:
        return "SequentialMLP"
    return "legacy GroupedMLP" if _legacy_path(ctx) else "TEGroupedMLP"


def _ckpt_format(ctx: Context) -> str:
    """The format Megatron will read the checkpoint in: `--ckpt-format`, except that under
    `--auto-detect-ckpt-format` and for torch_dist (the default, which Megatron also checks on disk)
    the one resume found on disk counts ("" where auto-detection would decide and resume could not)."""
    fmt = ctx.args.get("ckpt_format") or "torch_dist"
    on_disk = ctx.checkpoint.get("format_on_disk")
    if ctx.args.get("auto_detect_ckpt_format"):
        return str(on_disk or "")
    return str(on_disk) if fmt == "torch_dist" and on_disk else fmt


def _optimizer_by_position(ctx: Context) -> str:
    """The distributed optimizer's layout where it keeps state by position in the gradient buffers
    (which SequentialMLP and the grouped experts fill in different orders), "" otherwise."""
    if not resume_loads_optimizer(ctx):
        return ""
    recorded = ctx.checkpoint.get("optimizer_layout")
    kind, name = (recorded if isinstance(recorded, (list, tuple)) and len(recorded) == 2 else
                  optimizer_layout(ctx.args, ctx.caps.megatron.version, ctx.caps.torch_version))
    return str(name) if kind == GRAD_DTYPE_KEYED else ""


def _cannot_load(ctx: Context, saved: bool) -> str:
    """Why the checkpoint being resumed cannot load with grouped GEMM at its current value ("" if it can)."""
    now = is_on(ctx.values, GG)
    if saved == now:
        return ""
    was, will = _layout(ctx, saved), _layout(ctx, now)
    where = f"the checkpoint in {ctx.checkpoint.get('load_dir') or ctx.args.get('load')}"
    if GG not in ctx.checkpoint.get("decisions", {}):
        # No launch of the plugin wrote it: stock did, with its own layout, in whatever format and
        # optimizer layout it had then; the other layout is not assumed to load it.
        return f"{where} was written without this plugin, so it holds stock's {was}, which {will} is not assumed to load"
    fmt = _ckpt_format(ctx)
    if fmt in BY_MODULE_FORMATS and carries(ctx, GG_BY_MODULE):
        return f"{where} holds {was} in the {fmt} format, which keeps parameters by module, so {will} cannot load it"
    if not fmt:
        return f"{where} holds {was} in a format --auto-detect-ckpt-format leaves unknown here, which {will} may not load"
    if "legacy GroupedMLP" in (was, will) and resume_loads_optimizer(ctx):
        return (f"{where} holds {was}, and the distributed checkpoint moves "
                f"only weights, not optimizer state, between {was} and {will}")
    by_position = _optimizer_by_position(ctx)
    if by_position:
        return (f"{where} holds {was} with the distributed optimizer's state in the {by_position} layout, kept "
                f"by position in the gradient buffers, which {will} fills in another order")
    return ""


@guard(moves=(GG,), answers=(GG_BY_MODULE,))  # the checkpoint being resumed
def moe_grouped_gemm_checkpoint(ctx: Context) -> Iterator[Change]:
    """On resume, grouped GEMM keeps the value the checkpoint was saved with where its expert layout
    may not load the other: a checkpoint no launch of the plugin recorded (stock wrote it: the command
    line's or config's value, then nothing is guarded, else Megatron's default, off); the torch,
    torch_dcp and fsdp_dtensor formats (by module names; a format auto-detection would decide and the
    plan cannot see is treated alike); the legacy GroupedMLP's optimizer state; and the distributed
    optimizer's layouts that keep state by buffer position (dp_reshardable, dp_zero_gather_scatter).
    Only a recorded torch_dist checkpoint with weights alone or model-space optimizer state leaves the
    choice free."""
    if not ctx.checkpoint or not is_moe(ctx.args):  # no checkpoint to resume (or none known)
        return
    saved = as_saved(ctx, GG)
    reason = _cannot_load(ctx, saved) if saved is not None else ""
    # Back on only where no guard above turned it off for a reason of its own (that one stands).
    if reason and not (saved and ctx.sources.get(GG) == "guard"):
        yield Change(GG, saved, reason, hint="resume with the saved value")


@guard(moves=(PF,), answers=(PF_TE, PF_BATCH_INVARIANT))
def moe_permute_fusion_unsupported(ctx: Context) -> Iterator[Change]:
    """Permute fusion goes off without Transformer Engine's fused permutation (TE 2.1), where Megatron
    raises while building the TransformerConfig, and under `--batch-invariant-mode` (main)."""
    if not _on(ctx, PF):
        return
    need = lacking(ctx, PF)
    if need and carries(ctx, PF_TE):
        why = ctx.caps.notes.get(need) or ctx.caps.notes.get("te") or "Transformer Engine's fused permutation is not available"
        yield _off(PF, why, "install Transformer Engine >= 2.1 or pass --no-moe-permute-fusion", capability=need)
    elif ctx.args.get("batch_invariant_mode") and carries(ctx, PF_BATCH_INVARIANT):
        yield _off(PF, "--batch-invariant-mode needs the unfused permutation (fixed reduction order)",
                   "pass --no-moe-permute-fusion")


def _router_te_blocker(ctx: Context) -> tuple[str, str]:
    """(why TE cannot run the fused router here, the capability it rests on) or ("", "")."""
    need = lacking(ctx, RF)
    if need == "megatron_moe_router_fusion_field":
        return (f"{_megatron(ctx)} TransformerConfig has no moe_router_fusion field (added in core 0.14)", "")
    if need and carries(ctx, RF_TE):
        return (ctx.caps.notes.get(need) or ctx.caps.notes.get("te") or "TE's fused router kernels are not available",
                need)
    if ctx.caps.te_version is not None and not te_at_least(ctx.caps, ROUTER_MIN_TE) and carries(ctx, RF_TE_IMPORT):
        return (f"Megatron uses TE's fused router kernels only from Transformer Engine 2.7 ({_te_words(ctx)})", "")
    return "", ""


def _lb_types(args: Any) -> set[str]:
    value = args.get("moe_router_load_balancing_type") or ()
    return {value} if isinstance(value, str) else {str(v) for v in value}


@guard(moves=(RF,), answers=(RF_FIELD, RF_TE, RF_TE_IMPORT, RF_SQRTSOFTPLUS, RF_QUANTILE, RF_REPLAY))
def moe_router_fusion_unsupported(ctx: Context) -> Iterator[Change]:
    """Router fusion goes off without the TransformerConfig field (core 0.13) or TE's fused router
    kernels (TE 2.7), with the sqrtsoftplus score function before TE 2.13, with quantile-balancing
    routing, and with `--moe-enable-routing-replay` (the fused top-k skips the replay)."""
    if not _on(ctx, RF):
        return
    a, hint = ctx.args, "pass --no-moe-router-fusion"
    reason, capability = _router_te_blocker(ctx)
    if reason:
        yield _off(RF, reason, hint, capability=capability)
    elif a.get("moe_router_score_function") == "sqrtsoftplus" and not te_at_least(ctx.caps, SQRTSOFTPLUS_MIN_TE) \
            and carries(ctx, RF_SQRTSOFTPLUS):
        yield _off(RF, f"the fused sqrtsoftplus score function needs Transformer Engine >= 2.13 ({_te_words(ctx)})", hint)
    elif "quantile_balancing" in _lb_types(a) and carries(ctx, RF_QUANTILE):
        yield _off(RF, "quantile-balancing routing does not take router fusion", hint)
    elif a.get("moe_enable_routing_replay") and carries(ctx, RF_REPLAY):
        yield _off(RF, "--moe-enable-routing-replay: the fused top-k does not replay recorded routing", hint)


def routed_elements(args: Any) -> int:
    """Elements the dispatcher permutes per micro-batch on one rank: its tokens (the sequence over CP,
    times the micro-batch, over TP with sequence parallelism) x top-k x hidden size."""
    tokens = int(args.get("seq_length") or 0) // max(1, int(args.get("context_parallel_size") or 1))
    tokens *= int(args.get("micro_batch_size") or 1)
    if args.get("sequence_parallel"):
        tokens //= max(1, int(args.get("tensor_model_parallel_size") or 1))
    return tokens * int(args.get("moe_router_topk") or 2) * int(args.get("hidden_size") or 0)


@guard(moves=(PF,))
def moe_permute_fusion_slower_here(ctx: Context) -> Iterator[Change]:
    """Permute fusion is on by default only where it was measured faster: the layer-level sweep
    (``megatron-perf-toggles layers``' dispatcher unit, 38 MoE shapes) found the fused permute and
    unpermute faster in GPU time on every shape, but slower in wall time (the launches included)
    below a size (``PF_SLOWER_BELOW``). The rule covers what was measured: CUDA, TP, EP and ETP 1,
    the alltoall or allgather dispatcher; elsewhere, and wherever the toggle was asked for, it stands."""
    a = ctx.args
    if not _on(ctx, PF) or ctx.sources.get(PF) != "default" or ctx.caps.device != "cuda":
        return
    if any(int(a.get(d) or 1) != 1 for d in ("expert_model_parallel_size", "tensor_model_parallel_size",
                                             "expert_tensor_parallel_size")):
        return
    dispatcher = a.get("moe_token_dispatcher_type") or "allgather"
    limit = PF_SLOWER_BELOW.get(dispatcher)
    routed = routed_elements(a)
    if limit is not None and 0 < routed < limit:
        yield _off(PF, f"measured slower at this size: {routed / 2**20:.0f} Mi elements routed per micro-batch "
                   f"(tokens x top-k x hidden) is under {limit // 2**20} Mi, where the fused permutation's launches "
                   f"cost more than its kernels save (layer-level sweep on an H100, EP 1, {dispatcher} dispatcher)",
                   "MOE_PERMUTE_FUSION=1 keeps it on")


GUARDS = declared_in(globals())  # in the order they are declared above
