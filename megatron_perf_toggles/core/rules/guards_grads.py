"""The guards of the gradient buffer and of gradient accumulation fusion, and the features that
need those toggles (a guard may not take a toggle away from them).

Each guard is declared with ``@guard``: the toggles it may move and the Megatron rules it answers
(``guard_base``). The order they run in is ``guards.GUARDS``.
"""

from __future__ import annotations

from collections.abc import Iterator

from .. import stock_off
from ..ckpt_layout import GRAD_DTYPE_KEYED, grad_buffer_dtype, optimizer_layout
from ..decision.plan import Change, Context
from .guard_base import (
    Need,
    as_saved,
    carries,
    declared_in,
    graph_modules,
    guard,
    is_on,
    lacking,
    resume_loads_optimizer,
    rule,
    te_at_least,
)

WGRAD_FALLBACK_WORDS = "torch.addmm with fp32 accumulation"
MFSDP_V2_FUSION = rule("mfsdp_v2_fusion")
CUSTOM_FSDP_SHARDED = rule("custom_fsdp_sharded_rejects_fusion")
MFSDP_GRAD_COMM_DTYPE = rule("grad_reduce_bf16_forces_mfsdp_grad_comm_dtype")
FSDP_FLAGS = (("use_torch_fsdp2", "--use-torch-fsdp2"), ("use_megatron_fsdp", "--use-megatron-fsdp"),
              ("use_custom_fsdp", "--use-custom-fsdp"))
MFSDP_FUSION_MIN_TE = (2, 10)  # Megatron-FSDP's adapter asserts this TE for gradient accumulation fusion
DELAY_WGRAD_FUSION_OFF_MIN_TE = (2, 7)  # delay_wgrad_compute with fusion off asserts this TE


def _fsdp_blocks_fusion(ctx: Context) -> str | None:
    """Why this FSDP layout cannot keep gradient accumulation fusion, following the rule of the
    Megatron at hand; None where it can (or no FSDP is used)."""
    a = ctx.args
    if a.get("use_torch_fsdp2"):
        return "--use-torch-fsdp2: Megatron rejects gradient accumulation fusion with torch FSDP2"
    flag = next((f for d, f in FSDP_FLAGS[1:] if a.get(d)), None)
    if flag is None:
        return None
    if a.get("megatron_fsdp_version") == 2 and carries(ctx, MFSDP_V2_FUSION):
        return f"{flag} --megatron-fsdp-version 2: Megatron-FSDP v2 does not support gradient accumulation fusion"
    strategy = a.get("data_parallel_sharding_strategy")
    if strategy in ("optim_grads", "optim_grads_params") and carries(ctx, CUSTOM_FSDP_SHARDED):
        return f"{flag} with --data-parallel-sharding-strategy {strategy}: this Megatron rejects gradient accumulation fusion"
    if not te_at_least(ctx.caps, MFSDP_FUSION_MIN_TE):
        have = f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"
        return f"{flag}: Megatron-FSDP needs Transformer Engine >= 2.10 for gradient accumulation fusion ({have})"
    return None


def _wgrad_kernel_available(ctx: Context) -> bool:
    return stock_off.wgrad_path(True, ctx.caps, ctx.env) != "missing"  # the plugin off installs no fallback


def _mxfp4_fusion_stays_on(ctx: Context) -> bool:
    # Looks ahead of the later guards: only a fusion that will really stay on needs the bf16 buffer.
    return bool(
        ctx.args.get("fp4") and ctx.args.get("fp4_recipe") == "mxfp4"
        and is_on(ctx.values, "gradient_accumulation_fusion") and _fsdp_blocks_fusion(ctx) is None
        and _wgrad_kernel_available(ctx)
    )


@guard(moves=("grad_reduce_in_bf16",), answers=(rule("grad_reduce_bf16_drops_fp32_accumulation"),))
def grad_reduce_yields_to_fp32_accumulation(ctx: Context) -> Iterator[Change]:
    """An explicit `--accumulate-allreduce-grads-in-fp32` turns the bf16 gradient-reduction default off:
    Megatron's validate_args would silently drop the fp32 request under it."""
    if ctx.args.get("accumulate_allreduce_grads_in_fp32") and is_on(ctx.values, "grad_reduce_in_bf16"):
        yield Change(
            "grad_reduce_in_bf16", False,
            "--accumulate-allreduce-grads-in-fp32 asks for fp32 gradient accumulation and reduction, which "
            "Megatron's validate_args would silently drop under grad_reduce_in_bf16",
            yields_to_cli=True, requested_by="--accumulate-allreduce-grads-in-fp32",
        )


@guard(moves=("grad_reduce_in_bf16",), answers=(MFSDP_GRAD_COMM_DTYPE,))
def grad_reduce_yields_to_fsdp_comm_dtype(ctx: Context) -> Iterator[Change]:
    """An explicit `--megatron-fsdp-grad-comm-dtype` other than bf16 turns the bf16 gradient-reduction
    default off, where the Megatron at hand (0.17 to 0.18.2) would overwrite it with bf16."""
    a = ctx.args
    dtype = a.get("megatron_fsdp_grad_comm_dtype")
    if (a.get("use_megatron_fsdp") and dtype not in (None, "auto", "bf16") and is_on(ctx.values, "grad_reduce_in_bf16")
            and carries(ctx, MFSDP_GRAD_COMM_DTYPE)):
        yield Change("grad_reduce_in_bf16", False,
                     f"--megatron-fsdp-grad-comm-dtype {dtype} was asked for, and this Megatron overrides it with bf16 "
                     "under grad_reduce_in_bf16", yields_to_cli=True,
                     requested_by=f"--megatron-fsdp-grad-comm-dtype {dtype}")


@guard(moves=("grad_reduce_in_bf16",))  # aiter's a4w4 kernel, not a Megatron rule
def mxfp4_bf16_wgrad(ctx: Context) -> Iterator[Change]:
    """With `--fp4-recipe mxfp4` and gradient accumulation fusion on, the gradient buffer is forced to
    bf16, even over an explicit `--no-grad-reduce-in-bf16` (with a warning): the a4w4 weight-gradient
    GEMM writes only bf16."""
    if _mxfp4_fusion_stays_on(ctx) and not is_on(ctx.values, "grad_reduce_in_bf16"):
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


@guard(moves=("grad_reduce_in_bf16", "gradient_accumulation_fusion"))  # the checkpoint being resumed
def grad_reduce_checkpoint_layout(ctx: Context) -> Iterator[Change]:
    """On resume, `grad_reduce_in_bf16` keeps the value that gives the saved gradient buffer where the
    distributed optimizer's checkpoint is keyed by the gradient dtype (the other value cannot load); an
    explicit flag against it is refused. A checkpoint no launch of the plugin recorded holds what stock
    saved (the command line's value, else off). `--no-load-optim`, `--finetune` and the model-space
    layouts leave the choice free."""
    ck = ctx.checkpoint
    if not ck or not resume_loads_optimizer(ctx):
        return
    saved = ck.get("grad_buffer_dtype")
    if not saved:
        saved_value = as_saved(ctx, "grad_reduce_in_bf16")  # unrecorded: as stock saved it
        if saved_value is None:
            return
        saved = grad_buffer_dtype(ctx.args, saved_value)
    now = is_on(ctx.values, "grad_reduce_in_bf16")
    if grad_buffer_dtype(ctx.args, now) == saved or grad_buffer_dtype(ctx.args, not now) != saved:
        return  # same buffer, or one this toggle cannot bring back (the precision flags changed)
    kind, name = _saved_layout(ctx)
    if kind != GRAD_DTYPE_KEYED:
        return
    reason = (f"the checkpoint in {ck.get('load_dir') or ctx.args.get('load')} (iteration {ck.get('iteration')}) was saved with a "
              f"{saved} gradient buffer, and its distributed-optimizer state ({name}) is keyed by the gradient "
              "dtype, so another buffer cannot load")
    hint = "resume with the saved value, or pass --no-load-optim to start the optimizer state fresh"
    if now and _mxfp4_fusion_stays_on(ctx):  # going back to fp32, which mxfp4 fusion cannot write
        yield Change("gradient_accumulation_fusion", False,
                     f"{reason}; mxfp4's weight-gradient kernel writes only bf16, so gradient accumulation "
                     "fusion cannot stay on", "pass --no-gradient-accumulation-fusion, or --no-load-optim to "
                     "start the optimizer state fresh")
    yield Change("grad_reduce_in_bf16", not now, reason, hint)



@guard(moves=("gradient_accumulation_fusion",), answers=(
    rule("fsdp2_fusion"), CUSTOM_FSDP_SHARDED, rule("mfsdp_fusion_te"), MFSDP_V2_FUSION, rule("mfsdp_fusion_te_implicit")))
def gradient_accumulation_fusion_fsdp(ctx: Context) -> Iterator[Change]:
    """Gradient accumulation fusion goes off with `--use-torch-fsdp2`, and with Megatron-FSDP only where
    Megatron refuses it (v2, core 0.13's sharded custom FSDP, or Transformer Engine older than 2.10)."""
    reason = _fsdp_blocks_fusion(ctx) if is_on(ctx.values, "gradient_accumulation_fusion") else None
    if reason:
        yield Change("gradient_accumulation_fusion", False, reason,
                     hint="drop --gradient-accumulation-fusion or the FSDP flag")


@guard(moves=("gradient_accumulation_fusion",), answers=(rule("apex_wgrad_kernel_required"),))
def gradient_accumulation_fusion_apex(ctx: Context) -> Iterator[Change]:
    """Without APEX's `fused_weight_gradient_mlp_cuda`, gradient accumulation fusion stays on through the
    package's torch fallback where it can run, and goes off otherwise."""
    if not is_on(ctx.values, "gradient_accumulation_fusion") or not lacking(ctx, "gradient_accumulation_fusion"):
        return
    missing = ctx.caps.notes.get("apex_fused_wgrad") or "APEX's fused_weight_gradient_mlp_cuda is not available"
    if _wgrad_kernel_available(ctx):
        yield Change("gradient_accumulation_fusion", True,
                     f"{missing}: the torch fallback ({WGRAD_FALLBACK_WORDS}) stands in",
                     capability="wgrad_fallback")
        return
    if not ctx.env.plugin_enabled:
        why_not = "MEGATRON_PERF_TOGGLES=0 installs none"
    elif not ctx.env.wgrad_fallback:
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


# --- features that need a toggle: a guard may not take it away from them -----------------------


def _needs_defer_embedding_wgrad(ctx: Context) -> str | None:
    return "--defer-embedding-wgrad-compute" if ctx.args.get("defer_embedding_wgrad_compute") else None


def _needs_delay_wgrad_cuda_graph(ctx: Context) -> str | None:
    a = ctx.args
    if not (a.get("delay_wgrad_compute") and a.get("overlap_grad_reduce")):
        return None
    modules = graph_modules(a)
    router = "moe_router" in modules and a.get("moe_shared_expert_intermediate_size") is not None \
        and not a.get("moe_shared_expert_overlap")
    if "attn" in modules or router:
        return "--delay-wgrad-compute with --overlap-grad-reduce and attention/router CUDA graphs"
    return None


def _needs_delay_wgrad_old_te(ctx: Context) -> str | None:
    if ctx.args.get("delay_wgrad_compute") and not te_at_least(ctx.caps, DELAY_WGRAD_FUSION_OFF_MIN_TE):
        have = f"Transformer Engine {ctx.caps.te_version}" if ctx.caps.te_version else "no Transformer Engine"
        return f"--delay-wgrad-compute with {have} (fusion off needs TE >= 2.7)"
    return None


def _needs_fp32_local_accumulation(ctx: Context) -> str | None:
    if ctx.args.get("ddp_param_name_patterns_for_fp32_local_accumulation"):
        return "--ddp-param-name-patterns-for-fp32-local-accumulation"
    return None


# The features that need a toggle's value, each with the Megatron rule that makes it so.
NEEDS: tuple[Need, ...] = (
    Need("gradient_accumulation_fusion", True, rule("defer_embedding_wgrad_needs_fusion"), _needs_defer_embedding_wgrad),
    Need("gradient_accumulation_fusion", True, rule("delay_wgrad_cuda_graph_needs_fusion"), _needs_delay_wgrad_cuda_graph),
    Need("gradient_accumulation_fusion", True, rule("delay_wgrad_fusion_off_te"), _needs_delay_wgrad_old_te),
    Need("grad_reduce_in_bf16", True, rule("ddp_fp32_local_accum_patterns_need_bf16_grads"), _needs_fp32_local_accumulation),
)

GUARDS = declared_in(globals())  # in the order they are declared above
