"""The mixture-of-experts toggles (issue 36): they apply to MoE models only, and each guard turns its
toggle off where Megatron or Transformer Engine would fail (capability present and missing, the
version that carries the rule and one that does not, an explicit request where it cannot run).
No Megatron, no GPU: the rules each release carries come from the rules table, the facts the
guards weigh are written out here from Megatron's sources."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import LLAMA_ARGS, MOE_ARGS, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import MegatronFacts, with_assumptions
from megatron_perf_toggles.core.rules.megatron_rules import rules_of
from megatron_perf_toggles.errors import CannotHonourError
from megatron_perf_toggles.tools.ablate.spec import default_toggles, parse_toggles

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
    # up to 0.16 with no legacy package the job fails to build its experts: an explicit request is refused
    with pytest.raises(CannotHonourError, match="--moe-grouped-gemm"):
        plan(explicit={"moe_grouped_gemm": True}, release="0.16.0", te_grouped_linear=False,
             grouped_gemm_package=False)
    # from 0.17 the TE spec falls back to SequentialMLP: the default goes off, an explicit flag is Megatron's
    p = plan(te_grouped_linear=False)
    assert got(p, "moe_grouped_gemm") == (False, "guard")
    assert "Megatron builds SequentialMLP" in p.decisions["moe_grouped_gemm"].reason
    assert got(plan(explicit={"moe_grouped_gemm": True}, release="0.17.0", te_grouped_linear=False),
               "moe_grouped_gemm") == (True, "cli")
    # up to 0.16 it falls to the legacy GroupedMLP: on where the grouped_gemm package is there
    assert plan(release="0.16.0", te_grouped_linear=False, grouped_gemm_package=True).decisions[
        "moe_grouped_gemm"].value is True


def test_grouped_gemm_off_where_the_planned_stack_lacks_it_is_marked_assumed():
    caps = with_assumptions(full_caps(megatron=megatron("main")), "none,cuda,te=1.8")
    p = decide(MOE_ARGS, {}, read_env({}), caps)
    assert got(p, "moe_grouped_gemm") == (False, "assumed")


SRELU = {"swiglu": False, "squared_relu": True, "use_fused_weighted_squared_relu": True}


@pytest.mark.parametrize("release, args, te, on", [
    ("0.18.0", {"swiglu": True}, "2.20", True),
    ("0.18.0", {"swiglu": True}, "2.13", False),
    ("0.18.0", {"swiglu": True, "expert_tensor_parallel_size": 2}, "2.20", False),
    ("0.18.0", {"swiglu": True, "tensor_model_parallel_size": 2}, "2.20", False),  # expert TP follows TP when unset
    ("0.18.0", {"swiglu": True, "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, "2.20", True),
    ("main", {"swiglu": False}, "2.20", False),
    ("main", SRELU, "2.20", True),
    ("main", {"swiglu": True, "moe_apply_probs_on_input": True}, "2.20", False),
])
def test_op_fuser_takes_grouped_gemm_only_where_the_fused_grouped_mlp_can(release, args, te, on):
    p = plan({"use_transformer_engine_op_fuser": True, **args}, release=release, te_version=te)
    assert p.decisions["moe_grouped_gemm"].value is on


@pytest.mark.parametrize("release, args, on", [
    # 0.19/main: gated experts go fused only with NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0 (unset here)
    ("0.18.2", {"swiglu": True}, True), ("0.19.0", {"swiglu": True}, False), ("main", {"quick_geglu": True}, False),
    # from 0.18: offloading expert_fc1 or moe_act
    ("0.17.0", {**SRELU, "fine_grained_activation_offloading": True, "offload_modules": ["moe_act"]}, True),
    ("0.18.0", {**SRELU, "fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1"]}, False),
    ("main", {**SRELU, "fine_grained_activation_offloading": True, "offload_modules": ["moe_act"]}, False),
    ("main", {**SRELU, "fine_grained_activation_offloading": True, "offload_modules": ["attn_norm"]}, True),
    # 0.19/main: a biased fc2 needs TE's scale_bias (unknown here)
    ("0.18.0", {**SRELU, "add_bias_linear": True, "bias_dropout_fusion": False}, True),
    ("0.19.0", {**SRELU, "add_bias_linear": True, "bias_dropout_fusion": False}, False),
])
def test_op_fuser_blockers_by_version(release, args, on):
    p = plan({"use_transformer_engine_op_fuser": True, **args}, release=release, te_version="2.20")
    assert p.decisions["moe_grouped_gemm"].value is on, p.decisions["moe_grouped_gemm"].reason
    if not on:
        assert p.decisions["moe_grouped_gemm"].source == "guard"


# ("" and "yes": Megatron's int() would raise where it reads them; the plan keeps grouped GEMM off there)
@pytest.mark.parametrize("value, on", [("1", True), ("2", True), ("0", False), ("", False), ("yes", False)])
def test_op_fuser_gated_experts_follow_the_cutedsl_variable(value, on):
    # Megatron reads it as an integer above 0 (anything else: not fused, so grouped GEMM would assert)
    p = plan({"use_transformer_engine_op_fuser": True, "swiglu": True}, release="0.19.0", te_version="2.20",
             environ={"NVTE_CUTEDSL_FUSED_GROUPED_MLP": value})
    assert p.decisions["moe_grouped_gemm"].value is on, p.decisions["moe_grouped_gemm"].reason


def test_op_fuser_clamped_swiglu_needs_te_217_on_main():
    from megatron_perf_toggles.core.decision.plan import Context
    from megatron_perf_toggles.core.rules import guards_moe

    def blocker(release, te):
        caps = full_caps(megatron=megatron(release), te_version=te)
        args = {**MOE_ARGS, "swiglu": True, "activation_func_clamp_value": 7.0}
        return guards_moe._op_fuser_activation(Context(args, {}, caps, read_env({})))
    assert "2.17" in blocker("main", "2.16")
    assert "2.17" not in blocker("main", "2.17") and "NVTE_CUTEDSL" in blocker("main", "2.17")
    assert "2.17" not in blocker("0.19.0", "2.16")


def test_op_fuser_with_an_explicit_grouped_gemm_is_megatrons_to_judge():
    # a functional test of Megatron's own (groupedGEMM_op_fuser) names both: stock takes the command line
    p = plan({"use_transformer_engine_op_fuser": True, "swiglu": True}, te_version="2.12",
             explicit={"moe_grouped_gemm": True})
    assert got(p, "moe_grouped_gemm") == (True, "cli")


def test_op_fuser_rule_binds_only_from_018():
    p = plan({"use_transformer_engine_op_fuser": True, "swiglu": False}, release="0.17.0")
    assert p.decisions["moe_grouped_gemm"].value is True


# --- resuming a checkpoint --------------------------------------------------------------------------


def _resume(fmt, saved=None, **args):
    # what resume.checkpoint_writer hands the plan: the writer's decisions, or none where no launch recorded them
    ck = {"decisions": {"moe_grouped_gemm": saved} if saved is not None else {}, "iteration": 100}
    return plan({"load": "/ckpt", "ckpt_format": fmt, **args}, checkpoint=ck)


def test_nothing_to_resume_leaves_grouped_gemm_free():
    assert plan({"load": "/empty", "ckpt_format": "torch"}, checkpoint=None).decisions["moe_grouped_gemm"].value is True


def test_torch_format_checkpoint_keeps_the_saved_expert_layout():
    assert got(_resume("torch", saved=False), "moe_grouped_gemm") == (False, "guard")
    assert got(_resume("torch", saved=True), "moe_grouped_gemm") == (True, "default")
    with pytest.raises(CannotHonourError):
        plan({"load": "/ckpt", "ckpt_format": "torch"}, checkpoint={"decisions": {"moe_grouped_gemm": True}},
             explicit={"moe_grouped_gemm": False})


def test_unrecorded_torch_format_checkpoint_keeps_megatrons_default():
    p = _resume("torch")
    assert got(p, "moe_grouped_gemm") == (False, "guard") and "without this plugin" in p.decisions["moe_grouped_gemm"].reason
    # torch-format weights load by module name whatever --finetune says
    assert got(_resume("torch", finetune=True), "moe_grouped_gemm") == (False, "guard")


@pytest.mark.parametrize("fmt", ["torch", "torch_dcp", "fsdp_dtensor"])
def test_unrecorded_checkpoint_takes_the_command_lines_own_grouped_gemm_as_saved(fmt):
    # stock saved with the flag the command line (or a config) gives: resuming with it is stock's own resume
    ck = {"decisions": {}, "iteration": 100, "recorded": False}
    p = plan({"load": "/ckpt", "ckpt_format": fmt}, explicit={"moe_grouped_gemm": True}, checkpoint=ck)
    assert got(p, "moe_grouped_gemm") == (True, "cli")


@pytest.mark.parametrize("fmt", ["torch_dcp", "fsdp_dtensor"])
def test_every_format_that_saves_by_module_keeps_the_saved_layout(fmt):
    assert got(_resume(fmt), "moe_grouped_gemm") == (False, "guard")
    assert got(_resume(fmt, saved=False), "moe_grouped_gemm") == (False, "guard")
    assert got(_resume(fmt, saved=True), "moe_grouped_gemm") == (True, "default")


def test_auto_detected_format_is_read_from_disk_or_taken_as_unknown(tmp_path):
    from megatron_perf_toggles.runtime import resume

    args = {**MOE_ARGS, "load": str(tmp_path), "ckpt_format": "torch_dist", "auto_detect_ckpt_format": True}
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")
    writer = resume.checkpoint_writer(args)  # no iter folder: unknown, so the stock layout is kept
    assert writer["format_on_disk"] is None and got(plan(args, checkpoint=writer), "moe_grouped_gemm")[0] is False
    (tmp_path / "iter_0000040" / "mp_rank_00").mkdir(parents=True)
    writer = resume.checkpoint_writer(args)
    assert writer["format_on_disk"] == "torch" and got(plan(args, checkpoint=writer), "moe_grouped_gemm")[0] is False
    (tmp_path / "iter_0000040" / "metadata.json").write_text("{}")
    writer = resume.checkpoint_writer(args)  # stock wrote it (no history): its SequentialMLP is kept
    assert writer["format_on_disk"] == "torch_dist" and got(plan(args, checkpoint=writer), "moe_grouped_gemm")[0] is False
    for sub in ("mp_rank_00", "metadata.json"):
        target = tmp_path / "iter_0000040" / sub
        target.rmdir() if target.is_dir() else target.unlink()
    (tmp_path / "iter_0000040" / ".metadata").write_text("")
    assert resume.checkpoint_writer(args)["format_on_disk"] == "torch_dcp"
    assert resume.checkpoint_writer({**args, "use_megatron_fsdp": True})["format_on_disk"] == "fsdp_dtensor"


def test_distributed_checkpoint_moves_between_sequential_and_te_grouped_mlp_only_by_name():
    # weights (and a non-distributed optimizer's state) are kept by parameter name: free to move
    assert _resume("torch_dist", saved=False).decisions["moe_grouped_gemm"].value is True
    # the distributed optimizer's default layouts keep state by position in the gradient buffers,
    # which SequentialMLP and the grouped experts fill in different orders
    p = _resume("torch_dist", saved=False, use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=False)
    assert got(p, "moe_grouped_gemm") == (False, "guard") and "dp_reshardable" in p.decisions["moe_grouped_gemm"].reason
    assert _resume("torch_dist", saved=False, use_distributed_optimizer=True,
                   dist_ckpt_optim_fully_reshardable=True).decisions["moe_grouped_gemm"].value is True
    assert _resume("torch_dist", saved=False, use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=False,
                   no_load_optim=True).decisions["moe_grouped_gemm"].value is True
    # a checkpoint stock wrote keeps stock's layout, whatever its format
    assert got(_resume("torch_dist"), "moe_grouped_gemm") == (False, "guard")


def test_a_default_torch_dist_resume_reads_the_format_on_disk(tmp_path):
    # Megatron reads the format of a torch_dist (default) checkpoint from disk, not only under auto-detect
    from megatron_perf_toggles.runtime import resume

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")
    (tmp_path / "iter_0000040" / "mp_rank_00").mkdir(parents=True)
    (tmp_path / resume.HISTORY_NAME).write_text('{"start_iteration": 0, "decisions": {"moe_grouped_gemm": false}}\n')
    args = {**MOE_ARGS, "load": str(tmp_path)}
    writer = resume.checkpoint_writer(args)
    assert writer["format_on_disk"] == "torch" and writer["decisions"] == {"moe_grouped_gemm": False}
    p = plan(args, checkpoint=writer)
    assert got(p, "moe_grouped_gemm") == (False, "guard") and "torch format" in p.decisions["moe_grouped_gemm"].reason


def test_release_and_pretrained_checkpoints_are_resumed_too(tmp_path):
    from megatron_perf_toggles.runtime import resume

    pre = tmp_path / "pre"
    (pre / "release" / "mp_rank_00").mkdir(parents=True)
    (pre / "latest_checkpointed_iteration.txt").write_text("release")
    args = {**MOE_ARGS, "load": str(tmp_path / "empty"), "pretrained_checkpoint": str(pre)}
    writer = resume.checkpoint_writer(args)  # no checkpoint in --load: Megatron finetunes from the pretrained one
    assert writer["load_dir"] == str(pre) and writer["iteration"] == resume.RELEASE
    assert writer["format_on_disk"] == "torch"
    assert got(plan(args, checkpoint=writer), "moe_grouped_gemm") == (False, "guard")


def test_unreadable_resume_files_never_stop_the_plan(tmp_path):
    from megatron_perf_toggles.runtime import resume

    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe40")
    assert resume.checkpoint_writer({"load": str(tmp_path)}) is None  # no readable tracker: nothing known
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")
    (tmp_path / resume.HISTORY_NAME).write_bytes(b'{"start_iteration": "x", "decisions": {}}\n\xff\n'
                                                 b'{"start_iteration": 10, "decisions": {"moe_grouped_gemm": true}}\n')
    writer = resume.checkpoint_writer({"load": str(tmp_path)})
    assert writer["iteration"] == 40 and writer["decisions"] == {"moe_grouped_gemm": True}


def test_legacy_grouped_mlp_optimizer_state_does_not_move_in_a_distributed_checkpoint():
    ck = {"decisions": {"moe_grouped_gemm": False}, "iteration": 10}
    args = {"load": "/ckpt", "transformer_impl": "local"}
    p = plan(args, release="0.16.0", grouped_gemm_package=True, checkpoint=ck)
    assert got(p, "moe_grouped_gemm") == (False, "guard")
    p = plan({**args, "no_load_optim": True}, release="0.16.0", grouped_gemm_package=True, checkpoint=ck)
    assert p.decisions["moe_grouped_gemm"].value is True
    # a checkpoint no launch recorded holds stock's SequentialMLP: the same move, the same answer
    p = plan(args, release="0.16.0", grouped_gemm_package=True, checkpoint={"decisions": {}, "iteration": 10})
    assert got(p, "moe_grouped_gemm") == (False, "guard") and "without this plugin" in p.decisions["moe_grouped_gemm"].reason


@pytest.mark.parametrize("release, args, on", [
    ("0.16.0", {"bf16": False}, False), ("0.17.0", {"bf16": False}, True),  # 0.16's GroupedMLP.forward asserts bf16
    ("0.16.0", {"quick_geglu": True}, False), ("0.15.0", {"quick_geglu": True}, False),
    ("0.16.0", {"swiglu": True}, True),
    ("0.16.0", {"moe_latent_size": 128}, False), ("0.15.0", {"moe_latent_size": 128}, True),
    ("0.14.0", {"fp8": "hybrid", "recompute_granularity": "selective", "recompute_modules": ["moe_act"]}, False),
    ("0.13.0", {"fp8": "hybrid", "recompute_granularity": "selective", "recompute_modules": ["moe_act"]}, True),
])
def test_legacy_grouped_mlp_refuses_what_it_cannot_build(release, args, on):
    base = {"transformer_impl": "local", "bf16": True, "swiglu": False}
    p = plan({**base, **args}, release=release, grouped_gemm_package=True, te_version="2.20", gpu_arch="sm_90")
    assert p.decisions["moe_grouped_gemm"].value is on, p.decisions["moe_grouped_gemm"].reason
    if not on:
        assert "legacy GroupedMLP" in p.decisions["moe_grouped_gemm"].reason


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
    assert p.memory is not None and set(MOE) <= set(p.memory.get("peak_memory_delta_mb") or ())
    dense = plan(model=LLAMA_ARGS)
    assert all((dense.memory.get("peak_memory_delta_mb") or {}).get(d) in (0, 0.0, None) for d in MOE)
    assert replace(dense, not_applicable=()).shown().keys() >= set(MOE)


# --- front ends: where each MoE toggle lives -------------------------------------------------------


def test_front_ends_find_the_moe_toggles_under_megatrons_names():
    from megatron_perf_toggles.core.config_fields import PRIMUS_HOMES, bridge_homes

    homes = bridge_homes()
    for dest in MOE:  # Bridge: TransformerConfig's fields (cfg.model.<dest>); Primus: the YAML key is the dest
        assert [h.path for h in homes[dest]] == [f"model.{dest}"] and not homes[dest][0].inverted
        assert [h.path for h in PRIMUS_HOMES[dest]] == [dest]


def test_a_front_end_model_is_moe_by_its_num_moe_experts():
    # a Bridge ConfigContainer's model names the expert count as TransformerConfig does
    p = plan(model={**LLAMA_ARGS, "num_moe_experts": 16, "add_bias_linear": False})
    assert [p.decisions[d].value for d in MOE] == [True, True, True]


def test_a_checkpoint_no_launch_recorded_is_told_from_no_checkpoint(tmp_path):
    from megatron_perf_toggles.runtime import resume

    args = {**MOE_ARGS, "load": str(tmp_path), "ckpt_format": "torch"}
    assert resume.checkpoint_writer(args) is None  # an empty --load: a fresh run
    assert plan(args, checkpoint=resume.checkpoint_writer(args)).decisions["moe_grouped_gemm"].value is True
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("40")  # saved by stock Megatron: no history
    writer = resume.checkpoint_writer(args)
    assert writer is not None and writer["iteration"] == 40 and writer["decisions"] == {}
    assert got(plan(args, checkpoint=writer), "moe_grouped_gemm") == (False, "guard")


def test_doctor_says_from_which_te_megatron_uses_the_router_kernels(monkeypatch, capsys):
    from megatron_perf_toggles.tools import cli

    monkeypatch.setattr(cli.doctor, "_machine_diagnosed", lambda: full_caps(te_version="2.5", te_fused_router=True))
    assert cli.main(["doctor"]) == 0
    assert "router yes (used from TE 2.7)" in capsys.readouterr().out


def test_a_pretrained_fallback_loads_weights_alone(tmp_path):
    # --load without a checkpoint: Megatron finetunes from --pretrained-checkpoint (no optimizer state),
    # so neither the gradient buffer nor the optimizer layout binds the resume there
    from megatron_perf_toggles.runtime import resume

    pre = tmp_path / "pre"
    (pre / "iter_0000100").mkdir(parents=True)
    (pre / "iter_0000100" / "metadata.json").write_text("{}")
    (pre / "latest_checkpointed_iteration.txt").write_text("100")
    (pre / resume.HISTORY_NAME).write_text(
        '{"start_iteration": 0, "decisions": {"grad_reduce_in_bf16": false, "moe_grouped_gemm": false},'
        ' "grad_buffer_dtype": "fp32", "optimizer_layout": ["grad-dtype-keyed", "dp_reshardable"]}\n')
    args = {**MOE_ARGS, "load": str(tmp_path / "empty"), "pretrained_checkpoint": str(pre),
            "use_distributed_optimizer": True, "dist_ckpt_optim_fully_reshardable": False}
    writer = resume.checkpoint_writer(args)
    assert writer["load_dir"] == str(pre) and writer["weights_only"] is True
    p = plan(args, checkpoint=writer, explicit={"grad_reduce_in_bf16": True})  # stock takes this: no refusal
    assert got(p, "grad_reduce_in_bf16") == (True, "cli")
    assert got(p, "moe_grouped_gemm") == (True, "default")  # weights move by name in torch_dist


def test_a_real_iteration_zero_is_not_a_release(tmp_path):
    from megatron_perf_toggles.runtime import resume

    (tmp_path / "iter_0000000").mkdir()
    (tmp_path / "iter_0000000" / "metadata.json").write_text("{}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0")
    writer = resume.checkpoint_writer({"load": str(tmp_path)})
    assert writer["iteration"] == 0 and writer["format_on_disk"] == "torch_dist" and not writer["weights_only"]
