"""The pure policy: precedence, every guard, FP4 layer selection, advice. No Megatron, no GPU."""

from __future__ import annotations

import pytest
from conftest import LLAMA_ARGS, MOE_ARGS, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.facts import MegatronFacts, with_assumptions
from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.core.rules.megatron_rules import RULES
from megatron_perf_toggles.errors import CannotHonourError, DependencyError
from megatron_perf_toggles.runtime.machine.capabilities import resolve


def run(args=None, explicit=None, env_settings=None, caps=None, stock=None):
    from megatron_perf_toggles.core.env import read_env

    merged = {**LLAMA_ARGS, **(args or {})}
    return decide(merged, explicit or {}, env_settings or read_env({}), caps or full_caps(), stock)


def test_plugin_defaults_on_a_capable_machine():
    plan = run(MOE_ARGS)  # a MoE model, so that every toggle applies
    for t in TOGGLES:
        d = plan.decisions[t.dest]
        assert (d.value, d.source) == (t.default, "default"), t.dest
    assert plan.messages == []


@pytest.mark.parametrize("t", TOGGLES, ids=lambda t: t.dest)
def test_precedence_cli_over_env_over_default(t, env):
    off = False if t.kind == "bool" else "native"
    on = True if t.kind == "bool" else "te"
    model = MOE_ARGS if t.scope == "moe" else None
    from_env = run(model, env_settings=env(**{t.env: off if t.kind == "choice" else 0})).decisions[t.dest]
    assert (from_env.value, from_env.source) == (off, "env")
    assert t.env in from_env.reason
    from_cli = run(model, explicit={t.dest: on}, env_settings=env(**{t.env: off if t.kind == "choice" else 0}))
    assert (from_cli.decisions[t.dest].value, from_cli.decisions[t.dest].source) == (on, "cli")
    cli_off = run(model, explicit={t.dest: off}).decisions[t.dest]
    assert (cli_off.value, cli_off.source) == (off, "cli")


def test_plugin_switch_off_keeps_megatron_stock_defaults(env):
    stock = {"gradient_accumulation_fusion": True, "grad_reduce_in_bf16": False, "cross_entropy_fusion_impl": "native"}
    plan = run(env_settings=env(MEGATRON_PERF_TOGGLES=0), stock=stock)
    assert plan.decisions["gradient_accumulation_fusion"].value is True
    assert plan.decisions["grad_reduce_in_bf16"].value is False
    assert plan.decisions["cross_entropy_fusion_impl"].value == "native"
    assert plan.decisions["fused_single_qkv_rope"].value is False  # no flag upstream: the field's default
    assert "MEGATRON_PERF_TOGGLES=0" in plan.decisions["grad_reduce_in_bf16"].reason


def test_plugin_switch_off_leaves_stock_defaults_even_where_a_guard_would_act(env):
    # MEGATRON_PERF_TOGGLES=0 means stock Megatron: its default stands, the guard's concern is noted.
    plan = run(env_settings=env(MEGATRON_PERF_TOGGLES=0), caps=full_caps(apex_fused_wgrad=False),
               stock={"gradient_accumulation_fusion": True})
    d = plan.decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (True, "default")
    assert "left as stock" in d.reason and "APEX" in d.reason
    assert plan.wgrad_path == "missing"


def test_plugin_switch_off_still_guards_environment_values(env):
    plan = run(env_settings=env(MEGATRON_PERF_TOGGLES=0, GRADIENT_ACCUMULATION_FUSION=1),
               caps=full_caps(apex_fused_wgrad=False), stock={"gradient_accumulation_fusion": True})
    d = plan.decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (False, "guard")
    assert any("GRADIENT_ACCUMULATION_FUSION=1" in m.text for m in plan.messages)


def test_plugin_switch_off_but_explicit_env_still_counts(env):
    plan = run(env_settings=env(MEGATRON_PERF_TOGGLES=0, GRAD_REDUCE_IN_BF16=1))
    assert plan.decisions["grad_reduce_in_bf16"].source == "env"


# --- mxfp4 guard --------------------------------------------------------------------------------

MXFP4 = {"fp4": "e2m1", "fp4_recipe": "mxfp4"}


@pytest.mark.parametrize("how", ["env", "cli"])
def test_mxfp4_forces_bf16_grad_buffer_even_over_explicit_zero(how, env):
    kwargs = {"env_settings": env(GRAD_REDUCE_IN_BF16=0)} if how == "env" else {
        "explicit": {"grad_reduce_in_bf16": False}}
    plan = run(args=MXFP4, **kwargs)
    d = plan.decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (True, "guard")
    assert "mxfp4" in d.reason and "a4w4" in d.reason and "bf16" in d.reason
    assert any(m.level == "warning" and "grad_reduce_in_bf16" in m.text for m in plan.messages)


@pytest.mark.parametrize("args, caps_kw", [
    ({"use_torch_fsdp2": True}, {}),  # fusion will be turned off by the FSDP guard
    ({}, {"apex_fused_wgrad": False, "wgrad_fallback": False}),  # ... or for want of a wgrad kernel
])
def test_mxfp4_guard_leaves_explicit_zero_when_fusion_cannot_stay_on(args, caps_kw):
    plan = run(args={**MXFP4, **args}, explicit={"grad_reduce_in_bf16": False}, caps=full_caps(**caps_kw))
    assert plan.decisions["gradient_accumulation_fusion"].value is False
    assert (plan.decisions["grad_reduce_in_bf16"].value, plan.decisions["grad_reduce_in_bf16"].source) == (False, "cli")


def test_mxfp4_guard_needs_gradient_accumulation_fusion(env):
    plan = run(args=MXFP4, env_settings=env(GRAD_REDUCE_IN_BF16=0, GRADIENT_ACCUMULATION_FUSION=0))
    assert plan.decisions["grad_reduce_in_bf16"].value is False


def test_nvfp4_does_not_force_bf16_grads(env):
    plan = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4"}, env_settings=env(GRAD_REDUCE_IN_BF16=0))
    assert plan.decisions["grad_reduce_in_bf16"].value is False


# --- FP4 layer selection ------------------------------------------------------------------------


def test_nvfp4_recipe_keeps_first_two_and_last_eight_in_bf16():
    plan = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4"})
    got = {k: plan.decisions[k].value for k in
           ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")}
    assert got == {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 2, "num_layers_at_end_in_bf16": 8}


def test_mxfp4_recipe_puts_every_layer_in_fp4():
    plan = run(args=MXFP4)
    assert plan.decisions["first_last_layers_bf16"].value is False
    assert "num_layers_at_start_in_bf16" not in plan.decisions


def test_fp4_env_overrides(env):
    plan = run(args=MXFP4, env_settings=env(FP4_SELECTIVE_BF16=1, FP4_BF16_START=1, FP4_BF16_END=3))
    assert plan.decisions["first_last_layers_bf16"].value is True
    assert plan.decisions["num_layers_at_start_in_bf16"].value == 1
    assert plan.decisions["num_layers_at_end_in_bf16"].source == "env"
    off = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4"}, env_settings=env(FP4_SELECTIVE_BF16=0))
    assert off.decisions["first_last_layers_bf16"].value is False


def test_fp4_selection_keeps_an_explicit_choice():
    plan = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4"}, explicit={"first_last_layers_bf16": False})
    assert plan.decisions["first_last_layers_bf16"].source == "cli"
    assert plan.decisions["first_last_layers_bf16"].value is False


def test_explicit_selective_still_gets_layer_counts(env):
    plan = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4"}, explicit={"first_last_layers_bf16": True},
               env_settings=env(FP4_BF16_START=4))
    got = {k: (plan.decisions[k].value, plan.decisions[k].source) for k in
           ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")}
    assert got == {"num_layers_at_start_in_bf16": (4, "env"), "num_layers_at_end_in_bf16": (8, "default")}


def _fp4(plan):
    return tuple(plan.decisions[k].value if k in plan.decisions else None for k in
                 ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"))


def test_cli_layer_counts_alone_do_not_switch_selection_on():
    # Megatron reads the counts only with --first-last-layers-bf16: the user's flags stay as given.
    plan = run(args=MXFP4, explicit={"num_layers_at_start_in_bf16": 3})
    assert plan.decisions["first_last_layers_bf16"].value is False
    assert plan.decisions["first_last_layers_bf16"].source == "default"
    assert "num_layers_at_start_in_bf16" not in plan.decisions
    [warning] = [m for m in plan.messages if "FP4" in m.text]
    assert "--num-layers-at-start-in-bf16" in warning.text and "FP4_SELECTIVE_BF16=1" in warning.text
    by_recipe = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4"}, explicit={"num_layers_at_end_in_bf16": 3})
    assert _fp4(by_recipe) == (True, 2, 3) and by_recipe.messages == []


def test_env_layer_counts_alone_do_not_switch_selection_on(env):
    plan = run(args=MXFP4, env_settings=env(FP4_BF16_START=4))
    assert _fp4(plan) == (False, None, None)
    [warning] = plan.messages
    assert warning.level == "warning"
    assert "FP4_BF16_START" in warning.text and "FP4_SELECTIVE_BF16=1" in warning.text
    assert run(args=MXFP4).messages == []


def test_fp4_selection_only_with_fp4():
    assert "first_last_layers_bf16" not in run().decisions


@pytest.mark.parametrize("layers, pp", [(4, 1), (32, 8), (2, 1)])
def test_fp4_bf16_counts_not_bounded_by_a_pipeline_stage(layers, pp):
    # FP4 picks its bf16 layers by global layer number; Megatron bounds the counts only under fp8.
    plan = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4", "num_layers": layers, "pipeline_model_parallel_size": pp})
    assert _fp4(plan) == (True, 2, 8)
    d = plan.decisions["num_layers_at_end_in_bf16"]
    assert d.source == "default" and "global layer number" in d.reason
    within = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4", "num_layers": 32})
    assert within.decisions["num_layers_at_end_in_bf16"].reason == "nvfp4 recipe default"


def test_fp4_bf16_counts_clamped_where_megatrons_fp8_rule_applies():
    plan = run(args={"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp8": "e4m3", "num_layers": 4})
    d = plan.decisions["num_layers_at_end_in_bf16"]
    assert (d.value, d.source) == (4, "guard")
    assert "fp8" in d.reason and "TransformerConfig" in d.reason


def test_fp4_selection_with_the_master_switch_off_keeps_megatrons_values(env):
    stock = {"first_last_layers_bf16": False, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1}
    nvfp4 = {"fp4": "e2m1", "fp4_recipe": "nvfp4"}
    plan = run(args=nvfp4, env_settings=env(MEGATRON_PERF_TOGGLES=0), stock=stock)
    assert _fp4(plan) == (False, None, None)
    assert "MEGATRON_PERF_TOGGLES=0" in plan.decisions["first_last_layers_bf16"].reason
    # The FP4_* variables are set by the user, like a toggle's variable: they still apply.
    chosen = run(args=nvfp4, env_settings=env(MEGATRON_PERF_TOGGLES=0, FP4_SELECTIVE_BF16=1, FP4_BF16_END=6),
                 stock=stock)
    assert _fp4(chosen) == (True, 1, 6)
    assert chosen.decisions["num_layers_at_start_in_bf16"].source == "default"


# --- downgrades ---------------------------------------------------------------------------------

ASSERTING = MegatronFacts(version="0.18.2", fused_single_qkv_rope_field=True, asserts_te_cross_entropy=True)


def test_te_cross_entropy_becomes_native_where_megatron_asserts():
    d = run(caps=full_caps(megatron=ASSERTING)).decisions["cross_entropy_fusion_impl"]
    assert (d.value, d.source) == ("native", "guard") and "0.18.2" in d.reason


def test_te_cross_entropy_kept_where_megatron_allows_it():
    assert run().decisions["cross_entropy_fusion_impl"].value == "te"


def test_explicit_te_impl_with_default_fusion_on_asserting_megatron_backs_the_fusion_default_off():
    # Stock Megatron accepts `--cross-entropy-fusion-impl te` (its fusion is off by default): so must we.
    plan = run(explicit={"cross_entropy_fusion_impl": "te"}, caps=full_caps(megatron=ASSERTING))
    fusion, impl = plan.decisions["cross_entropy_loss_fusion"], plan.decisions["cross_entropy_fusion_impl"]
    assert (fusion.value, fusion.source) == (False, "guard")
    assert (impl.value, impl.source) == ("te", "cli")


def test_explicit_te_impl_and_explicit_fusion_on_asserting_megatron_is_an_error():
    with pytest.raises(CannotHonourError, match="--cross-entropy-fusion-impl te") as info:
        run(explicit={"cross_entropy_fusion_impl": "te", "cross_entropy_loss_fusion": True},
            caps=full_caps(megatron=ASSERTING))
    assert "native" in (info.value.hint or "")


def test_te_impl_default_stays_megatrons_when_fusion_is_off(env):
    # Unused without the fusion, so Megatron's own value stands (distillation rejects te even then).
    plan = run(env_settings=env(CROSS_ENTROPY_LOSS_FUSION=0), caps=full_caps(megatron=ASSERTING))
    d = plan.decisions["cross_entropy_fusion_impl"]
    assert (d.value, d.source) == ("native", "guard") and "unused" in d.reason
    asked = run(env_settings=env(CROSS_ENTROPY_LOSS_FUSION=0, CROSS_ENTROPY_FUSION_IMPL="te"))
    assert (asked.decisions["cross_entropy_fusion_impl"].value, asked.decisions["cross_entropy_fusion_impl"].source) \
        == ("te", "env")


def test_distillation_takes_the_native_cross_entropy():
    d = run(args={"export_kd_teacher_load": "/ckpt/teacher"}).decisions["cross_entropy_fusion_impl"]
    assert (d.value, d.source) == ("native", "guard") and "--export-kd-teacher-load" in d.reason


@pytest.mark.parametrize(("args", "te", "native"), [
    ({"cuda_graph_impl": "full_iteration"}, "2.6", True),
    ({"cuda_graph_scope": "full_iteration"}, "2.6", True),
    ({"cuda_graph_scope": ["full_iteration"]}, None, True),
    ({"cuda_graph_impl": "full_iteration"}, "2.7", False),
    ({"cuda_graph_impl": "local"}, "2.6", False),
])
def test_full_iteration_cuda_graph_with_old_te_takes_the_native_cross_entropy(args, te, native):
    caps = full_caps(te_version=te, te_cross_entropy=True)
    d = run(args=args, caps=caps).decisions["cross_entropy_fusion_impl"]
    assert d.value == ("native" if native else "te")


@pytest.mark.parametrize("flag", ["qk_l2_norm", "rotary_interleaved", "perform_rl_step", "hybrid_context_parallel",
                                  "dataloader_inter_document_masking"])
def test_fused_qkv_rope_off_for_each_path_megatron_does_not_fuse(flag):
    d = run(args={flag: True}).decisions["fused_single_qkv_rope"]
    assert (d.value, d.source) == (False, "guard") and flag.replace("_", "-") in d.reason


@pytest.mark.parametrize(("groups", "tp", "off"), [(2, 4, True), (1, 2, True), (4, 4, False), (8, 4, False)])
def test_fused_qkv_rope_off_where_query_groups_are_fewer_than_tp_ranks(groups, tp, off):
    args = {"group_query_attention": True, "num_query_groups": groups, "tensor_model_parallel_size": tp}
    d = run(args=args).decisions["fused_single_qkv_rope"]
    assert (d.value, d.source) == ((False, "guard") if off else (True, "default"))
    assert ("--num-query-groups" in d.reason) is off
    assert run(args={**args, "group_query_attention": False}).decisions["fused_single_qkv_rope"].value is True


def test_fused_qkv_rope_off_with_no_rope_layers():
    d = run(args={"no_rope_freq": [0, 0, 0, 1]}).decisions["fused_single_qkv_rope"]
    assert (d.value, d.source) == (False, "guard") and "--no-rope-freq" in d.reason


def test_explicit_fsdp_comm_dtype_wins_over_the_bf16_default():
    args = {"use_megatron_fsdp": True, "megatron_fsdp_grad_comm_dtype": "fp32"}
    d = run(args=args).decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (False, "guard") and "--megatron-fsdp-grad-comm-dtype fp32" in d.reason
    assert run(args={**args, "megatron_fsdp_grad_comm_dtype": "auto"}).decisions["grad_reduce_in_bf16"].value is True


def test_te_cross_entropy_without_te_kernel():
    d = run(caps=full_caps(te_cross_entropy=False, te_version=None)).decisions["cross_entropy_fusion_impl"]
    assert (d.value, d.source) == ("native", "guard")


def test_torch_fsdp2_turns_gradient_accumulation_fusion_off():
    d = run(args={"use_torch_fsdp2": True}).decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (False, "guard")
    assert "--use-torch-fsdp2" in d.reason


ALL_RULES = tuple(r.id for r in RULES)


@pytest.mark.parametrize("fsdp", ["use_megatron_fsdp", "use_custom_fsdp"])
@pytest.mark.parametrize(("te", "rules", "version", "kept"), [
    ("2.20.2", ALL_RULES, 1, True),        # the adapter's rule: TE >= 2.10 keeps fusion
    ("2.10", ALL_RULES, 1, True),
    ("2.9.1", ALL_RULES, 1, False),
    (None, ALL_RULES, 1, False),
    ("2.20.2", ALL_RULES, 2, False),       # Megatron-FSDP v2 refuses fusion outright
])
def test_megatron_fsdp_follows_the_adapter_rule(fsdp, te, rules, version, kept):
    megatron = MegatronFacts(version="0.20.0", rules=rules)
    caps = full_caps(te_version=te, megatron=megatron)
    d = run(args={fsdp: True, "megatron_fsdp_version": version}, caps=caps).decisions["gradient_accumulation_fusion"]
    assert d.value is kept
    assert d.source == ("default" if kept else "guard")
    if not kept:
        assert fsdp.replace("_", "-") in d.reason


@pytest.mark.parametrize(("strategy", "kept"), [("optim_grads", False), ("optim_grads_params", False),
                                                ("no_shard", True), ("optim", True)])
def test_core_013_custom_fsdp_rejects_fusion_only_with_sharded_gradients(strategy, kept):
    rules = ("fsdp2_fusion", "custom_fsdp_sharded_rejects_fusion", "defer_embedding_wgrad_needs_fusion")
    caps = full_caps(megatron=MegatronFacts(version="0.13.0", rules=rules))
    args = {"use_custom_fsdp": True, "data_parallel_sharding_strategy": strategy}
    d = run(args=args, caps=caps).decisions["gradient_accumulation_fusion"]
    assert d.value is kept
    assert d.source == ("default" if kept else "guard")
    if not kept:
        assert strategy in d.reason


def test_megatron_fsdp_with_old_te_and_deferred_embedding_wgrad_is_one_error():
    caps = full_caps(te_version="2.9", megatron=MegatronFacts(version="0.20.0", rules=ALL_RULES))
    with pytest.raises(DependencyError, match="--defer-embedding-wgrad-compute needs gradient_accumulation_fusion") as e:
        run(args={"use_megatron_fsdp": True, "defer_embedding_wgrad_compute": True}, caps=caps)
    assert "Transformer Engine >= 2.10" in str(e.value)


def test_missing_apex_and_no_fallback_with_deferred_embedding_wgrad_is_one_error():
    with pytest.raises(DependencyError, match="--defer-embedding-wgrad-compute") as e:
        run(args={"defer_embedding_wgrad_compute": True}, caps=full_caps(apex_fused_wgrad=False))
    assert "fused_weight_gradient_mlp_cuda" in str(e.value)


def test_a_dependency_only_counts_where_this_megatron_has_the_rule():
    rules = tuple(r for r in ALL_RULES if r != "defer_embedding_wgrad_needs_fusion")
    caps = full_caps(apex_fused_wgrad=False, megatron=MegatronFacts(version="0.20.0", rules=rules))
    d = run(args={"defer_embedding_wgrad_compute": True}, caps=caps).decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (False, "guard")


@pytest.mark.parametrize("scope", ["cuda_graph_modules", "cuda_graph_scope"])
def test_delay_wgrad_under_attention_cuda_graphs_keeps_fusion_or_stops(scope):
    args = {"delay_wgrad_compute": True, "overlap_grad_reduce": True, scope: ["attn"]}
    with pytest.raises(DependencyError, match="--delay-wgrad-compute"):
        run(args=args, caps=full_caps(apex_fused_wgrad=False))
    # Without the graph scope (and with TE >= 2.7) fusion may go off as usual.
    d = run(args={**args, scope: ["mlp"]}, caps=full_caps(apex_fused_wgrad=False)).decisions
    assert d["gradient_accumulation_fusion"].value is False


def test_delay_wgrad_with_old_te_needs_fusion():
    with pytest.raises(DependencyError, match=r"TE >= 2\.7"):
        run(args={"delay_wgrad_compute": True}, caps=full_caps(apex_fused_wgrad=False, te_version="2.6"))


def test_deterministic_mode_turns_cross_entropy_fusion_off():
    d = run(args={"deterministic_mode": True}).decisions["cross_entropy_loss_fusion"]
    assert (d.value, d.source) == (False, "guard") and "--deterministic-mode" in d.reason


def test_deterministic_mode_with_explicit_cross_entropy_fusion_is_refused():
    with pytest.raises(CannotHonourError, match=r"--cross-entropy-loss-fusion was requested.*deterministic"):
        run(args={"deterministic_mode": True}, explicit={"cross_entropy_loss_fusion": True})


def test_deterministic_mode_overrides_an_environment_value_with_a_warning(env):
    plan = run(args={"deterministic_mode": True}, env_settings=env(CROSS_ENTROPY_LOSS_FUSION=1))
    assert plan.decisions["cross_entropy_loss_fusion"].value is False
    assert any("CROSS_ENTROPY_LOSS_FUSION=1" in m.text for m in plan.messages)


def test_explicit_fp32_accumulation_wins_over_the_bf16_default():
    d = run(args={"accumulate_allreduce_grads_in_fp32": True}).decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (False, "guard") and "--accumulate-allreduce-grads-in-fp32" in d.reason


def test_explicit_fp32_accumulation_and_explicit_bf16_reduce_keep_both_as_stock_does():
    d = run(args={"accumulate_allreduce_grads_in_fp32": True},
            explicit={"grad_reduce_in_bf16": True}).decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (True, "cli")


def test_fsdp_with_explicit_fusion_is_an_error():
    with pytest.raises(CannotHonourError, match="--gradient-accumulation-fusion"):
        run(args={"use_torch_fsdp2": True}, explicit={"gradient_accumulation_fusion": True})


def test_missing_apex_turns_fusion_off_with_reason():
    d = run(caps=full_caps(apex_fused_wgrad=False)).decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (False, "guard") and "fused_weight_gradient_mlp_cuda" in d.reason


def test_missing_apex_with_explicit_fusion_is_an_error():
    with pytest.raises(CannotHonourError, match=r"APEX|fused_weight_gradient"):
        run(caps=full_caps(apex_fused_wgrad=False), explicit={"gradient_accumulation_fusion": True})


def test_env_requested_fusion_without_apex_is_downgraded_with_warning(env):
    plan = run(caps=full_caps(apex_fused_wgrad=False), env_settings=env(GRADIENT_ACCUMULATION_FUSION=1))
    assert plan.decisions["gradient_accumulation_fusion"].value is False
    assert any("GRADIENT_ACCUMULATION_FUSION=1" in m.text for m in plan.messages)


@pytest.mark.parametrize(
    "args, caps_kw, words",
    [
        ({}, {"megatron": MegatronFacts(version="0.13.0", fused_single_qkv_rope_field=False)}, "no fused_single_qkv_rope field"),
        ({}, {"te_fused_qkv_rope": False}, "fused QKV RoPE"),
        ({"qk_layernorm": True}, {}, "--qk-layernorm"),
        ({"sft": True}, {}, "packed (THD)"),
        ({"rl_use_sequence_packing": True}, {}, "packed (THD)"),
        ({"flash_decode": True}, {}, "--flash-decode"),
        ({"attention_output_gate": True}, {}, "--attention-output-gate"),
        ({"position_embedding_type": "learned_absolute"}, {}, "not RoPE"),
    ],
)
def test_fused_qkv_rope_downgrades(args, caps_kw, words):
    d = run(args=args, caps=full_caps(**caps_kw)).decisions["fused_single_qkv_rope"]
    assert (d.value, d.source) == (False, "guard")
    assert words in d.reason


def test_fused_qkv_rope_with_legacy_rotary_flag():
    plan = run(args={"position_embedding_type": "learned_absolute", "use_rotary_position_embeddings": True})
    assert plan.decisions["fused_single_qkv_rope"].value is True


def test_explicit_fused_qkv_rope_with_qk_layernorm_is_an_error():
    with pytest.raises(CannotHonourError, match="--fused-single-qkv-rope"):
        run(args={"qk_layernorm": True}, explicit={"fused_single_qkv_rope": True})


def test_ddp_average_off_with_per_token_loss():
    d = run(args={"calculate_per_token_loss": True}).decisions["ddp_average_in_collective"]
    assert (d.value, d.source) == (False, "guard") and "--calculate-per-token-loss" in d.reason


@pytest.mark.parametrize("dest", ["tensor_parallel_num_weight_shards", "expert_tensor_parallel_num_weight_shards"])
def test_ddp_average_off_with_gtp(dest):
    d = run(args={dest: 2}).decisions["ddp_average_in_collective"]
    assert (d.value, d.source) == (False, "guard") and "GTP" in d.reason


def test_gtp_shards_of_one_keep_ddp_average():
    assert run(args={"tensor_parallel_num_weight_shards": 1}).decisions["ddp_average_in_collective"].value is True


def test_assumed_capability_marks_source_assumed():
    caps = resolve("none,te=2.20")  # no apex in the plan
    d = run(caps=caps).decisions["gradient_accumulation_fusion"]
    assert (d.value, d.source) == (False, "assumed") and "MEGATRON_PERF_TOGGLES_ASSUME" in d.reason
    assert run(caps=resolve("apex,te=2.20")).decisions["gradient_accumulation_fusion"].value is True


def test_assume_replaces_only_what_it_names():
    detected = full_caps(aiter_version="0.1.5", notes={"te_cross_entropy": "TE 2.20.2 lacks it"})
    planned = with_assumptions(detected, "te=2.1")
    assert (planned.apex_fused_wgrad, planned.aiter_version, planned.device) == (True, "0.1.5", "cuda")
    assert (planned.te_version, planned.te_fused_qkv_rope, planned.te_cross_entropy) == ("2.1", False, True)
    assert "te_cross_entropy" not in planned.notes  # the detected TE's note no longer applies
    assert planned.is_assumed("te_version") and not planned.is_assumed("apex_fused_wgrad")
    nothing = with_assumptions(detected, "none")
    assert (nothing.apex_fused_wgrad, nothing.te_version, nothing.aiter_version) == (False, None, None)
    assert with_assumptions(detected, "none,apex").apex_fused_wgrad is True


# --- advice and warnings ------------------------------------------------------------------------


def test_adam_eps_advice_changes_nothing():
    plan = run(args={"lr": 8e-4, "adam_eps": 1e-8})
    advice = [m for m in plan.messages if m.level == "advice"]
    assert len(advice) == 1 and "--adam-eps" in advice[0].text and "1e-5" in advice[0].text
    assert plan.values() == run(args={"lr": 8e-4, "adam_eps": 1e-5}).values()


@pytest.mark.parametrize("args", [{"lr": 3e-4, "adam_eps": 1e-8}, {"lr": 8e-4, "adam_eps": 1e-5},
                                  {"lr": 8e-4, "adam_eps": 1e-8, "optimizer": "sgd"}])
def test_no_adam_eps_advice_otherwise(args):
    assert not [m for m in run(args=args).messages if m.level == "advice"]


def test_yaml_cfg_warns():
    plan = run(args={"yaml_cfg": "cfg.yaml"})
    assert any(m.level == "warning" and "--yaml-cfg" in m.text for m in plan.messages)


def test_log_dirs_tagged_by_precision_and_untagged_when_off(env):
    plan = run(args={"tensorboard_dir": "/runs/tb", "wandb_save_dir": "/runs/wb/", "save": "/ckpt"})
    assert plan.log_dirs == {"tensorboard_dir": "/runs/tb/bf16", "wandb_save_dir": "/runs/wb/bf16"}
    off = run(args={"tensorboard_dir": "/runs/tb"}, env_settings=env(MEGATRON_PERF_TOGGLES_TAG_LOG_DIR=0))
    assert off.log_dirs == {}


# --- resume: optimizer checkpoint layout keyed by the gradient dtype ---------------------------

SAVED_BF16 = {"iteration": 4, "decisions": {"grad_reduce_in_bf16": True},
              "optimizer_layout": ["grad-dtype-keyed", "dp_reshardable"]}
RESUMING = {"use_distributed_optimizer": True, "load": "/ck"}


def resume(args=None, explicit=None, env_settings=None, checkpoint=SAVED_BF16):
    from megatron_perf_toggles.core.env import read_env

    merged = {**LLAMA_ARGS, **RESUMING, **(args or {})}
    return decide(merged, explicit or {}, env_settings or read_env({}), full_caps(), None, checkpoint=checkpoint)


def test_resume_guard_keeps_the_saved_grad_dtype_over_env(env):
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0))
    d = plan.decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (True, "guard") and "/ck (iteration 4)" in d.reason
    assert any("GRAD_REDUCE_IN_BF16=0" in m.text for m in plan.messages)


def test_resume_guard_refuses_explicit_cli():
    with pytest.raises(CannotHonourError) as info:
        resume(explicit={"grad_reduce_in_bf16": False})
    assert "--no-grad-reduce-in-bf16" in str(info.value) and "--no-load-optim" in str(info.value)


@pytest.mark.parametrize("args, checkpoint", [
    ({"no_load_optim": True}, SAVED_BF16),
    ({"finetune": True}, SAVED_BF16),
    ({"load": None}, SAVED_BF16),
    ({}, {**SAVED_BF16, "optimizer_layout": ["model-space", "fully_reshardable"]}),
    ({}, {"iteration": 4, "decisions": {}}),  # the writer recorded no value: nothing to compare
    ({}, None),
])
def test_resume_guard_stays_out_when_the_change_can_load(args, checkpoint, env):
    plan = resume(args=args, env_settings=env(GRAD_REDUCE_IN_BF16=0), checkpoint=checkpoint)
    assert plan.decisions["grad_reduce_in_bf16"].value is False


def test_resume_guard_takes_an_unrecorded_checkpoint_as_stock_saved_it():
    # stock wrote it with an fp32 gradient buffer (Megatron's default): the plugin's bf16 default
    # could not load its dp_reshardable optimizer state
    unrecorded = {"iteration": 4, "decisions": {}, "recorded": False}
    args = {"ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": False}
    d = resume(args=args, checkpoint=unrecorded).decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (False, "guard")
    # stock saved what its command line asked for: resuming with the same flag is stock's own resume
    d = resume(args=args, checkpoint=unrecorded, explicit={"grad_reduce_in_bf16": True}).decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (True, "cli")
    # model-space optimizer state moves between buffers: the default stays
    args = {**args, "dist_ckpt_optim_fully_reshardable": True}
    assert resume(args=args, checkpoint=unrecorded).decisions["grad_reduce_in_bf16"].value is True


def test_resume_guard_without_a_recorded_layout_computes_it_from_the_args(env):
    saved = {"iteration": 4, "decisions": {"grad_reduce_in_bf16": True}}
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0), checkpoint=saved,
                  args={"ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": False})
    assert plan.decisions["grad_reduce_in_bf16"].value is True
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0), checkpoint=saved, args={"use_distributed_optimizer": False})
    assert plan.decisions["grad_reduce_in_bf16"].value is False


def test_resume_guard_under_mxfp4_keeps_fp32_and_turns_fusion_off():
    # mxfp4 + fusion would force a bf16 buffer, but the checkpoint was saved with fp32 gradients:
    # fusion goes off instead, so both the load and the wgrad kernel work.
    saved_fp32 = {**SAVED_BF16, "decisions": {"grad_reduce_in_bf16": False}}
    plan = resume(args=MXFP4, checkpoint=saved_fp32)
    assert plan.decisions["grad_reduce_in_bf16"].value is False
    assert plan.decisions["gradient_accumulation_fusion"].value is False
    assert "bf16" in plan.decisions["gradient_accumulation_fusion"].reason


@pytest.mark.parametrize("args", [
    {"bf16": False, "fp16": True},  # the toggle is read under --bf16 only
    {"main_grads_dtype": "bf16"},  # bf16 main grads: a bf16 buffer either way
    {"moe_use_upcycling": True},  # validate_args turns these into --no-load-optim / finetuning
    {"skip_train": True},
    {"freeze_all_layers": True},
])
def test_resume_guard_stays_out_when_the_buffer_or_the_load_does_not_depend_on_it(args, env):
    plan = resume(args=args, env_settings=env(GRAD_REDUCE_IN_BF16=0))
    assert plan.decisions["grad_reduce_in_bf16"].value is False


def test_resume_guard_skip_train_in_rl_still_loads_the_optimizer(env):
    plan = resume(args={"skip_train": True, "perform_rl_step": True}, env_settings=env(GRAD_REDUCE_IN_BF16=0))
    assert plan.decisions["grad_reduce_in_bf16"].value is True


def test_resume_guard_uses_what_the_writer_recorded(env):
    # No optimizer state was saved: nothing keyed to load.
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0), checkpoint={**SAVED_BF16, "optimizer_state_saved": False})
    assert plan.decisions["grad_reduce_in_bf16"].value is False
    # The recorded buffer dtype is enough, even without the writer's decisions.
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0), checkpoint={
        "iteration": 4, "grad_buffer_dtype": "bf16", "optimizer_layout": ["grad-dtype-keyed", "dp_reshardable"]})
    assert plan.decisions["grad_reduce_in_bf16"].value is True
    # The saved layout decides, not the resuming run's flags (Megatron loads what was saved).
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0), args={"dist_ckpt_optim_fully_reshardable": True})
    assert plan.decisions["grad_reduce_in_bf16"].value is True
    # A malformed recorded layout falls back to the resuming run's arguments.
    plan = resume(env_settings=env(GRAD_REDUCE_IN_BF16=0), checkpoint={**SAVED_BF16, "optimizer_layout": ["x"]},
                  args={"ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": True})
    assert plan.decisions["grad_reduce_in_bf16"].value is False


def test_resume_guard_gives_back_an_explicit_value_mxfp4_had_overridden():
    saved_fp32 = {**SAVED_BF16, "decisions": {"grad_reduce_in_bf16": False}}
    plan = resume(args=MXFP4, explicit={"grad_reduce_in_bf16": False}, checkpoint=saved_fp32)
    d = plan.decisions["grad_reduce_in_bf16"]
    assert (d.value, d.source) == (False, "cli")
    assert not any(m.text.startswith("grad_reduce_in_bf16:") for m in plan.messages)  # no stale mxfp4 warning
    assert plan.decisions["gradient_accumulation_fusion"].value is False
    with pytest.raises(CannotHonourError) as info:
        resume(args=MXFP4, explicit={"gradient_accumulation_fusion": True}, checkpoint=saved_fp32)
    assert "--no-gradient-accumulation-fusion" in str(info.value)


def test_explicit_te_impl_without_te_backs_the_fusion_default_off():
    caps = full_caps(te_cross_entropy=False, te_version=None)
    plan = run(explicit={"cross_entropy_fusion_impl": "te"}, caps=caps)
    assert (plan.decisions["cross_entropy_loss_fusion"].value, plan.decisions["cross_entropy_loss_fusion"].source) \
        == (False, "guard")
    with pytest.raises(CannotHonourError, match="--cross-entropy-fusion-impl te"):
        run(explicit={"cross_entropy_fusion_impl": "te", "cross_entropy_loss_fusion": True}, caps=caps)


# --- log directories ----------------------------------------------------------------------------


def test_log_dir_tagged_by_a_script_keeps_its_path():
    plan = run(args={"tensorboard_dir": "exp/run/bf16/2025-01-01_00-00-00"})
    assert plan.log_dirs == {"tensorboard_dir": "exp/run/bf16/2025-01-01_00-00-00"}
    assert plan.messages == []


def test_mislabelled_log_dir_is_warned_and_tagged_with_the_true_precision(env):
    args = {"fp8": "e4m3", "fp8_recipe": "tensorwise", "tensorboard_dir": "exp/run/bf16/ts"}
    plan = run(args=args)
    assert plan.log_dirs == {"tensorboard_dir": "exp/run/bf16/ts/fp8_tensorwise"}
    assert [m.level for m in plan.messages] == ["warning"] and "'bf16'" in plan.messages[0].text
    untagged = run(args=args, env_settings=env(MEGATRON_PERF_TOGGLES_TAG_LOG_DIR=0))
    assert untagged.log_dirs == {} and untagged.messages == []


def test_a_guard_that_takes_back_room_made_for_an_explicit_request_refuses():
    # --accumulate-allreduce-grads-in-fp32 moved the bf16 default off; the checkpoint needs bf16 back.
    with pytest.raises(CannotHonourError, match="--accumulate-allreduce-grads-in-fp32 was requested"):
        resume(args={"accumulate_allreduce_grads_in_fp32": True})


def test_mxfp4_taking_back_room_made_for_fp32_accumulation_says_so():
    plan = run(args={**MXFP4, "accumulate_allreduce_grads_in_fp32": True})
    assert plan.decisions["grad_reduce_in_bf16"].value is True
    assert any("--accumulate-allreduce-grads-in-fp32 was requested" in m.text for m in plan.messages)


def test_dependency_error_hint_never_suggests_turning_the_needed_toggle_off():
    with pytest.raises(DependencyError) as e:
        run(args={"defer_embedding_wgrad_compute": True}, caps=full_caps(apex_fused_wgrad=False))
    assert "--no-gradient-accumulation-fusion" not in str(e.value.hint)


def test_an_unreadable_te_version_is_not_blamed_for_a_minimum():
    d = run(args={"use_megatron_fsdp": True}, caps=full_caps(te_version="unknown")).decisions
    assert d["gradient_accumulation_fusion"].value is True
