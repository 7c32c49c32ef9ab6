"""Megatron-LM's rules about the mixture-of-experts toggles (grouped GEMM, permute fusion, router
fusion): declared like the other toggles' rules, detected the same way (by the phrase in ``where``),
and part of ``megatron_rules.RULES``. Pure data.

Found by reading, in every supported tree, validate_args, TransformerConfig.__post_init__, the MoE
modules (experts, router, token dispatcher, moe_utils), the backends that pick the expert module,
Transformer Engine's import gates in extensions/transformer_engine.py, and checkpointing. Rules
that only act at run time (building the experts, the first forward) are marked ``runtime``: stock
Megatron never meets them, because it leaves all three toggles off.
"""

from __future__ import annotations

from .megatron_rule import MegatronRule

ALL = ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main')
FROM_014 = ALL[1:]
UP_TO_016 = ALL[:4]
FROM_017 = ALL[4:]
FROM_019 = ALL[7:]
GG = ('moe_grouped_gemm',)
PF = ('moe_permute_fusion',)
RF = ('moe_router_fusion',)
ARGS = 'megatron/training/arguments.py'
CONFIG = 'megatron/core/transformer/transformer_config.py'
EXPERTS = 'megatron/core/transformer/moe/experts.py'
MOE_UTILS = 'megatron/core/transformer/moe/moe_utils.py'
TE_EXT = 'megatron/core/extensions/transformer_engine.py'
TE_SPEC = 'megatron/core/extensions/transformer_engine_spec_provider.py'
CKPT = 'megatron/training/checkpointing.py'

MOE_RULES: tuple[MegatronRule, ...] = (
    # --- grouped GEMM ---------------------------------------------------------------------------
    MegatronRule(
        'moe_gg_bf16', GG, (ARGS,),
        'Currently GroupedGEMM for MoE only supports bf16 dtype.', 'validate', ALL[:3],
        'grouped GEMM asserts --bf16',
        'guard: grouped GEMM off without --bf16',
    ),
    MegatronRule(
        'moe_gg_compute_capability', GG, (ARGS,),
        'Unsupported compute capability for GroupedGEMM kernels.', 'validate', ALL,
        'grouped GEMM asserts a GPU of compute capability 8.0 or newer',
        'guard: grouped GEMM off on a CUDA GPU older than sm_80 (known architecture)',
    ),
    MegatronRule(
        'moe_gg_te_bias', GG, (EXPERTS,),
        'bias not supported in TEGroupedMLP yet', 'runtime', ALL[:2],
        'TEGroupedMLP asserts --disable-bias-linear',
        'guard: grouped GEMM off where linear layers keep their bias',
    ),
    MegatronRule(
        'moe_gg_legacy_bias', GG, (EXPERTS,),
        'bias not supported in Grouped GEMM yet', 'runtime', UP_TO_016,
        'the legacy GroupedMLP asserts --disable-bias-linear',
        'guard: grouped GEMM off on the legacy path where linear layers keep their bias',
    ),
    MegatronRule(
        'moe_gg_bias_dropout_fusion', GG, (EXPERTS,),
        'bias_dropout_fusion is not supported in TEGroupedMLP', 'runtime', ALL[2:],
        'TEGroupedMLP asserts no bias-dropout fusion while linear layers keep their bias',
        'guard: grouped GEMM off with bias linear layers and bias-dropout fusion',
    ),
    MegatronRule(
        'moe_gg_fp8_old_te', GG, (CONFIG,),
        'Only transformer-engine>=1.11.0 supports FP8 grouped gemm', 'config', ALL,
        'FP8 with grouped GEMM needs Transformer Engine 1.11',
        'guard: grouped GEMM off under FP8 with an older (or no) Transformer Engine',
    ),
    MegatronRule(
        'moe_gg_te_grouped_linear', GG, (TE_EXT,),
        'if HAVE_TE and is_te_min_version("1.9.0.dev0"):', 'runtime', ALL,
        "TEGroupedMLP needs TE's GroupedLinear (TE 1.9); without it the legacy GroupedMLP is built",
        'guard: without GroupedLinear, grouped GEMM stays on only where the legacy path can run',
    ),
    MegatronRule(
        'moe_gg_legacy_package', GG, (EXPERTS,),
        'gg.assert_grouped_gemm_is_available()', 'runtime', UP_TO_016,
        'the legacy GroupedMLP asserts the grouped_gemm package',
        'guard: grouped GEMM off where the legacy path would run without the grouped_gemm package',
    ),
    MegatronRule(
        'moe_gg_legacy_local_spec', GG, ('megatron/core/models/backends.py',),
        'return GroupedMLP, None', 'runtime', UP_TO_016,
        'the local (non-TE) spec builds the legacy GroupedMLP for grouped GEMM',
        'guard: the legacy-package guard counts --transformer-impl local as the legacy path',
    ),
    MegatronRule(
        'moe_gg_op_fuser', GG, (EXPERTS,),
        'Fused GroupedMLP is not supported for this configuration.', 'runtime', ALL[5:],
        "--use-transformer-engine-op-fuser asserts TE's fused grouped MLP supports the model "
        "(TE 2.14, expert TP 1, SwiGLU/quick-GeGLU/weighted squared ReLU, probs not on the input)",
        'guard: grouped GEMM off with the op fuser where the fused grouped MLP cannot take the model',
    ),
    MegatronRule(
        'moe_gg_te_sequential_fallback', GG, (TE_SPEC,),
        'if moe_use_grouped_gemm and TEColumnParallelGroupedLinear is not None:', 'runtime', FROM_017,
        'without GroupedLinear the TE spec builds SequentialMLP for grouped GEMM (no legacy path, no failure)',
        'guard: the default goes off (nothing grouped to gain); an explicit --moe-grouped-gemm is Megatron\'s',
    ),
    MegatronRule(
        'moe_gg_legacy_bf16', GG, (EXPERTS,),
        'Currently GroupedMLP for MoE only supports bf16.', 'runtime', ('0.16.0',),
        'the legacy GroupedMLP asserts --bf16 at its first forward',
        'guard: grouped GEMM off without --bf16 on the legacy path',
    ),
    MegatronRule(
        'moe_gg_legacy_glu', GG, (EXPERTS,),
        'Activation function must be silu or gelu when using GroupedMLP.', 'runtime', UP_TO_016,
        'the legacy GroupedMLP raises for a gated activation other than silu or gelu (--quick-geglu)',
        'guard: grouped GEMM off with --quick-geglu on the legacy path',
    ),
    MegatronRule(
        'moe_gg_legacy_latent', GG, (EXPERTS,),
        'MoE latent projection not supported in GroupedMLP yet.', 'runtime', ('0.16.0',),
        'the legacy GroupedMLP asserts no --moe-latent-size',
        'guard: grouped GEMM off with --moe-latent-size on the legacy path',
    ),
    MegatronRule(
        'moe_gg_legacy_fp8_recompute', GG, (EXPERTS,),
        'cannot work with the legacy GroupedMLP.', 'runtime', ALL[1:4],
        'the legacy GroupedMLP raises for moe_act recompute under FP8 (or FP4)',
        'guard: grouped GEMM off with --recompute-modules moe_act under FP8/FP4 on the legacy path',
    ),
    MegatronRule(
        'moe_gg_op_fuser_cutedsl', GG, (EXPERTS,),
        'NVTE_CUTEDSL_FUSED_GROUPED_MLP', 'runtime', FROM_019,
        "TE's fused grouped MLP takes SwiGLU/quick GeGLU only with NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0",
        'guard: with the op fuser, gated experts keep grouped GEMM only where the launch sets the variable above 0',
    ),
    MegatronRule(
        'moe_gg_op_fuser_scale_bias', GG, (EXPERTS,),
        '"scale_bias" not in inspect.signature(GroupedLinear.__init__)', 'runtime', FROM_019,
        "TE's fused grouped MLP takes a biased fc2 only where TE's GroupedLinear op has scale_bias",
        'guard: with the op fuser, biased experts count as unsupported (that TE signature is not known here)',
    ),
    MegatronRule(
        'moe_gg_op_fuser_clamp', GG, (EXPERTS,),
        'is_te_min_version("2.17.0.dev0")', 'runtime', ('main',),
        "TE's fused grouped MLP takes a clamped SwiGLU (activation_func_clamp_value) only from TE 2.17",
        'guard: with the op fuser, a clamp value before TE 2.17 counts as unsupported',
    ),
    MegatronRule(
        'moe_gg_by_module_formats', GG, (CKPT,),
        '# torch, torch_dcp', 'runtime', ALL,
        'the torch and torch_dcp formats (and fsdp_dtensor, from 0.14) save the model by module names',
        'guard: on resume in those formats grouped GEMM keeps the expert layout the checkpoint holds',
    ),
    MegatronRule(
        'moe_gg_moe_act_recompute', GG, (CONFIG,),
        'moe_act in recompute_modules is only supported with moe_grouped_gemm.', 'config', ALL,
        '--recompute-modules moe_act needs grouped GEMM',
        'none needed: the default turns grouped GEMM on, which only helps; stock fails there without it',
    ),
    MegatronRule(
        'moe_gg_grouped_tensor', GG, (CONFIG,),
        'moe_use_grouped_tensor=True requires moe_grouped_gemm=True.', 'config', ('main',),
        "TE's grouped tensor (--moe-use-grouped-tensor, single grouped weights) needs grouped GEMM",
        'none needed: the default turns grouped GEMM on, which only helps',
    ),
    MegatronRule(
        'moe_gg_checkpoint_args', GG, ('megatron/training/checkpointing.py',),
        "_set_arg('moe_grouped_gemm', force=True)", 'validate', ALL,
        "--use-checkpoint-args takes moe_grouped_gemm from the checkpoint, over the command line",
        "none needed: the checkpoint's own value then stands, and it loads its own layout",
    ),
    # --- permute fusion ---------------------------------------------------------------------------
    MegatronRule(
        'moe_pf_te', PF, (CONFIG,),
        'fused permutation is not available. Please install TE >= 2.1.0.', 'config', ALL,
        "permute fusion raises without Transformer Engine's fused permutation (TE 2.1)",
        'guard: permute fusion off without the TE kernels',
    ),
    MegatronRule(
        'moe_pf_batch_invariant', PF, (CONFIG,),
        'Batch-invariant MoE requires the unfused permute/unpermute path', 'config', ('main',),
        '--batch-invariant-mode with MoE asserts permute fusion is off',
        'guard: permute fusion off under --batch-invariant-mode',
    ),
    # --- router fusion ----------------------------------------------------------------------------
    MegatronRule(
        'moe_rf_field', RF, (CONFIG,),
        'moe_router_fusion: bool = False', 'config', FROM_014,
        'the TransformerConfig field moe_router_fusion exists from core 0.14',
        'guard: router fusion off where TransformerConfig lacks the field',
        fact='moe_router_fusion_field',
    ),
    MegatronRule(
        'moe_rf_te', RF, (MOE_UTILS,),
        'fused_topk_with_score_function is not available', 'runtime', FROM_014,
        "router fusion raises at the first forward without TE's fused router kernels",
        'guard: router fusion off without the TE kernels',
    ),
    MegatronRule(
        'moe_rf_te_import', RF, (TE_EXT,),
        'if HAVE_TE and is_te_min_version("2.7.0.dev"):', 'runtime', FROM_014,
        "Megatron imports TE's fused router kernels only from TE 2.7",
        'guard: the TE-kernel guard asks for TE 2.7, not only for the kernel',
    ),
    MegatronRule(
        'moe_rf_sqrtsoftplus', RF, (MOE_UTILS,),
        'Fused sqrtsoftplus score function requires TE >= 2.13.0', 'runtime', ALL[5:],
        'the fused sqrtsoftplus score function needs TE 2.13',
        'guard: router fusion off with --moe-router-score-function sqrtsoftplus before TE 2.13',
    ),
    MegatronRule(
        'moe_rf_quantile_balancing', RF, ('megatron/core/transformer/moe/router.py',),
        'Quantile balancing routing does not support moe_router_fusion.', 'runtime', ALL[7:],
        'quantile-balancing routing asserts router fusion is off',
        'guard: router fusion off with --moe-router-load-balancing-type quantile_balancing',
    ),
    MegatronRule(
        'moe_rf_routing_replay', RF, (MOE_UTILS,),
        "router_replay: Optional['RouterReplay'] = None,", 'runtime', ALL[3:],
        'the fused top-k returns before routing replay is consulted (silent difference)',
        'guard: router fusion off with --moe-enable-routing-replay (no error, but replay would be skipped)',
    ),
)
