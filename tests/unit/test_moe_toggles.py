"""The mixture-of-experts toggles (issue 36): they apply to MoE models only, and each guard turns its
toggle off where Megatron or Transformer Engine would fail (capability present and missing, the
version that carries the rule and one that does not, an explicit request where it cannot run).
No Megatron, no GPU: the rules each release carries come from the rules table, the facts the
guards weigh are written out here from Megatron's sources."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import LLAMA_ARGS, MOE_ARGS, full_caps

from megatron_perf_toggles.core.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import MegatronFacts, with_assumptions
from megatron_perf_toggles.core.megatron_rules import rules_of
from megatron_perf_toggles.errors import CannotHonourError
from megatron_perf_toggles.tools.ablate.design import default_toggles, parse_toggles

MOE = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion")


def megatron(release: str) -> MegatronFacts:
    return MegatronFacts(version=release, rules=rules_of(release))


def plan(args=None, explicit=None, environ=None, release="main", model=MOE_ARGS, checkpoint=None, **caps):
    facts = caps.pop("megatron", megatron(release))
    return decide({**model, **(args or {})}, explicit or {}, read_env(environ or {}),
                  full_caps(megatron=facts, **caps), checkpoint=checkpoint)


def got(p, dest):
    d = p.decisions[dest]
    return d.value, d.source


# --- applying to MoE models only ------------------------------------------------------------------


@pytest.mark.parametrize("release", ["0.13.0", "0.16.0", "main"])
def test_moe_model_gets_every_moe_toggle_on(release):
    args = {"bf16": True} if release == "0.13.0" else {}
    p = plan(args, release=release, gpu_arch="sm_90")
    expected_router = release != "0.13.0"  # core 0.13's TransformerConfig has no moe_router_fusion
    assert [p.decisions[d].value for d in MOE] == [True, True, expected_router]
    assert p.not_applicable == ()


@pytest.mark.parametrize("environ", [{}, {"MOE_GROUPED_GEMM": "1", "MOE_PERMUTE_FUSION": "1", "MOE_ROUTER_FUSION": "1"}])
def test_dense_model_keeps_megatrons_values_whatever_is_asked(environ):
    p = plan(environ=environ, model=LLAMA_ARGS)
    for dest in MOE:
        assert got(p, dest) == (False, "default")
        assert "not a mixture-of-experts model" in p.decisions[dest].reason
    assert set(p.not_applicable) == set(MOE)
    assert not set(p.shown()) & set(MOE) and set(p.decisions) >= set(MOE)
    assert p.messages == []


def test_dense_model_keeps_an_explicit_flag_and_no_guard_judges_it():
    # stock Megatron takes --moe-grouped-gemm on a dense model (it builds no experts): so does the plugin,
    # even where a MoE model's experts could not take it (biased linear layers)
    p = plan({"add_bias_linear": True}, explicit={"moe_grouped_gemm": True}, model=LLAMA_ARGS)
    assert got(p, "moe_grouped_gemm") == (True, "cli")


def test_num_experts_zero_is_dense():
    p = plan({"num_experts": 0})
    assert p.decisions["moe_grouped_gemm"].value is False and "moe_grouped_gemm" in p.not_applicable


# --- grouped GEMM ---------------------------------------------------------------------------------


@pytest.mark.parametrize("release, bf16, on", [
    ("0.13.0", False, False), ("0.15.0", False, False), ("0.15.0", True, True), ("0.16.0", False, True),
])
def test_grouped_gemm_needs_bf16_up_to_015(release, bf16, on):
    p = plan({"bf16": bf16, "fp16": not bf16}, release=release)
    assert p.decisions["moe_grouped_gemm"].value is on
    if not on:
        assert "--bf16" in p.decisions["moe_grouped_gemm"].reason


@pytest.mark.parametrize("arch, on", [("sm_70", False), ("sm_80", True), ("sm_90", True), ("gfx942", True), (None, True)])
def test_grouped_gemm_needs_compute_capability_8(arch, on):
    assert plan(gpu_arch=arch).decisions["moe_grouped_gemm"].value is on


@pytest.mark.parametrize("te, on", [("1.10", False), ("1.11", True), ("2.20.2", True)])
def test_fp8_grouped_gemm_needs_te_111(te, on):
    assert plan({"fp8": "hybrid"}, te_version=te).decisions["moe_grouped_gemm"].value is on


@pytest.mark.parametrize("release, args, on", [
    ("0.13.0", {"add_bias_linear": True, "bias_dropout_fusion": False}, False),  # TEGroupedMLP: no bias at all
    ("0.14.0", {"add_bias_linear": False}, True),
    ("0.15.0", {"add_bias_linear": True, "bias_dropout_fusion": False}, True),  # bias, no bias-dropout fusion
    ("main", {"add_bias_linear": True, "bias_dropout_fusion": True}, False),
    ("main", {"add_bias_linear": True}, False),  # bias-dropout fusion is Megatron's default
    ("main", {"add_bias_linear": False, "bias_dropout_fusion": True}, True),
])
def test_grouped_gemm_with_biased_experts(release, args, on):
    p = plan({"bf16": True, **args}, release=release)
    assert p.decisions["moe_grouped_gemm"].value is on, p.decisions["moe_grouped_gemm"].reason


@pytest.mark.parametrize("release, args, package, on", [
    ("0.16.0", {"transformer_impl": "local"}, False, False),
    ("0.16.0", {"transformer_impl": "local"}, True, True),
    ("0.13.0", {"moe_use_legacy_grouped_gemm": True, "bf16": True}, False, False),
    ("0.17.0", {"transformer_impl": "local"}, False, True),  # no legacy path: SequentialMLP, nothing to fail
])
def test_legacy_grouped_mlp_needs_the_grouped_gemm_package(release, args, package, on):
    p = plan(args, release=release, grouped_gemm_package=package)
    assert p.decisions["moe_grouped_gemm"].value is on
    if not on:
        assert "grouped_gemm package" in p.decisions["moe_grouped_gemm"].reason


def test_te_without_grouped_linear_takes_grouped_gemm_off_and_refuses_it_by_name():
    assert got(plan(te_grouped_linear=False), "moe_grouped_gemm") == (False, "guard")
    with pytest.raises(CannotHonourError, match="--moe-grouped-gemm"):
        plan(explicit={"moe_grouped_gemm": True}, te_grouped_linear=False)
    # up to 0.16 it falls to the legacy GroupedMLP: on where the grouped_gemm package is there
    assert plan(release="0.16.0", te_grouped_linear=False, grouped_gemm_package=True).decisions[
        "moe_grouped_gemm"].value is True


def test_grouped_gemm_off_where_the_planned_stack_lacks_it_is_marked_assumed():
    caps = with_assumptions(full_caps(megatron=megatron("main")), "none,cuda,te=1.8")
    p = decide(MOE_ARGS, {}, read_env({}), caps)
    assert got(p, "moe_grouped_gemm") == (False, "assumed")


@pytest.mark.parametrize("args, te, on", [
    ({"swiglu": True}, "2.20", True),
    ({"swiglu": True}, "2.13", False),
    ({"swiglu": True, "expert_tensor_parallel_size": 2}, "2.20", False),
    ({"swiglu": True, "tensor_model_parallel_size": 2}, "2.20", False),  # expert TP follows TP when unset
    ({"swiglu": True, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, "2.20", True),
    ({"swiglu": False}, "2.20", False),
    ({"swiglu": False, "squared_relu": True, "use_fused_weighted_squared_relu": True}, "2.20", True),
    ({"swiglu": True, "moe_apply_probs_on_input": True}, "2.20", False),
])
def test_op_fuser_takes_grouped_gemm_only_where_the_fused_grouped_mlp_can(args, te, on):
    p = plan({"use_transformer_engine_op_fuser": True, **args}, te_version=te)
    assert p.decisions["moe_grouped_gemm"].value is on


def test_op_fuser_rule_binds_only_from_018():
    p = plan({"use_transformer_engine_op_fuser": True, "swiglu": False}, release="0.17.0")
    assert p.decisions["moe_grouped_gemm"].value is True


# --- resuming a checkpoint --------------------------------------------------------------------------


def _resume(fmt, saved=None, **args):
    ck = {"decisions": {"moe_grouped_gemm": saved}, "iteration": 100} if saved is not None else {}
    return plan({"load": "/ckpt", "ckpt_format": fmt, **args}, checkpoint=ck)


def test_torch_format_checkpoint_keeps_the_saved_expert_layout():
    assert got(_resume("torch", saved=False), "moe_grouped_gemm") == (False, "guard")
    assert got(_resume("torch", saved=True), "moe_grouped_gemm") == (True, "default")
    with pytest.raises(CannotHonourError):
        plan({"load": "/ckpt", "ckpt_format": "torch"}, checkpoint={"decisions": {"moe_grouped_gemm": True}},
             explicit={"moe_grouped_gemm": False})


def test_unrecorded_torch_format_checkpoint_keeps_megatrons_default():
    p = _resume("torch")
    assert got(p, "moe_grouped_gemm") == (False, "guard") and "not recorded" in p.decisions["moe_grouped_gemm"].reason
    assert _resume("torch", finetune=True).decisions["moe_grouped_gemm"].value is True


def test_distributed_checkpoint_moves_between_sequential_and_te_grouped_mlp():
    assert _resume("torch_dist", saved=False).decisions["moe_grouped_gemm"].value is True
    assert _resume("torch_dist").decisions["moe_grouped_gemm"].value is True


def test_legacy_grouped_mlp_optimizer_state_does_not_move_in_a_distributed_checkpoint():
    ck = {"decisions": {"moe_grouped_gemm": False}, "iteration": 10}
    args = {"load": "/ckpt", "transformer_impl": "local"}
    p = plan(args, release="0.16.0", grouped_gemm_package=True, checkpoint=ck)
    assert got(p, "moe_grouped_gemm") == (False, "guard")
    p = plan({**args, "no_load_optim": True}, release="0.16.0", grouped_gemm_package=True, checkpoint=ck)
    assert p.decisions["moe_grouped_gemm"].value is True


# --- permute fusion ---------------------------------------------------------------------------------


def test_permute_fusion_needs_te_21_kernels():
    p = plan(te_fused_permute=False)
    assert got(p, "moe_permute_fusion") == (False, "guard")
    assert got(plan(), "moe_permute_fusion") == (True, "default")
    with pytest.raises(CannotHonourError, match="--moe-permute-fusion"):
        plan(explicit={"moe_permute_fusion": True}, te_fused_permute=False)
    caps = with_assumptions(full_caps(megatron=megatron("main")), "te=2.0")
    assert got(decide(MOE_ARGS, {}, read_env({}), caps), "moe_permute_fusion") == (False, "assumed")


@pytest.mark.parametrize("release, on", [("main", False), ("0.19.0", True)])
def test_batch_invariant_mode_takes_permute_fusion_off_where_megatron_asserts(release, on):
    assert plan({"batch_invariant_mode": True}, release=release).decisions["moe_permute_fusion"].value is on


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall", "flex"])
def test_permute_fusion_stays_on_with_every_dispatcher_and_expert_parallelism(dispatcher):
    p = plan({"moe_token_dispatcher_type": dispatcher, "expert_model_parallel_size": 8,
              "expert_tensor_parallel_size": 2, "moe_flex_dispatcher_backend": "hybridep"})
    assert p.decisions["moe_permute_fusion"].value is True


# --- router fusion ----------------------------------------------------------------------------------


def test_router_fusion_needs_the_transformer_config_field():
    p = plan({"bf16": True}, release="0.13.0")
    assert got(p, "moe_router_fusion") == (False, "guard") and "0.14" in p.decisions["moe_router_fusion"].reason
    with pytest.raises(CannotHonourError, match="--moe-router-fusion"):
        plan({"bf16": True}, release="0.13.0", explicit={"moe_router_fusion": True})


@pytest.mark.parametrize("te, kernel, on", [("2.20", True, True), ("2.6", True, False), ("2.20", False, False)])
def test_router_fusion_needs_te_27(te, kernel, on):
    # Megatron imports TE's router kernels only from TE 2.7, whatever an older TE has
    assert plan(te_version=te, te_fused_router=kernel).decisions["moe_router_fusion"].value is on


@pytest.mark.parametrize("te, release, on", [("2.12", "main", False), ("2.13", "main", True), ("2.12", "0.17.0", True)])
def test_sqrtsoftplus_router_fusion_needs_te_213(te, release, on):
    p = plan({"moe_router_score_function": "sqrtsoftplus"}, te_version=te, release=release)
    assert p.decisions["moe_router_fusion"].value is on


@pytest.mark.parametrize("release, on", [("main", False), ("0.19.0", False), ("0.18.2", True)])
def test_quantile_balancing_takes_router_fusion_off(release, on):
    p = plan({"moe_router_load_balancing_type": ["quantile_balancing"]}, release=release)
    assert p.decisions["moe_router_fusion"].value is on


@pytest.mark.parametrize("release, on", [("0.16.0", False), ("main", False), ("0.15.0", True)])
def test_routing_replay_takes_router_fusion_off(release, on):
    p = plan({"moe_enable_routing_replay": True, "bf16": True}, release=release)
    assert p.decisions["moe_router_fusion"].value is on


def test_environment_value_a_guard_overrides_is_warned_about():
    p = plan(environ={"MOE_ROUTER_FUSION": "1"}, te_fused_router=False)
    assert got(p, "moe_router_fusion") == (False, "guard")
    assert any("moe_router_fusion" in m.text for m in p.messages if m.level == "warning")


def test_plugin_switched_off_leaves_megatrons_values_on_a_moe_model():
    p = plan(environ={"MEGATRON_PERF_TOGGLES": "0"})
    assert [got(p, d) for d in MOE] == [(False, "default")] * 3


# --- ablate's default toggles follow the model ------------------------------------------------------


@pytest.mark.parametrize("words, moe", [
    ([], False), (["--num-layers", "4"], False), (["--num-experts", "8"], True), (["--num-experts=4"], True),
    (["--num-experts", "0"], False),
])
def test_ablate_default_toggles_add_the_moe_ones_only_for_moe_runs(words, moe):
    names = default_toggles(words)
    assert set(MOE) <= set(names) if moe else not set(MOE) & set(names)
    assert "grad_reduce_in_bf16" in names
    assert parse_toggles(None, words) == names
    assert parse_toggles("moe_router_fusion", []) == ("moe_router_fusion",)  # named, it takes part anywhere


def test_memory_column_stays_working_for_moe_decisions():
    p = plan()
    assert p.memory is not None and set(MOE) <= set(p.memory.get("peak_memory_delta_mb") or MOE)
    dense = plan(model=LLAMA_ARGS)
    assert all((dense.memory.get("peak_memory_delta_mb") or {}).get(d) in (0, 0.0, None) for d in MOE)
    assert replace(dense, not_applicable=()).shown().keys() >= set(MOE)
