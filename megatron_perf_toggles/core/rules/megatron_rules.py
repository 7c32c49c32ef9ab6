"""Megatron-LM's own rules that involve a toggle: where each lives, and how it is recognised.

The list comes from an audit of every supported tree (validate_args, determinism.py, the config
dataclasses, DDP and FSDP wrappers, the loss, attention and model builders), searching for the
toggles and for what Megatron derives from them.

Every rule found by reading Megatron's sources (validate_args, determinism.py, the config
dataclasses, the DDP/FSDP wrappers) that can reject, rewrite or depend on one of the toggles is
declared here once, with the phrase that identifies it in Megatron's source.
``runtime.machine.capabilities.detect_rules(root)`` reads those files of a checkout and answers which
rules this Megatron has, so a guard fires only
on the versions that carry its rule, and a Megatron release that drops a rule frees the toggle
again without a code change. The table of Megatron's rules in docs/guards.md is generated from it.

Pure data: no file is read and nothing is imported here.
"""

from __future__ import annotations

from .megatron_rule import MegatronRule, Stage
from .megatron_rules_allocator import ALLOCATOR_RULES
from .megatron_rules_moe import MOE_RULES

__all__ = ["ALLOCATOR_RULES", "BY_ID", "MOE_RULES", "RULES", "SUPPORTED", "MegatronRule", "Stage", "rules_table"]

TOGGLE_RULES: tuple[MegatronRule, ...] = (
    MegatronRule(
        'deterministic_ce_fusion', ('cross_entropy_loss_fusion',),
        ('megatron/training/arguments.py',),
        'Cross Entropy Fusion is currently not deterministic.', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2'),
        '--deterministic-mode asserts cross-entropy loss fusion is off',
        'guard: fusion off under --deterministic-mode; an explicit --cross-entropy-loss-fusion is refused',
    ),
    MegatronRule(
        'deterministic_ce_fusion_019', ('cross_entropy_loss_fusion',),
        ('megatron/training/determinism.py',),
        '"cross_entropy_loss_fusion": False', 'validate',
        ('0.19.0', 'main'),
        '--deterministic-mode requires cross_entropy_loss_fusion=False (determinism.py)',
        'guard: the deterministic_ce_fusion guard (0.19 moved the rule to determinism.py)',
    ),
    MegatronRule(
        'ce_te_impl_stability', ('cross_entropy_loss_fusion', 'cross_entropy_fusion_impl'),
        ('megatron/training/arguments.py',),
        'Transformer Engine cross entropy loss fusion is disabled due to stability issues', 'validate',
        ('0.18.2', '0.19.0', 'main'),
        'loss fusion with impl te is an assertion (stability)',
        'guard: impl te becomes native; with an explicit te impl the fusion default yields instead',
        fact='asserts_te_cross_entropy', if_unknown=False,
    ),
    MegatronRule(
        'ce_te_impl_config_warning', ('cross_entropy_loss_fusion', 'cross_entropy_fusion_impl'),
        ('megatron/core/model_parallel_config.py',),
        'Transformer Engine cross entropy loss fusion has known stability issues', 'config',
        ('0.18.2', '0.19.0', 'main'),
        'loss fusion with impl te warns in ModelParallelConfig',
        'none needed: a warning, never reached once the guard above ran',
    ),
    MegatronRule(
        'ce_te_kernel_missing', ('cross_entropy_loss_fusion', 'cross_entropy_fusion_impl'),
        ('megatron/core/models/common/language_module/language_module.py',),
        "Trying to use a TE block when it's not present.", 'runtime',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        "impl te without TE's parallel cross-entropy raises at the first loss",
        "guard: impl te becomes native without TE's parallel cross-entropy",
    ),
    MegatronRule(
        'ce_te_full_iteration_graph_old_te', ('cross_entropy_loss_fusion', 'cross_entropy_fusion_impl'),
        ('megatron/core/models/common/language_module/language_module.py',),
        'CUDA graph compatible cross entropy requires TransformerEngine >= 2.7.0', 'runtime',
        ('0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'impl te inside a full-iteration CUDA graph needs TE >= 2.7 (first loss)',
        'guard: impl te becomes native under a full-iteration CUDA graph with TE < 2.7',
    ),
    MegatronRule(
        'ce_te_impl_distillation', ('cross_entropy_fusion_impl',),
        ('megatron/post_training/model_builder.py',),
        'ModelOpt Distillation currently incompatible with TransformerEngine Cross-Entropy implementation.', 'runtime',
        ('0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'ModelOpt distillation rejects impl te, fused or not (model build)',
        'guard: impl te becomes native with --export-kd-teacher-load; the te default is dropped whenever the fusion is off',
    ),
    MegatronRule(
        'fsdp2_fusion', ('gradient_accumulation_fusion',),
        ('megatron/training/arguments.py',),
        '--use-torch-fsdp2 is not supported with gradient accumulation fusion', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--use-torch-fsdp2 asserts gradient accumulation fusion is off',
        'guard: fusion off with --use-torch-fsdp2',
    ),
    MegatronRule(
        'custom_fsdp_sharded_rejects_fusion', ('gradient_accumulation_fusion',),
        ('megatron/training/arguments.py',),
        'optim_grads_params optim_grads are not supported with gradient accumulation fusion', 'validate',
        ('0.13.0',),
        '--use-custom-fsdp with optim_grads/optim_grads_params asserts fusion is off',
        'guard: fusion off with --use-custom-fsdp and a sharded strategy',
    ),
    MegatronRule(
        'mfsdp_sharded_fusion_warning', ('gradient_accumulation_fusion',),
        ('megatron/training/arguments.py',),
        'Please make sure your TransformerEngine support FSDP + gradient accumulation fusion', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0'),
        'Megatron-FSDP with a sharded strategy warns about TE support for fusion',
        'none needed: a warning; the TE requirement is guarded',
    ),
    MegatronRule(
        'mfsdp_sharded_fusion_warning_018', ('gradient_accumulation_fusion',),
        ('megatron/training/arguments.py',),
        'Verify that fused gradient accumulation is supported by TransformerEngine for Megatron-FSDP.', 'validate',
        ('0.18.0', '0.18.2', '0.19.0', 'main'),
        'Megatron-FSDP with a sharded strategy and fusion warns',
        'none needed: a warning; the hard checks come at model wrapping and are guarded',
    ),
    MegatronRule(
        'mfsdp_fusion_te', ('gradient_accumulation_fusion',),
        ('megatron/core/distributed/fsdp/mcore_fsdp_adapter.py',),
        'Megatron-FSDP with gradient_accumulation_fusion requires', 'runtime',
        ('0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'Megatron-FSDP with fusion asserts TE >= 2.10 when the model is wrapped',
        'guard: fusion off with Megatron-FSDP when TE is older than 2.10 or absent',
    ),
    MegatronRule(
        'mfsdp_v2_fusion', ('gradient_accumulation_fusion',),
        ('megatron/core/distributed/fsdp/mcore_fsdp_adapter.py',),
        'MFSDP v2 does not currently support gradient accumulation fusion.', 'runtime',
        ('main',),
        'Megatron-FSDP v2 raises on fusion when the model is wrapped',
        'guard: fusion off with --megatron-fsdp-version 2',
    ),
    MegatronRule(
        'mfsdp_fusion_te_implicit', ('gradient_accumulation_fusion',),
        (),
        '', 'runtime',
        ('0.14.0', '0.15.0', '0.16.0'),
        'Megatron-FSDP with fusion needs a TE that handles FSDP parameters (no message; first backward)',
        'guard: the same TE >= 2.10 test as later versions state explicitly',
    ),
    MegatronRule(
        'defer_embedding_wgrad_needs_fusion', ('gradient_accumulation_fusion',),
        ('megatron/core/model_parallel_config.py',),
        'Cannot defer embedding wgrad compute when gradient accumulation fusion is not used', 'config',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--defer-embedding-wgrad-compute raises without fusion (ModelParallelConfig)',
        'dependency: a guard that would turn fusion off stops with one line naming both',
    ),
    MegatronRule(
        'delay_wgrad_cuda_graph_needs_fusion', ('gradient_accumulation_fusion',),
        ('megatron/training/arguments.py',),
        'CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion', 'validate',
        ('0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--delay-wgrad-compute + --overlap-grad-reduce + attention/router CUDA graphs assert fusion is on',
        'dependency: a guard that would turn fusion off stops with one line naming both',
    ),
    MegatronRule(
        'delay_wgrad_fusion_off_te', ('gradient_accumulation_fusion',),
        ('megatron/training/arguments.py',),
        'disabling gradient_accumulation_fusion is only supported with TE >= 2.7.0', 'validate',
        ('0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--delay-wgrad-compute with fusion off asserts TE >= 2.7',
        'dependency: a guard that would turn fusion off stops with one line naming both',
    ),
    MegatronRule(
        'apex_wgrad_kernel_required', ('gradient_accumulation_fusion',),
        ('megatron/core/tensor_parallel/layers.py', 'megatron/core/utils.py'),
        'ColumnParallelLinear was called with gradient_accumulation_fusion set', 'runtime',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        "fusion without APEX's fused_weight_gradient_mlp_cuda raises at model build",
        'guard: fusion off without APEX unless the torch fallback stands in',
    ),
    MegatronRule(
        'grad_reduce_bf16_drops_fp32_accumulation', ('grad_reduce_in_bf16',),
        ('megatron/training/arguments.py',),
        'args.accumulate_allreduce_grads_in_fp32 = False', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'grad_reduce_in_bf16 silently resets --accumulate-allreduce-grads-in-fp32',
        'guard: an explicit --accumulate-allreduce-grads-in-fp32 wins over the bf16 default',
    ),
    MegatronRule(
        'bf16_defaults_fp32_accumulation', ('grad_reduce_in_bf16',),
        ('megatron/training/arguments.py',),
        'accumulate and all-reduce gradients in fp32 for', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'bf16 without the toggle turns fp32 accumulation on',
        'none needed: the stock behaviour the toggle switches off',
    ),
    MegatronRule(
        'main_grads_dtype_vs_fp32_accumulation', ('grad_reduce_in_bf16',),
        ('megatron/training/arguments.py',),
        '--main-grads-dtype can only be fp32 when --accumulate-allreduce-grads-in-fp32 is set', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--main-grads-dtype other than fp32 rejects explicit fp32 accumulation',
        'none needed: checked before the toggle is read; stock rejects the same lines',
    ),
    MegatronRule(
        'grad_reduce_bf16_inert_without_bf16', ('grad_reduce_in_bf16',),
        ('megatron/training/arguments.py',),
        'if args.grad_reduce_in_bf16:', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'without --bf16 the toggle is never read for DDP',
        'none needed: no rejection (the toggle does nothing for DDP without --bf16)',
    ),
    MegatronRule(
        'grad_reduce_bf16_forces_mfsdp_grad_comm_dtype', ('grad_reduce_in_bf16',),
        ('megatron/training/arguments.py',),
        'args.megatron_fsdp_grad_comm_dtype = torch.bfloat16', 'validate',
        ('0.17.0', '0.18.0', '0.18.2'),
        "the toggle silently sets Megatron-FSDP's gradient comm dtype to bf16",
        'guard: an explicit --megatron-fsdp-grad-comm-dtype wins over the bf16 default',
    ),
    MegatronRule(
        'mfsdp_fp32_grads_follow_accumulation', ('grad_reduce_in_bf16',),
        ('megatron/core/distributed/fsdp/mcore_fsdp_adapter.py',),
        'Grandfathered Argument: grad_reduce_in_fp32', 'runtime',
        ('0.17.0', '0.18.0', '0.18.2'),
        "Megatron-FSDP's main-grad and comm dtypes follow fp32 accumulation",
        "none needed: no rejection; the toggle sets Megatron-FSDP's gradient dtypes there",
    ),
    MegatronRule(
        'ddp_fp32_local_accum_patterns_need_bf16_grads', ('grad_reduce_in_bf16',),
        ('megatron/core/distributed/distributed_data_parallel_config.py',),
        'Only need to explicitly specify param_name patterns for FP32 local accumulation', 'runtime',
        ('0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--ddp-param-name-patterns-for-fp32-local-accumulation asserts a bf16 gradient buffer',
        'dependency: a guard that would turn the bf16 buffer off stops with one line naming both',
    ),
    MegatronRule(
        'fp32_accumulation_disables_rs_fp32_accumulation', ('grad_reduce_in_bf16',),
        ('megatron/training/arguments.py',),
        'already reduces in fp32', 'validate',
        ('main',),
        'fp32 accumulation turns the reduce-scatter fp32 accumulation flags off (warning)',
        "none needed: under the bf16 default the user's flag stays in effect",
    ),
    MegatronRule(
        'yaml_cfg_forces_fp32_accumulation', ('grad_reduce_in_bf16',),
        ('megatron/training/yaml_arguments.py',),
        'args.accumulate_allreduce_grads_in_fp32 = True', 'validate',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--yaml-cfg with bf16 sets fp32 accumulation without reading the toggle',
        'none needed: --yaml-cfg already gets a warning that the toggles do not carry over',
    ),
    MegatronRule(
        'ddp_average_vs_per_token_loss', ('ddp_average_in_collective',),
        ('megatron/core/distributed/distributed_data_parallel.py',),
        'Cannot average in collective when calculating per-token loss!', 'runtime',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'DDP asserts average-in-collective is off with per-token loss',
        'guard: average in collective off with --calculate-per-token-loss',
    ),
    MegatronRule(
        'ddp_average_vs_gtp', ('ddp_average_in_collective',),
        ('megatron/training/arguments.py',),
        'GTP requires --ddp-average-in-collective off (the default)', 'validate',
        ('0.19.0', 'main'),
        'GTP weight shards assert average-in-collective is off',
        'guard: average in collective off with GTP weight shards',
        fact='asserts_ddp_average_with_gtp',
    ),
    MegatronRule(
        'ddp_average_vs_gtp_ddp', ('ddp_average_in_collective',),
        ('megatron/core/distributed/distributed_data_parallel.py',),
        'GTP requires average_in_collective=False (the default)', 'runtime',
        ('0.19.0', 'main'),
        'DDP asserts average-in-collective is off when GTP remat is active',
        'guard: the GTP guard above (validate_args fires first)',
    ),
    MegatronRule(
        'fqr_field', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/transformer_config.py',),
        'fused_single_qkv_rope: bool = False', 'config',
        ('0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'the TransformerConfig field fused_single_qkv_rope exists from core 0.15',
        'guard: fused single-QKV RoPE off where TransformerConfig lacks the field',
        fact='fused_single_qkv_rope_field',
    ),
    MegatronRule(
        'fqr_gated_attention', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/transformer_config.py',),
        'fused_single_qkv_rope does not support gated attention for now.', 'config',
        ('0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'fused single-QKV RoPE with an attention output gate raises (TransformerConfig)',
        'guard: off with --attention-output-gate',
    ),
    MegatronRule(
        'fqr_forward_assert', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/attention.py',),
        'fused_single_qkv_rope requested but not available/supported for the config.', 'runtime',
        ('0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'fused single-QKV RoPE asserts its conditions at the first forward',
        "guard: off without TE's kernel, non-RoPE positions, q/k layernorm, flash-decode, packed sequences",
    ),
    MegatronRule(
        'fqr_qk_l2_norm', ('fused_single_qkv_rope',),
        ('megatron/core/models/gpt/gpt_layer_specs.py',),
        '', 'runtime',
        ('0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--qk-l2-norm puts norms on q/k: the first-forward assertion fires',
        'guard: off with --qk-l2-norm',
    ),
    MegatronRule(
        'fqr_no_rope_layers', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/attention.py',),
        'fused_single_qkv_rope requested but not available/supported for the config.', 'runtime',
        ('0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        '--no-rope-freq layers have no rotary embedding: the assertion fires there',
        'guard: off with --no-rope-freq',
    ),
    MegatronRule(
        'fqr_packed_sequences', ('fused_single_qkv_rope',),
        ('pretrain_gpt.py',),
        '', 'runtime',
        ('0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'packed sequences from hybrid CP or inter-document masking: the assertion fires',
        'guard: off with --hybrid-context-parallel or --dataloader-inter-document-masking',
    ),
    MegatronRule(
        'fqr_inference_context', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/attention.py',),
        'fused_single_qkv_rope requested but not available/supported for the config.', 'runtime',
        ('0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'an inference context (RL rollouts) makes the assertion fire',
        'guard: off with --perform-rl-step (rollouts run with an inference context)',
    ),
    MegatronRule(
        'fqr_rotary_interleaved', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/attention.py',),
        'apply_fused_qkv_rotary_pos_emb(', 'runtime',
        ('0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'the fused call is not told about --rotary-interleaved (silent difference)',
        'guard: off with --rotary-interleaved (no error, but the fused call ignores it)',
    ),
    MegatronRule(
        'fqr_groups_below_tp', ('fused_single_qkv_rope',),
        ('megatron/core/transformer/attention.py',),
        '', 'runtime',
        ('0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'with fewer query groups than TP ranks the fused path returns QKV unsplit, before each rank picks '
        'its query heads (read from the source; not seen on a GPU)',
        'guard: off where --num-query-groups is below TP',
    ),
    MegatronRule(
        'fp8_delayed_rejects_first_last_bf16', ('first_last_layers_bf16',),
        ('megatron/core/transformer/transformer_config.py',),
        'Delayed scaling does not support first / last layer in BF16.', 'config',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'delayed FP8 rejects first/last layers in bf16',
        'none needed: the plugin picks layers only for FP4, which excludes FP8',
    ),
    MegatronRule(
        'fp8_bf16_layer_counts_range', ('first_last_layers_bf16', 'num_layers_at_start_in_bf16', 'num_layers_at_end_in_bf16'),
        ('megatron/core/transformer/transformer_config.py',),
        'between 0 and number of layers per pipeline stage', 'config',
        ('0.13.0', '0.14.0', '0.15.0', '0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'FP8 bounds the bf16 layer counts by the layers of a pipeline stage',
        'none needed: FP8 only; FP4 counts are global layer numbers',
    ),
    MegatronRule(
        'gqa_groups_divide_tp', (),
        ('megatron/core/transformer/transformer_config.py',),
        'tensor_model_parallel_size % self.num_query_groups != 0', 'config',
        ('0.16.0', '0.17.0', '0.18.0', '0.18.2', '0.19.0', 'main'),
        'query groups may divide TP instead of being a multiple of it (each rank then holds one group)',
        'plan: the layout check accepts a TP that the query groups divide, from the versions carrying it '
        '(earlier ones refuse it, as TransformerConfig does)',
    ),
)

# With the MoE toggles' rules (their own module), and the rules about the allocator setting, which the
# memory plan may list at launch (no toggle).
RULES: tuple[MegatronRule, ...] = TOGGLE_RULES + MOE_RULES + ALLOCATOR_RULES
BY_ID: dict[str, MegatronRule] = {r.id: r for r in RULES}


def rules_table() -> str:
    """The table of Megatron's rules and the plugin's answer to each (docs/guards.md)."""
    rows = ["| rule | toggles | Megatron | checked at | when and what | handling |", "|---|---|---|---|---|---|"]
    for r in RULES:
        versions = _span(r.versions)
        toggles = ", ".join(f"`{t}`" for t in r.toggles) or "-"
        rows.append(f"| `{r.id}` | {toggles} | {versions} | {r.stage} | {r.summary.replace('|', '/')} | {r.handling} |")
    return "\n".join(rows)


SUPPORTED = ("0.13.0", "0.14.0", "0.15.0", "0.16.0", "0.17.0", "0.18.0", "0.18.2", "0.19.0", "main")


def _span(versions: tuple[str, ...]) -> str:
    """``0.15.0 … main`` for a contiguous run of supported versions, else the list."""
    idx = [SUPPORTED.index(v) for v in versions if v in SUPPORTED]
    if idx and idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 1:
        return f"{SUPPORTED[idx[0]]} … {SUPPORTED[idx[-1]]}"
    return ", ".join(versions)


def rules_of(release: str) -> tuple[str, ...]:
    """The ids of the rules the rules table records for ``release`` (``0.19.0``, ``main``)."""
    return tuple(r.id for r in RULES if release in r.versions)
