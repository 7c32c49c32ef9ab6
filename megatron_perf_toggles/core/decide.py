"""The policy, pure: (parsed args, explicit flags, environment, capabilities) -> a Plan.

No Megatron, torch or environment access happens here, so every rule can be unit-tested in
milliseconds. Read top to bottom: base resolution (cli > env > profile > plugin default), then
the FP4 layer selection, then the guards in order, then advice.

A profile value (``core.profile``) is treated by the guards exactly as an environment value: a
guard that cannot honour it changes it, with the reason and a warning that a requested value was
overridden; it is never refused as a command-line flag is. The profile is a request made ahead
of time for a setup like this one, not a flag typed for this run, so a machine that cannot honour
it should still train, and the warning names what the profile lost here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import CannotHonourError, DependencyError, RegistryError
from .ckpt_layout import GRAD_DTYPE_KEYED, grad_buffer_dtype, loads_optimizer_state, optimizer_layout
from .env import EnvSettings
from .facts import Capabilities, version_tuple
from .precision import log_dir_warnings, precision_tag, tagged_log_dirs
from .registry import BY_DEST, CAPABILITIES, TOGGLES, flag_of
from .struct import Struct, field

if TYPE_CHECKING:  # the profile module loads only when a profile is set (import time)
    from .profile import Observed, Profile

FP4_LAYER_DESTS = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
FP4_RECIPE_SELECTION = {"nvfp4": (True, 2, 8), "mxfp4": (False, 2, 8)}  # (selective, start, end)
MEGATRON_FP4_LAYER_DEFAULTS = (False, 1, 1)  # TransformerConfig's own, where the parser does not say
PACKED_SEQUENCE_DESTS = ("sft", "rl_use_sequence_packing", "hybrid_context_parallel", "dataloader_inter_document_masking")
GTP_DESTS = ("tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards")
ADAM_EPS_ADVICE = (5e-4, 1e-6)  # (lr at or above, eps below)
WGRAD_FALLBACK_WORDS = "torch.addmm with fp32 accumulation"


class Decision(Struct, frozen=True):
    """One toggle's value, where it came from, and why: a line of the start-up table and of the record."""

    value: Any
    source: str  # cli | env | profile | default | guard | assumed
    reason: str

    def to_record(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source, "reason": self.reason}


class Message(Struct):
    """A warning or advice line for the start-up table."""

    level: str  # warning | advice | profile (a warning about the profile in use)
    text: str


class Plan(Struct):
    """Everything decided for one command line."""

    decisions: dict[str, Decision]
    precision: str
    log_dirs: dict[str, str]  # dest -> tagged path (only those that are set and tagged)
    messages: list[Message] = field(default_factory=list)
    wgrad_path: str = "off"  # apex | fallback | off: who computes fused weight gradients
    profile: dict[str, Any] | None = None  # the profile in use and how its environment compares (the record)

    def values(self) -> dict[str, Any]:
        return {dest: d.value for dest, d in self.decisions.items()}


class Change(Struct):
    """What a guard wants: ``dest`` becomes ``value`` because ``reason``."""

    dest: str
    value: Any
    reason: str
    hint: str = ""
    capability: str = ""  # the capability the change rests on, if any (one of registry.CAPABILITIES)
    over_cli: bool = False  # applies even over an explicit command-line value (with a warning)
    # Only moves a value nobody asked for: an explicit command-line value is kept as it is
    # (the guard resolves a conflict between two requests in favour of the one on the command line).
    yields_to_cli: bool = False
    # The explicit request (another setting's flag) this change makes room for: a later guard that
    # takes the room back must say so, or refuse.
    requested_by: str = ""

    def __post_init__(self) -> None:
        if self.capability and self.capability not in CAPABILITIES:
            raise RegistryError(f"a guard of {self.dest!r} rests on {self.capability!r}, "
                                "which is not in registry.CAPABILITIES")


class Context(Struct):
    """What a guard may look at: parsed args, the decisions so far, capabilities, environment,
    and what is known of the checkpoint ``--load`` will resume from."""

    args: Mapping[str, Any]
    values: Mapping[str, Any]
    caps: Capabilities
    env: EnvSettings
    checkpoint: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)  # dest -> where its current value came from


Guard = Callable[[Context], Iterator[Change]]


def _on(values: Mapping[str, Any], dest: str) -> bool:
    return bool(values.get(dest))


def _graph_modules(args: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for dest in ("cuda_graph_modules", "cuda_graph_scope", "cuda_graph_scope_deprecated"):
        value = args.get(dest) or ()
        for item in [value] if isinstance(value, str) else value:
            names.add(str(getattr(item, "name", item)).rsplit(".", 1)[-1])
    return names


# --- guards, applied in this order ------------------------------------------------------------


FSDP_FLAGS = (("use_torch_fsdp2", "--use-torch-fsdp2"), ("use_megatron_fsdp", "--use-megatron-fsdp"),
              ("use_custom_fsdp", "--use-custom-fsdp"))
MFSDP_FUSION_MIN_TE = (2, 10)  # Megatron-FSDP's adapter asserts this TE for gradient accumulation fusion
DELAY_WGRAD_FUSION_OFF_MIN_TE = (2, 7)  # delay_wgrad_compute with fusion off asserts this TE
CE_TE_FULL_GRAPH_MIN_TE = (2, 7)  # TE's cross-entropy inside a full-iteration CUDA graph


def _te_at_least(caps: Capabilities, minimum: tuple[int, ...]) -> bool:
    """Transformer Engine is there in at least ``minimum``; one whose version could not be read
    (``unknown``) is taken as recent rather than blamed for a rule it may well satisfy."""
    if caps.te_version is None:
        return False
    found = version_tuple(caps.te_version)
    return not found or found >= minimum


def _fsdp_blocks_fusion(ctx: Context) -> str | None:
    """Why this FSDP layout cannot keep gradient accumulation fusion, following the rule of the
    Megatron at hand; None where it can (or no FSDP is used)."""
    a, m = ctx.args, ctx.caps.megatron
    if a.get("use_torch_fsdp2"):
        return "--use-torch-fsdp2: Megatron rejects gradient accumulation fusion with torch FSDP2"
    flag = next((f for d, f in FSDP_FLAGS[1:] if a.get(d)), None)
    if flag is None:
        return None
    if a.get("megatron_fsdp_version") == 2 and m.has_rule("mfsdp_v2_fusion"):
        return f"{flag} --megatron-fsdp-version 2: Megatron-FSDP v2 does not support gradient accumulation fusion"
    strategy = a.get("data_parallel_sharding_strategy")
    if strategy in ("optim_grads", "optim_grads_params") and m.has_rule("custom_fsdp_sharded_rejects_fusion"):
        return f"{flag} with --data-parallel-sharding-strategy {strategy}: this Megatron rejects gradient accumulation fusion"
    if not _te_at_least(ctx.caps, MFSDP_FUSION_MIN_TE):
        have = f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"
        return f"{flag}: Megatron-FSDP needs Transformer Engine >= 2.10 for gradient accumulation fusion ({have})"
    return None


def lacking(ctx: Context, dest: str) -> str | None:
    """The first capability that the toggle's fast value needs (``Toggle.needs`` in the registry)
    and that this machine lacks: ``False``, not merely unknown (``None``)."""
    return next((need for need in BY_DEST[dest].needs if getattr(ctx.caps, need) is False), None)


def _wgrad_kernel_available(ctx: Context) -> bool:
    return ctx.caps.apex_fused_wgrad or (ctx.caps.wgrad_fallback and ctx.env.wgrad_fallback)


def _mxfp4_fusion_stays_on(ctx: Context) -> bool:
    # Looks ahead of the later guards: only a fusion that will really stay on needs the bf16 buffer.
    return bool(
        ctx.args.get("fp4") and ctx.args.get("fp4_recipe") == "mxfp4"
        and _on(ctx.values, "gradient_accumulation_fusion") and _fsdp_blocks_fusion(ctx) is None
        and _wgrad_kernel_available(ctx)
    )


def grad_reduce_yields_to_fsdp_comm_dtype(ctx: Context) -> Iterator[Change]:
    """An explicit `--megatron-fsdp-grad-comm-dtype` other than bf16 turns the bf16 gradient-reduction
    default off, where the Megatron at hand (0.17 to 0.18.2) would overwrite it with bf16."""
    a = ctx.args
    dtype = a.get("megatron_fsdp_grad_comm_dtype")
    if (a.get("use_megatron_fsdp") and dtype not in (None, "auto", "bf16") and _on(ctx.values, "grad_reduce_in_bf16")
            and ctx.caps.megatron.has_rule("grad_reduce_bf16_forces_mfsdp_grad_comm_dtype")):
        yield Change("grad_reduce_in_bf16", False,
                     f"--megatron-fsdp-grad-comm-dtype {dtype} was asked for, and this Megatron overrides it with bf16 "
                     "under grad_reduce_in_bf16", yields_to_cli=True,
                     requested_by=f"--megatron-fsdp-grad-comm-dtype {dtype}")


def grad_reduce_yields_to_fp32_accumulation(ctx: Context) -> Iterator[Change]:
    """An explicit `--accumulate-allreduce-grads-in-fp32` turns the bf16 gradient-reduction default off:
    Megatron's validate_args would silently drop the fp32 request under it."""
    if ctx.args.get("accumulate_allreduce_grads_in_fp32") and _on(ctx.values, "grad_reduce_in_bf16"):
        yield Change(
            "grad_reduce_in_bf16", False,
            "--accumulate-allreduce-grads-in-fp32 asks for fp32 gradient accumulation and reduction, which "
            "Megatron's validate_args would silently drop under grad_reduce_in_bf16",
            yields_to_cli=True, requested_by="--accumulate-allreduce-grads-in-fp32",
        )


def mxfp4_bf16_wgrad(ctx: Context) -> Iterator[Change]:
    """With `--fp4-recipe mxfp4` and gradient accumulation fusion on, the gradient buffer is forced to
    bf16, even over an explicit `--no-grad-reduce-in-bf16` (with a warning): the a4w4 weight-gradient
    GEMM writes only bf16."""
    if _mxfp4_fusion_stays_on(ctx) and not _on(ctx.values, "grad_reduce_in_bf16"):
        yield Change(
            "grad_reduce_in_bf16",
            True,
            "mxfp4 with gradient accumulation fusion: the a4w4 weight-gradient GEMM (aiter "
            "gemm_a4w4_asm) only writes bf16, so the gradient buffer must be bf16",
            over_cli=True,
        )


def _saved_layout(ctx: Context) -> tuple[str, str]:
    recorded = ctx.checkpoint.get("optimizer_layout")
    if isinstance(recorded, (list, tuple)) and len(recorded) == 2:
        return str(recorded[0]), str(recorded[1])
    # An entry from before layouts were recorded: the resuming run's own arguments stand in.
    return optimizer_layout(ctx.args, ctx.caps.megatron.version, ctx.caps.torch_version)


def grad_reduce_checkpoint_layout(ctx: Context) -> Iterator[Change]:
    """On resume, `grad_reduce_in_bf16` keeps the value that gives the saved gradient buffer where the
    distributed optimizer's checkpoint is keyed by the gradient dtype (the other value cannot load); an
    explicit flag against it is refused. `--no-load-optim`, `--finetune` and the model-space layouts
    leave the choice free."""
    ck = ctx.checkpoint
    if not ck or not loads_optimizer_state(ctx.args) or ck.get("optimizer_state_saved") is False:
        return
    saved_value = ck.get("decisions", {}).get("grad_reduce_in_bf16")
    saved = ck.get("grad_buffer_dtype") or (
        grad_buffer_dtype(ctx.args, bool(saved_value)) if saved_value is not None else None)
    now = _on(ctx.values, "grad_reduce_in_bf16")
    if saved is None or grad_buffer_dtype(ctx.args, now) == saved or grad_buffer_dtype(ctx.args, not now) != saved:
        return  # same buffer, or one this toggle cannot bring back (the precision flags changed)
    kind, name = _saved_layout(ctx)
    if kind != GRAD_DTYPE_KEYED:
        return
    reason = (f"the checkpoint in {ctx.args.get('load')} (iteration {ck.get('iteration')}) was saved with a "
              f"{saved} gradient buffer, and its distributed-optimizer state ({name}) is keyed by the gradient "
              "dtype, so another buffer cannot load")
    hint = "resume with the saved value, or pass --no-load-optim to start the optimizer state fresh"
    if now and _mxfp4_fusion_stays_on(ctx):  # going back to fp32, which mxfp4 fusion cannot write
        yield Change("gradient_accumulation_fusion", False,
                     f"{reason}; mxfp4's weight-gradient kernel writes only bf16, so gradient accumulation "
                     "fusion cannot stay on", "pass --no-gradient-accumulation-fusion, or --no-load-optim to "
                     "start the optimizer state fresh")
    yield Change("grad_reduce_in_bf16", not now, reason, hint)


def cross_entropy_fusion_deterministic(ctx: Context) -> Iterator[Change]:
    """Cross-entropy loss fusion goes off under `--deterministic-mode`, where Megatron rejects it; an
    explicit `--cross-entropy-loss-fusion` with it is refused."""
    if ctx.args.get("deterministic_mode") and _on(ctx.values, "cross_entropy_loss_fusion") \
            and (ctx.caps.megatron.has_rule("deterministic_ce_fusion")
                 or ctx.caps.megatron.has_rule("deterministic_ce_fusion_019")):
        yield Change(
            "cross_entropy_loss_fusion", False,
            "--deterministic-mode: Megatron rejects cross-entropy loss fusion there (the fused kernel is "
            "not deterministic)",
            hint="drop --cross-entropy-loss-fusion or --deterministic-mode",
        )


def _te_fused_cross_entropy_on(ctx: Context) -> bool:
    return _on(ctx.values, "cross_entropy_loss_fusion") and ctx.values.get("cross_entropy_fusion_impl") == "te"


def _te_impl_cannot_stay(ctx: Context, reason: str, hint: str, capability: str = "") -> Change:
    """Fused te cross-entropy cannot run: the impl goes native, unless te was asked for by name and
    the fusion only by default. Stock Megatron (fusion off by default) accepts that command line,
    so then the fusion default yields instead."""
    if ctx.sources.get("cross_entropy_fusion_impl") == "cli" and ctx.sources.get("cross_entropy_loss_fusion") != "cli":
        return Change("cross_entropy_loss_fusion", False, f"{reason}, and --cross-entropy-fusion-impl te was "
                      "given explicitly", hint="pass --cross-entropy-fusion-impl native", capability=capability)
    return Change("cross_entropy_fusion_impl", "native", reason, hint=hint, capability=capability)


def cross_entropy_te_asserted(ctx: Context) -> Iterator[Change]:
    """The cross-entropy impl `te` becomes `native` where Megatron asserts against it with loss fusion
    (0.18.2 and later); if `te` was asked for by name, the fusion default yields instead."""
    if _te_fused_cross_entropy_on(ctx) and ctx.caps.megatron.asserts_te_cross_entropy:
        reason = (f"Megatron {ctx.caps.megatron.version or ''} rejects the te impl with "
                  "--cross-entropy-loss-fusion (stability assertion in validate_args)").replace("  ", " ")
        yield _te_impl_cannot_stay(ctx, reason, hint="use --cross-entropy-fusion-impl native")


def cross_entropy_te_distillation(ctx: Context) -> Iterator[Change]:
    """The impl `te` becomes `native` with ModelOpt distillation (`--export-kd-teacher-load`), which does
    not take TE's cross entropy."""
    if ctx.args.get("export_kd_teacher_load") and ctx.values.get("cross_entropy_fusion_impl") == "te" \
            and ctx.caps.megatron.has_rule("ce_te_impl_distillation"):
        yield Change("cross_entropy_fusion_impl", "native",
                     "--export-kd-teacher-load: ModelOpt distillation does not take TE's cross-entropy",
                     hint="use --cross-entropy-fusion-impl native")


def cross_entropy_te_full_iteration_graph(ctx: Context) -> Iterator[Change]:
    """The impl `te` becomes `native` under a full-iteration CUDA graph with Transformer Engine older than
    2.7."""
    a = ctx.args
    full = a.get("cuda_graph_impl") == "full_iteration" or "full_iteration" in _graph_modules(a)
    if full and _te_fused_cross_entropy_on(ctx) and not _te_at_least(ctx.caps, CE_TE_FULL_GRAPH_MIN_TE) \
            and ctx.caps.megatron.has_rule("ce_te_full_iteration_graph_old_te"):
        have = f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"
        yield Change("cross_entropy_fusion_impl", "native",
                     f"a full-iteration CUDA graph needs Transformer Engine >= 2.7 for TE's cross-entropy ({have})",
                     hint="use --cross-entropy-fusion-impl native")


def cross_entropy_te_missing(ctx: Context) -> Iterator[Change]:
    """The impl `te` becomes `native` where Transformer Engine lacks its parallel cross-entropy kernel."""
    need = lacking(ctx, "cross_entropy_fusion_impl") if _te_fused_cross_entropy_on(ctx) else None
    if need:
        why = ctx.caps.notes.get(need) or ctx.caps.notes.get("te") or (
            "Transformer Engine's parallel cross-entropy kernel is not available"
        )
        yield _te_impl_cannot_stay(ctx, why, hint="install Transformer Engine or use --cross-entropy-fusion-impl "
                                   "native", capability=need)


def cross_entropy_impl_unused(ctx: Context) -> Iterator[Change]:
    """With loss fusion off the impl is unused, so Megatron's own value (`native`) stands and no rule about
    `te` can reject it."""
    # Without the fusion the impl is never used: leave Megatron's own value, so no rule about the
    # te impl (distillation, graphs, stability) can reject a setting that does nothing.
    if not _on(ctx.values, "cross_entropy_loss_fusion") and ctx.values.get("cross_entropy_fusion_impl") == "te" \
            and ctx.sources.get("cross_entropy_fusion_impl") == "default":
        yield Change("cross_entropy_fusion_impl", "native",
                     "cross-entropy loss fusion is off, so the impl is unused: Megatron's default stands")


def gradient_accumulation_fusion_fsdp(ctx: Context) -> Iterator[Change]:
    """Gradient accumulation fusion goes off with `--use-torch-fsdp2`, and with Megatron-FSDP only where
    Megatron refuses it (v2, core 0.13's sharded custom FSDP, or Transformer Engine older than 2.10)."""
    reason = _fsdp_blocks_fusion(ctx) if _on(ctx.values, "gradient_accumulation_fusion") else None
    if reason:
        yield Change("gradient_accumulation_fusion", False, reason,
                     hint="drop --gradient-accumulation-fusion or the FSDP flag")


def gradient_accumulation_fusion_apex(ctx: Context) -> Iterator[Change]:
    """Without APEX's `fused_weight_gradient_mlp_cuda`, gradient accumulation fusion stays on through the
    package's torch fallback where it can run, and goes off otherwise."""
    if not _on(ctx.values, "gradient_accumulation_fusion") or not lacking(ctx, "gradient_accumulation_fusion"):
        return
    missing = ctx.caps.notes.get("apex_fused_wgrad") or "APEX's fused_weight_gradient_mlp_cuda is not available"
    if _wgrad_kernel_available(ctx):
        yield Change("gradient_accumulation_fusion", True,
                     f"{missing}: the torch fallback ({WGRAD_FALLBACK_WORDS}) stands in",
                     capability="wgrad_fallback")
        return
    if not ctx.env.wgrad_fallback:
        why_not = "MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK=0"
    else:
        why_not = ctx.caps.notes.get("wgrad_fallback") or "the torch fallback cannot run here"
    yield Change(
        "gradient_accumulation_fusion",
        False,
        f"{missing}, and no fallback ({why_not})",
        hint="install APEX (with --cuda_ext) or pass --no-gradient-accumulation-fusion",
        capability="apex_fused_wgrad",
    )


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


def fused_qkv_rope_unsupported(ctx: Context) -> Iterator[Change]:
    """Fused single-QKV RoPE goes off without the TransformerConfig field (before core 0.15) or TE's fused
    QKV RoPE kernel, and with q/k layer norm or L2 norm, packed (THD) sequences, flash-decode, an
    attention output gate, RoPE-free layers, `--rotary-interleaved`, RL rollouts, or a position
    embedding other than RoPE."""
    if not _on(ctx.values, "fused_single_qkv_rope"):
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
        reason = next((f"{flag_of(dest)}{why}" for dest, why in FUSED_QKV_ROPE_BLOCKERS if a.get(dest)), "")
    if reason:
        yield Change(
            "fused_single_qkv_rope",
            False,
            reason.replace("  ", " "),
            hint="pass --no-fused-single-qkv-rope",
            capability=capability,
        )


def ddp_average_unsupported(ctx: Context) -> Iterator[Change]:
    """Averaging inside the data-parallel collective goes off with `--calculate-per-token-loss` or GTP
    weight shards."""
    if not _on(ctx.values, "ddp_average_in_collective"):
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
    if shards and ctx.caps.megatron.asserts_ddp_average_with_gtp is not False:
        yield Change(
            "ddp_average_in_collective",
            False,
            f"{flag_of(shards[0])} > 1 enables GTP, which rejects averaging in the collective",
            hint="pass --no-ddp-average-in-collective",
        )


GUARDS: tuple[Guard, ...] = (
    grad_reduce_yields_to_fp32_accumulation,
    grad_reduce_yields_to_fsdp_comm_dtype,
    mxfp4_bf16_wgrad,
    grad_reduce_checkpoint_layout,
    cross_entropy_fusion_deterministic,
    cross_entropy_te_asserted,
    cross_entropy_te_distillation,
    cross_entropy_te_full_iteration_graph,
    cross_entropy_te_missing,
    cross_entropy_impl_unused,
    gradient_accumulation_fusion_fsdp,
    gradient_accumulation_fusion_apex,
    fused_qkv_rope_unsupported,
    ddp_average_unsupported,
)


# --- features that need a toggle: a guard may not take it away from them -----------------------


def _needs_defer_embedding_wgrad(ctx: Context) -> str | None:
    return "--defer-embedding-wgrad-compute" if ctx.args.get("defer_embedding_wgrad_compute") else None


def _needs_delay_wgrad_cuda_graph(ctx: Context) -> str | None:
    a = ctx.args
    if not (a.get("delay_wgrad_compute") and a.get("overlap_grad_reduce")):
        return None
    modules = _graph_modules(a)
    router = "moe_router" in modules and a.get("moe_shared_expert_intermediate_size") is not None \
        and not a.get("moe_shared_expert_overlap")
    if "attn" in modules or router:
        return "--delay-wgrad-compute with --overlap-grad-reduce and attention/router CUDA graphs"
    return None


def _needs_delay_wgrad_old_te(ctx: Context) -> str | None:
    if ctx.args.get("delay_wgrad_compute") and not _te_at_least(ctx.caps, DELAY_WGRAD_FUSION_OFF_MIN_TE):
        have = f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"
        return f"--delay-wgrad-compute with {have} (fusion off needs TE >= 2.7)"
    return None


def _needs_fp32_local_accumulation(ctx: Context) -> str | None:
    if ctx.args.get("ddp_param_name_patterns_for_fp32_local_accumulation"):
        return "--ddp-param-name-patterns-for-fp32-local-accumulation"
    return None


# (dest, the value the feature needs, Megatron's rule id, who asks for it)
NEEDS: tuple[tuple[str, Any, str, Callable[[Context], str | None]], ...] = (
    ("gradient_accumulation_fusion", True, "defer_embedding_wgrad_needs_fusion", _needs_defer_embedding_wgrad),
    ("gradient_accumulation_fusion", True, "delay_wgrad_cuda_graph_needs_fusion", _needs_delay_wgrad_cuda_graph),
    ("gradient_accumulation_fusion", True, "delay_wgrad_fusion_off_te", _needs_delay_wgrad_old_te),
    ("grad_reduce_in_bf16", True, "ddp_fp32_local_accum_patterns_need_bf16_grads", _needs_fp32_local_accumulation),
)


def _check_needs(ctx: Context, dest: str, base: Decision, change: Change) -> None:
    """A guard is about to move ``dest`` away from ``base``: refuse with one line if something the
    user asked for needs ``base``'s value (Megatron would reject the command line otherwise)."""
    for need_dest, value, rule, feature in NEEDS:
        if need_dest != dest or value != base.value or value == change.value \
                or not ctx.caps.megatron.has_rule(rule):
            continue
        words = feature(ctx)
        if words:
            raise DependencyError(dest, words, change.reason, change.hint)


# --- resolution -------------------------------------------------------------------------------


def _flag_words(dest: str, value: Any) -> str:
    toggle = BY_DEST.get(dest)
    if toggle is not None:
        return " ".join(toggle.flag_for(value))
    return flag_of(dest)


def _base(dest: str, explicit: Mapping[str, Any], env: EnvSettings, stock: Mapping[str, Any],
          profile: Profile | None = None) -> Decision:
    """cli > env > profile > default. A profile applies with MEGATRON_PERF_TOGGLES=0 too, as set
    variables do: naming a profile is a request, not a default."""
    toggle = BY_DEST[dest]
    if dest in explicit:
        value = explicit[dest]
        return Decision(value, "cli", f"set on the command line ({_flag_words(dest, value)})")
    if dest in env.toggles:
        value = env.toggles[dest]
        raw = value if toggle.kind == "choice" else int(bool(value))
        return Decision(value, "env", f"{toggle.env}={raw}")
    if profile is not None and dest in profile.toggles:
        return Decision(profile.toggles[dest].value, "profile", profile.reason(dest))
    if not env.plugin_enabled:
        value = stock.get(dest, toggle.stock_default)
        return Decision(value, "default", "MEGATRON_PERF_TOGGLES=0: Megatron's own default")
    return Decision(toggle.default, "default", f"plugin default; {toggle.env}=0 turns it off"
                    if toggle.kind == "bool" else f"plugin default; set {toggle.env} to change it")


def requested(dest: str, env: EnvSettings, profile: Profile | None = None) -> Decision:
    """What the environment and the profile ask for ``dest`` before any command line or guard
    (the same precedence as a launch): what ``megatron-perf-toggles flags`` turns into flags."""
    return _base(dest, {}, env, {}, profile)


def _fp4_defaults(args: Mapping[str, Any], env: EnvSettings, stock: Mapping[str, Any]) -> dict[str, Decision]:
    """The FP4 layer selection nobody asked for: the recipe's (or, switched off, Megatron's own)."""
    recipe = str(args.get("fp4_recipe") or "nvfp4")
    by_recipe, start, end = FP4_RECIPE_SELECTION.get(recipe, (False, 2, 8))
    if env.plugin_enabled:
        label = "first/last layers in bf16" if by_recipe else "every layer in FP4"
        return {FP4_LAYER_DESTS[0]: Decision(by_recipe, "default", f"{recipe} recipe default: {label}"),
                FP4_LAYER_DESTS[1]: Decision(start, "default", f"{recipe} recipe default"),
                FP4_LAYER_DESTS[2]: Decision(end, "default", f"{recipe} recipe default")}
    off = "MEGATRON_PERF_TOGGLES=0: Megatron's own default"
    return {dest: Decision(stock.get(dest, value), "default", off)
            for dest, value in zip(FP4_LAYER_DESTS, MEGATRON_FP4_LAYER_DEFAULTS, strict=True)}


def _fp4_selection(args: Mapping[str, Any], explicit: Mapping[str, Any], env: EnvSettings,
                   stock: Mapping[str, Any]) -> tuple[dict[str, Decision], list[Message]]:
    """FP4 layer selection: CLI > FP4_* environment > the recipe's default (with the master
    switch off, Megatron's own defaults instead). Layer counts never switch selection on by
    themselves: Megatron reads them only with --first-last-layers-bf16, and the mxfp4 recipe
    trains every layer in FP4 unless selection is asked for."""
    if not args.get("fp4"):
        return {}, []
    defaults = _fp4_defaults(args, env, stock)
    out: dict[str, Decision] = {}
    if "first_last_layers_bf16" in explicit:
        value = explicit["first_last_layers_bf16"]
        out["first_last_layers_bf16"] = Decision(value, "cli", "set on the command line (--first-last-layers-bf16)")
    elif env.fp4_selective_bf16 is not None:
        out["first_last_layers_bf16"] = Decision(
            env.fp4_selective_bf16, "env", f"FP4_SELECTIVE_BF16={int(env.fp4_selective_bf16)}")
    else:
        out["first_last_layers_bf16"] = defaults["first_last_layers_bf16"]
    selection = out["first_last_layers_bf16"]
    if not selection.value:
        return out, _fp4_counts_unused(explicit, env, selection)
    for dest, env_value, var in (
        ("num_layers_at_start_in_bf16", env.fp4_bf16_start, "FP4_BF16_START"),
        ("num_layers_at_end_in_bf16", env.fp4_bf16_end, "FP4_BF16_END"),
    ):
        if dest in explicit:
            out[dest] = Decision(explicit[dest], "cli", f"set on the command line ({flag_of(dest)})")
        elif env_value is not None:
            out[dest] = Decision(env_value, "env", f"{var}={env_value}")
        else:
            out[dest] = defaults[dest]
    _fp4_counts_per_stage(args, out)
    return out, []


def _fp4_counts_unused(explicit: Mapping[str, Any], env: EnvSettings, selection: Decision) -> list[Message]:
    """Layer counts given while selection is off: they do nothing, which is worth a warning."""
    given = [flag_of(d) for d in FP4_LAYER_DESTS[1:] if d in explicit]
    given += [var for var, value in (("FP4_BF16_START", env.fp4_bf16_start), ("FP4_BF16_END", env.fp4_bf16_end))
              if value is not None]
    if not given:
        return []
    return [Message(
        "warning",
        f"{' and '.join(given)} set, but FP4 selective bf16 is off ({selection.reason}): every layer trains "
        "in FP4 and the counts are unused; set FP4_SELECTIVE_BF16=1 (or pass --first-last-layers-bf16) "
        "to keep those layers in bf16",
    )]


def _fp4_counts_per_stage(args: Mapping[str, Any], out: dict[str, Decision]) -> None:
    """With fp8 Megatron bounds each count by one pipeline stage's layers; without, it does not."""
    per_stage = _layers_per_stage(args)
    if per_stage is None:
        return
    for dest in FP4_LAYER_DESTS[1:]:
        d = out[dest]
        if d.value <= per_stage:
            continue
        if args.get("fp8") and d.source != "cli":
            # TransformerConfig.__post_init__ bounds the counts by one pipeline stage, inside `if fp8`.
            out[dest] = Decision(per_stage, "guard", (
                f"{d.value} layers requested ({d.reason}), but with fp8 Megatron's TransformerConfig allows at "
                f"most the {per_stage} layers of one pipeline stage"))
        elif not args.get("fp8"):
            out[dest] = Decision(d.value, d.source, (
                f"{d.reason}; FP4 picks its bf16 layers by global layer number, so the count is not bounded by "
                f"a pipeline stage's {per_stage} layers (Megatron bounds it only with fp8)"))


def _layers_per_stage(args: Mapping[str, Any]) -> int | None:
    """Layers in one pipeline stage, as Megatron's fp8 rule counts them (num_layers // PP)."""
    layers = args.get("num_layers")
    if not isinstance(layers, int) or layers <= 0:
        return None
    pp = args.get("pipeline_model_parallel_size") or 1
    return max(layers // pp, 0)


def _advice(args: Mapping[str, Any]) -> list[Message]:
    out: list[Message] = []
    lr, eps = args.get("lr"), args.get("adam_eps")
    min_lr, max_eps = ADAM_EPS_ADVICE
    if (
        str(args.get("optimizer") or "adam").startswith("adam")
        and isinstance(lr, (int, float)) and isinstance(eps, (int, float))
        and lr >= min_lr and eps < max_eps
    ):
        out.append(Message(
            "advice",
            f"--adam-eps {eps:g} with --lr {lr:g}: a small epsilon at a high learning rate can "
            "plateau (grad norm climbing); the MLPerf Llama-3.1-8B recipe uses --adam-eps 1e-5 "
            "at lr 8e-4. Nothing was changed.",
        ))
    if args.get("yaml_cfg"):
        out.append(Message(
            "warning",
            "--yaml-cfg replaces the whole parsed namespace after this step: the toggles decided "
            "here (and any provider-added argument) do not carry over; set them in the YAML file.",
        ))
    return out


class _Resolution:
    """The decisions as the guards change them, with what each change must respect: the base
    decisions (cli, env, default), the explicit values a guard overrode (warned about), and the
    room one guard made for an explicit request that a later guard may not silently take back."""

    def __init__(self, decisions: dict[str, Decision], env: EnvSettings, caps: Capabilities) -> None:
        self.decisions = decisions
        self.base = dict(decisions)
        self.env, self.caps = env, caps
        self.messages: list[Message] = []
        self.overridden: dict[str, Message] = {}  # dest -> the warning that a cli/env value was overridden
        self.made_room: dict[str, Change] = {}  # dest -> the change that moved it for another explicit request

    def context(self, args: Mapping[str, Any], checkpoint: Mapping[str, Any] | None) -> Context:
        return Context(args=args, values={k: d.value for k, d in self.decisions.items()}, caps=self.caps,
                       env=self.env, checkpoint=checkpoint or {},
                       sources={k: d.source for k, d in self.decisions.items()})

    def apply(self, ctx: Context, change: Change) -> None:
        """One guard's change, or the CannotHonourError an explicit request gets instead."""
        current = self.decisions[change.dest]
        if current.value == change.value:
            # A guard that keeps the value still says how (e.g. which wgrad path runs).
            self.decisions[change.dest] = Decision(current.value, current.source, f"{current.reason}; {change.reason}")
            return
        if current.source == "cli" and change.yields_to_cli:
            return
        if current.source == "cli" and not change.over_cli:
            raise CannotHonourError(change.dest, _flag_words(change.dest, current.value), change.reason, change.hint)
        if current.source == "default" and not self.env.plugin_enabled:
            # MEGATRON_PERF_TOGGLES=0 means stock Megatron: its own defaults stand, guards only
            # act on what the environment asked for.
            self.decisions[change.dest] = Decision(current.value, current.source,
                                                   f"{current.reason}; left as stock although {change.reason}")
            return
        _check_needs(ctx, change.dest, self.base[change.dest], change)
        self._respect_room(change)
        assumed = bool(change.capability) and self.caps.is_assumed(change.capability)
        source = "assumed" if assumed else "guard"
        planned = "the planned stack" if self.caps.stack else "MEGATRON_PERF_TOGGLES_ASSUME"
        reason = change.reason + (f" (per {planned})" if assumed else "")
        first = self.base[change.dest]
        if change.value == first.value:  # a later guard gave back what the user or default asked for
            self.overridden.pop(change.dest, None)
            self.decisions[change.dest] = Decision(first.value, first.source, f"{first.reason}; {reason}")
            return
        if first.source in ("cli", "env", "profile"):
            self.overridden[change.dest] = Message(
                "warning", f"{change.dest}: {first.value} ({first.reason}) overridden to {change.value}: {reason}")
        self.decisions[change.dest] = Decision(change.value, source, reason)

    def _respect_room(self, change: Change) -> None:
        room = self.made_room.get(change.dest)
        if room is not None and change.value != room.value:
            if not change.over_cli:
                raise CannotHonourError(change.dest, room.requested_by, change.reason, change.hint)
            self.messages.append(Message("warning", f"{room.requested_by} was requested, but {change.reason}; "
                                                    f"{change.dest} goes back to {change.value}"))
        if change.requested_by:
            self.made_room[change.dest] = change


def decide(
    args: Mapping[str, Any],
    explicit: Mapping[str, Any],
    env: EnvSettings,
    caps: Capabilities,
    stock: Mapping[str, Any] | None = None,
    checkpoint: Mapping[str, Any] | None = None,
    profile: Profile | None = None,
    observed: Observed | None = None,
) -> Plan:
    """Resolve every toggle, then let the guards veto what cannot be honoured.

    ``args`` is the parsed namespace (non-explicit toggles at any value), ``explicit`` the dests
    the command line set, ``stock`` Megatron's own defaults (used when the plugin is disabled),
    ``checkpoint`` what the launch that wrote the checkpoint being resumed recorded (resume.py).
    ``profile`` the parsed MEGATRON_PERF_TOGGLES_PROFILE, compared with ``observed`` (this run's
    environment, as far as it is known now). Raises CannotHonourError for an explicit
    command-line request that a guard rejects.
    """
    stock = stock or {}
    decisions = {t.dest: _base(t.dest, explicit, env, stock, profile) for t in TOGGLES}
    fp4_decisions, messages = _fp4_selection(args, explicit, env, stock)
    decisions.update(fp4_decisions)
    resolution = _Resolution(decisions, env, caps)
    resolution.messages = messages
    for guard in GUARDS:
        ctx = resolution.context(args, checkpoint)
        for change in guard(ctx):
            resolution.apply(ctx, change)
    messages.extend(resolution.overridden.values())
    profile_record = None
    if profile is not None:
        from .profile import profile_in_use

        profile_record, line = profile_in_use(profile, observed)
        if line:
            messages.append(Message("profile", line))
    messages.extend(_advice(args))
    tag = precision_tag(args)
    log_dirs = tagged_log_dirs(args, tag) if env.tag_log_dir else {}
    if env.tag_log_dir:
        messages.extend(Message("warning", text) for text in log_dir_warnings(args, tag))
    fused = decisions["gradient_accumulation_fusion"].value
    wgrad_path = "off" if not fused else ("apex" if caps.apex_fused_wgrad else (
        "fallback" if caps.wgrad_fallback and env.wgrad_fallback else "missing"))
    return Plan(decisions=decisions, precision=tag, log_dirs=log_dirs, messages=messages, wgrad_path=wgrad_path,
                profile=profile_record)
