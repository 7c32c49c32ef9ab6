"""Mixture-of-experts layers in the memory model (core/memory/memory_moe.py through core/memory/model.py) and the
memory guard on MoE jobs. Every expected number is worked out here from Megatron's shapes (experts.py,
router.py, moe_utils.py, token_dispatcher.py), not taken from the model's output."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from conftest import full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.decision.plan import Decision
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.memory import allocator, memory_guard, memory_moe
from megatron_perf_toggles.core.memory import model as memory
from megatron_perf_toggles.core.registry import BY_DEST, TOGGLES

MB = 2**20
H, HEADS, FFN, MOE_FFN, E, K, SEQ, MBS, VOCAB, LAYERS = 1024, 8, 4096, 2048, 8, 2, 1024, 2, 32000, 4
# An MoE GPT job as Megatron's parsed namespace has it: every layer an MoE layer (--moe-layer-freq 1).
MOE = {"hidden_size": H, "ffn_hidden_size": FFN, "num_layers": LAYERS, "num_attention_heads": HEADS,
       "seq_length": SEQ, "micro_batch_size": MBS, "vocab_size": VOCAB, "untie_embeddings_and_output_weights": True,
       "swiglu": True, "bf16": True, "use_distributed_optimizer": True, "world_size": 1,
       "transformer_impl": "transformer_engine", "num_experts": E, "moe_router_topk": K,
       "moe_ffn_hidden_size": MOE_FFN, "moe_token_dispatcher_type": "alltoall", "add_bias_linear": False}
TOKENS = SEQ * MBS
ATTENTION = 3 * H * H + H * H  # qkv (no GQA) and the projection
EXPERT = 2 * MOE_FFN * H + H * MOE_FFN  # one expert: SwiGLU fc1 (2 x moe_ffn wide) and fc2
OFF = dict.fromkeys(memory_moe.MOE_DESTS, False)


def layout(**extra):
    return memory.layout_from_args({**MOE, **extra})


# --- weights and optimizer state --------------------------------------------------------------------


@pytest.mark.parametrize(("ep", "etp", "local", "split"), [(1, 1, 8, 1), (2, 1, 4, 1), (4, 2, 2, 2), (8, 1, 1, 1)])
def test_expert_parameters_follow_ep_and_etp(ep, etp, local, split):
    lay = layout(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, world_size=8)
    dense, experts = lay.moe_layer_params()
    assert experts == local * EXPERT // split
    assert dense == ATTENTION + 2 * H + E * H  # attention, two norms, the router's E x h weight


def test_stage_parameters_count_the_experts_once_per_moe_layer():
    lay = layout()
    dense, experts = lay.stage_param_split("last")
    assert experts == LAYERS * E * EXPERT
    # dense: each layer's attention, norms and router, the final norm, the embedding and the output layer
    assert dense == LAYERS * (ATTENTION + 2 * H + E * H) + H + 2 * VOCAB * H
    assert lay.last_stage_params() == dense + experts


def test_distributed_optimizer_shards_expert_state_over_the_expert_data_parallel_group():
    # world 16, EP 4, ETP 1, PP 1: DP 16, expert DP 16 / 4 = 4
    lay = layout(world_size=16, expert_model_parallel_size=4)
    assert lay.moe.edp == 4
    dense, experts = lay.stage_param_split("last")
    expected = (dense * (6 + 12 / 16) + experts * (6 + 12 / 4)) / MB
    est = memory.stock_peak(lay, False, True)
    assert est.parts["weights_and_optimizer"] == pytest.approx(expected, abs=0.1)
    # without the distributed optimizer every parameter costs 18 B
    plain = layout(world_size=16, expert_model_parallel_size=4, use_distributed_optimizer=False)
    assert memory.stock_peak(plain, False, True).parts["weights_and_optimizer"] == pytest.approx(
        sum(plain.stage_param_split("last")) * 18 / MB, abs=0.1)


def test_expert_data_parallel_counts_etp_and_pipeline_stages():
    lay = layout(world_size=32, tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=4,
                 pipeline_model_parallel_size=2)
    assert (lay.moe.etp, lay.moe.edp) == (2, 32 // (4 * 2 * 2))  # ETP defaults to TP


def test_shared_experts_are_split_over_tp_and_count_as_dense():
    lay = layout(moe_shared_expert_intermediate_size=1024, tensor_model_parallel_size=2, sequence_parallel=True,
                 world_size=2)
    dense, _ = lay.moe_layer_params()
    attention_tp = (3 * H * H + H * H) // 2
    assert dense == attention_tp + 2 * H + E * H + (2 * 1024 * H + H * 1024) // 2


# --- the layer pattern --------------------------------------------------------------------------------


def test_moe_layer_frequency_and_patterns():
    assert memory_moe.layer_pattern(2, 4) == (True, False, True, False)
    assert memory_moe.layer_pattern("([0]+[1]*3)", 4) == (False, True, True, True)  # the first layer dense
    assert memory_moe.layer_pattern([1, 1, 0, 0], 4) == (True, True, False, False)
    first_dense = layout(moe_layer_freq="([0]+[1]*3)")
    dense, experts = first_dense.stage_param_split("last")
    assert experts == 3 * E * EXPERT
    dense_layer = ATTENTION + 2 * H + 2 * FFN * H + H * FFN
    assert dense == dense_layer + 3 * (ATTENTION + 2 * H + E * H) + H + 2 * VOCAB * H
    for bad in ("__import__('os')", "[1]*3", "[2]*4"):
        with pytest.raises(memory.Unknown):
            layout(moe_layer_freq=bad)


def test_pipeline_stages_hold_their_own_moe_layers():
    lay = layout(moe_layer_freq=[0, 0, 1, 1], pipeline_model_parallel_size=2, world_size=2)
    assert (lay.moe_layers("first"), lay.moe_layers("last")) == (0, 2)
    assert lay.stage_param_split("first")[1] == 0


def test_a_dense_model_is_unchanged():
    dense = {k: v for k, v in MOE.items() if not k.startswith(("num_experts", "moe_"))}
    for extra in ({}, {"num_experts": 0}, {"num_experts": None}):
        lay = memory.layout_from_args({**dense, **extra})
        assert lay.moe is None and lay.moe_layers() == 0
        assert lay.last_stage_params() == LAYERS * (ATTENTION + 2 * H + 3 * FFN * H) + H + 2 * VOCAB * H
        for dest in memory_moe.MOE_DESTS:
            assert memory.toggle_delta_mb(dest, {dest: True}, {dest: False}, lay, True) == 0.0


# --- activations ---------------------------------------------------------------------------------------


def test_an_moe_layers_saved_activations_from_first_principles():
    lay = layout(moe_aux_loss_coeff=0.01)
    routed = TOKENS * K  # alltoall, EP 1: every token's top-k copies stay on the rank
    # fc1 input, fc1 output, activation, the probabilities in the router's dtype (bf16: the input's)
    experts = routed * (2 * H + 2 * 2 * MOE_FFN + 2 * MOE_FFN + 2)
    # top-k's int64 indices (the scatter's index is the same tensor), the fp32 softmax; aux-loss scores
    router = TOKENS * K * (8 + 4) + TOKENS * E * 4
    permute = 2 * TOKENS * K * 8  # index_select's and the probabilities' int64 indices
    attention = TOKENS * H * 18  # the dense layer's formula without its MLP (no TP)
    est = memory.stock_peak(lay, False, True)
    assert est.parts["activations"] == pytest.approx(LAYERS * (attention + experts + router + permute) / MB, abs=0.1)


def test_capacity_factor_and_padding_cap_the_routed_tokens():
    moe = layout(moe_expert_capacity_factor=0.5).moe
    capped = -(-TOKENS * K * 0.5 // E) * E
    assert memory_moe.routed_tokens(moe, TOKENS, 1, False) == capped
    padded = replace(moe, capacity_factor=2.0, pad_to_capacity=True)
    assert memory_moe.routed_tokens(padded, TOKENS, 1, False) == 2 * TOKENS * K
    assert memory_moe.routed_tokens(replace(moe, capacity_factor=2.0), TOKENS, 1, False) == TOKENS * K


def test_sequence_parallel_and_etp_in_the_dispatchers():
    lay = layout(tensor_model_parallel_size=4, sequence_parallel=True, world_size=4, expert_tensor_parallel_size=2)
    # alltoall: each rank's TOKENS / 4, top-k copies, gathered over ETP 2
    assert memory_moe.routed_tokens(lay.moe, TOKENS, 4, True) == TOKENS / 4 * K * 2
    gather = replace(lay.moe, dispatcher="allgather", etp=4)
    assert memory_moe.routed_tokens(gather, TOKENS, 4, True) == TOKENS * K
    # the allgather dispatcher gathers over ETP x EP (4 x 2 here) into Megatron's global buffer: TOKENS / TP x ETP x EP rows
    buffers = memory_moe.persistent_mb(replace(gather, ep=2), H, TOKENS, 4, True, OFF)
    assert buffers["allgather_buffer"] == pytest.approx(2 * TOKENS * 2 * H / MB)


def test_selective_and_full_recompute():
    full = layout(recompute_granularity="full", recompute_method="uniform")
    assert memory.stock_peak(full, False, True).parts["activations"] == pytest.approx(LAYERS * 2 * TOKENS * H / MB)
    moe_part = layout(recompute_granularity="selective", recompute_modules=["moe"])
    # the MoE part's input is the pre-MLP norm's output, which the attention part's 18 x t x h holds
    # already: each layer keeps the attention part only
    assert memory_moe.moe_layer_bytes(moe_part.moe, H, TOKENS, 1, False, True, OFF) == 0
    assert memory.stock_peak(moe_part, False, True).parts["activations"] == pytest.approx(
        LAYERS * 18 * TOKENS * H / MB)
    act = layout(recompute_granularity="selective", recompute_modules=["moe_act"])
    kept = memory_moe.expert_activation_bytes(layout().moe, H, TOKENS * K, True)
    assert kept - memory_moe.expert_activation_bytes(act.moe, H, TOKENS * K, True) == TOKENS * K * 2 * MOE_FFN


# --- the toggles' terms ---------------------------------------------------------------------------------


def delta(dest, lay, now=True, before=False, **kw):
    return memory.toggle_delta_mb(dest, {**OFF, dest: now}, {**OFF, dest: before}, lay, kw.pop("te", True), **kw)


def test_grouped_gemm_keeps_te_s_cublas_workspaces():
    lay = layout()
    assert delta("moe_grouped_gemm", lay) == 4 * 32  # four streams, 32 MiB each (compute capability 9 and up)
    assert delta("moe_grouped_gemm", lay, now=False, before=True) == -4 * 32
    assert delta("moe_grouped_gemm", layout(moe_use_legacy_grouped_gemm=True)) == 0.0
    assert delta("moe_grouped_gemm", lay, te=False) is None


@pytest.mark.parametrize(("shape", "measured"), [
    # Megatron main, TE 2.20.2, one H200, alltoall, EP 1 (docs/benchmarks/moe_memory_validation.md):
    # shape A (hidden 2048, expert FFN 4096, seq 4096, mbs 1) +119 MB, the loss shape +135 MB
    ({"hidden_size": 2048, "num_attention_heads": 16, "moe_ffn_hidden_size": 4096, "seq_length": 4096,
      "micro_batch_size": 1}, 119),
    ({"hidden_size": 512, "num_attention_heads": 8, "moe_ffn_hidden_size": 1024, "seq_length": 1024,
      "micro_batch_size": 8}, 135)])
def test_grouped_gemm_is_near_the_h200_measurement(shape, measured):
    assert abs(delta("moe_grouped_gemm", layout(**shape)) - measured) <= 20


@pytest.mark.parametrize("experts,topk", [(8, 2), (64, 8), (128, 8)])
def test_permute_and_router_fusion_per_moe_layer(experts, topk):
    lay = layout(num_experts=experts, moe_router_topk=topk)
    # fused: the row-id map, and the chunk sort's int32 map of the routed tokens, dispatch and combine
    permute = LAYERS * TOKENS * ((2 * experts + 1) * 4 + 2 * topk * 4 - 2 * topk * 8) / MB
    router = LAYERS * TOKENS * (experts * (4 + 1) - topk * (8 + 4)) / MB
    assert delta("moe_permute_fusion", lay) == pytest.approx(permute)
    assert delta("moe_router_fusion", lay) == pytest.approx(router)
    # the first pipeline stage holds PP micro-batches of its MoE layers
    pp = layout(num_experts=experts, moe_router_topk=topk, pipeline_model_parallel_size=2, world_size=2)
    assert delta("moe_router_fusion", pp, stage="first") == pytest.approx(2 * (LAYERS // 2) * router / LAYERS)
    # recomputed MoE layers keep neither
    recomputed = layout(num_experts=experts, recompute_granularity="selective", recompute_modules=["moe"])
    assert delta("moe_router_fusion", recomputed) == 0.0


def test_largest_allocation_sees_the_experts():
    # a job whose experts' fc1 output outgrows the logits: expert FFN 16384, a small vocabulary
    lay = layout(moe_ffn_hidden_size=16384, vocab_size=1024)
    grouped = allocator.largest_allocation(lay, {**OFF, "moe_grouped_gemm": True})
    sequential = allocator.largest_allocation(lay, OFF)
    assert grouped.mb == pytest.approx(2 * TOKENS * K * 2 * 16384 / MB, abs=0.1)  # every local expert at once
    assert "grouped GEMM" in grouped.what
    assert sequential.mb == pytest.approx(max(2 * TOKENS * K * 2 * 16384 / E, 2 * TOKENS * K * H) / MB, abs=0.1)


# --- the guard on MoE jobs ---------------------------------------------------------------------------------


def caps(gpu_mb):
    return full_caps(apex_fused_wgrad=False, wgrad_fallback=True, gpu_memory_mb=gpu_mb, gpu_name="GPU")


def test_explain_has_an_estimate_for_an_moe_job():
    plan = decide(MOE, {}, read_env({}), caps(143156.0))
    assert plan.memory["stock_peak_mb"] > 0 and plan.memory["note"] is None
    assert plan.memory["verdict"] == {"stock": "fits", "plan": "fits"}


def test_guard_backs_off_a_priced_default_on_an_moe_job():
    # Megatron 0.20 rejects the te cross entropy: the native fusion adds a fp32 copy of the logits
    env = {"CROSS_ENTROPY_FUSION_IMPL": "native"}
    big = {**MOE, "vocab_size": 256000, "micro_batch_size": 8}
    roomy = decide(big, {}, read_env(env), caps(10**7))
    stock_need = roomy.memory["stock_peak_mb"] + roomy.memory["stock_largest_allocation_mb"]
    assert roomy.memory["peak_memory_delta_mb"]["cross_entropy_loss_fusion"] > 0
    gpu = (stock_need + 1) / 0.9  # stock fits, stock plus the fusion's logits copy does not
    tight = decide(big, {}, read_env(env), caps(gpu))
    ce = tight.decisions["cross_entropy_loss_fusion"]
    assert (ce.value, ce.source) == (False, "guard") and "backed off" in ce.reason
    assert tight.memory["verdict"]["plan"] == "fits"


def test_guard_backs_off_grouped_gemm_where_its_workspaces_tip_the_job(monkeypatch):
    if "moe_grouped_gemm" not in BY_DEST:  # until the registry has the MoE toggles: one stands in
        stand_in = SimpleNamespace(dest="moe_grouped_gemm", stock_default=False)
        monkeypatch.setattr(memory_guard, "TOGGLES", (*TOGGLES, stand_in))
    every_off = {t.env: "0" for t in TOGGLES if t.dest != "moe_grouped_gemm" and t.kind == "bool"}
    env = read_env(every_off)
    base = decide(MOE, {}, env, caps(10**7))
    decisions = {**base.decisions, "moe_grouped_gemm": Decision(True, "default", "plugin default")}
    memory_plan, _ = memory_guard.guard_memory(MOE, dict(decisions), caps(10**7), env, {})
    assert memory_plan.deltas["moe_grouped_gemm"] == 128.0
    stock = memory_plan.stock
    stock_need = stock.peak_mb + memory_plan.stock_largest.mb
    gpu = (stock_need + 64) / 0.9  # room for stock, not for 128 MB more
    tight = dict(decisions)
    memory_plan, _ = memory_guard.guard_memory(MOE, tight, caps(gpu), env, {})
    assert (tight["moe_grouped_gemm"].value, tight["moe_grouped_gemm"].source) == (False, "guard")
    assert memory_plan.verdicts == {"stock": "fits", "plan": "fits"}
    roomy = dict(decisions)
    memory_guard.guard_memory(MOE, roomy, caps(gpu + 1024), env, {})
    assert roomy["moe_grouped_gemm"].source == "default"


def test_a_grouped_gemm_asked_for_on_the_command_line_is_in_the_planned_peak():
    # before the registry has the toggle, stock and the plan both run what the command line gave;
    # after, the request is the plan's decision, priced against Megatron's default: the same peak
    plain = decide(MOE, {}, read_env({"MOE_GROUPED_GEMM": "0"}), caps(143156.0)).memory
    asked = decide({**MOE, "moe_grouped_gemm": True}, {"moe_grouped_gemm": True}, read_env({}), caps(143156.0)).memory
    assert asked["planned_peak_mb"] == pytest.approx(plain["planned_peak_mb"] + 128, abs=0.2)


def test_the_optimizer_steps_fp32_gradient_copies_can_set_the_peak():
    # few tokens, many parameters: with bf16 gradients (-2 B each) the step's fp32 copies (+4 B each,
    # DP 1) outgrow what the backward held on top of the parameters
    only_bf16_grads = {t.env: "0" for t in TOGGLES if t.kind == "bool" and t.dest != "grad_reduce_in_bf16"}
    plan = decide(MOE, {}, read_env(only_bf16_grads), caps(143156.0))
    assert plan.decisions["grad_reduce_in_bf16"].value is True
    params = LAYERS * (ATTENTION + 2 * H + E * H + E * EXPERT) + H + 2 * VOCAB * H
    assert plan.memory["planned_peak_mb"] == pytest.approx((18 - 2 + 4) * params / MB, abs=0.5)
    # the per-decision figure is its share of the peak's change: here all of it, and it moved the peak
    memory = plan.memory
    assert memory["planned_peak_at"] == "at the optimizer step" != memory["stock_peak_at"]
    assert memory["peak_memory_delta_mb"]["grad_reduce_in_bf16"] == pytest.approx(
        memory["planned_peak_mb"] - memory["stock_peak_mb"], abs=0.1)
    assert memory["peak_memory_notes"]["grad_reduce_in_bf16"] == "moves the peak to the optimizer step"
    # sharded over 4 data-parallel ranks, the copies are a quarter: the backward peaks again
    sharded = decide({**MOE, "world_size": 4}, {}, read_env(only_bf16_grads), caps(143156.0)).memory
    assert sharded["planned_peak_mb"] == pytest.approx(sharded["stock_peak_mb"] - 2 * params / MB, abs=0.5)


def test_fp8_copies_every_linear_weight_of_an_moe_layer_but_the_router():
    lay = layout(fp8_format="hybrid", moe_shared_expert_intermediate_size=512)
    shared = 2 * 512 * H + H * 512
    expected = LAYERS * (ATTENTION + shared + E * EXPERT) / MB  # 1 B each
    assert memory.stock_peak(lay, False, True).parts["fp8_weights"] == pytest.approx(expected, abs=0.1)


def test_shared_experts_keep_fc1s_output_and_the_activation():
    plain, shared = layout(), layout(moe_shared_expert_intermediate_size=512)
    extra = LAYERS * TOKENS * (2 * 512 + 512) * 2 / MB  # SwiGLU fc1 output (2 x 512 wide) and the activation, bf16
    assert memory.stock_peak(shared, False, True).parts["activations"] - memory.stock_peak(
        plain, False, True).parts["activations"] == pytest.approx(extra, abs=0.1)
    gelu = layout(moe_shared_expert_intermediate_size=512, swiglu=False)
    assert memory_moe.shared_activation_bytes(gelu.moe, TOKENS, 1, False, False) == TOKENS * 2 * 512 * 2


def test_a_configuration_objects_num_moe_experts_is_an_moe_model():
    bridge_named = {k: v for k, v in MOE.items() if k != "num_experts"} | {"num_moe_experts": E}
    assert memory.layout_from_args(bridge_named).moe == layout().moe
    with pytest.raises(memory.Unknown, match="num-experts"):
        layout(num_experts="eight")


def test_any_moe_layout_gets_an_estimate_or_a_reason_never_an_error():
    import random

    rng = random.Random(36)
    for _ in range(300):
        tp, pp, ep = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
        args = {**MOE, "tensor_model_parallel_size": tp, "sequence_parallel": tp > 1, "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep, "world_size": rng.choice([8, 16, 64]),
                "expert_tensor_parallel_size": rng.choice([None, 1, tp]),
                "num_experts": rng.choice([0, 4, 8, 64, 6]), "moe_router_topk": rng.choice([1, 2, 8]),
                "moe_token_dispatcher_type": rng.choice(["allgather", "alltoall", "flex", "alltoall_seq"]),
                "moe_layer_freq": rng.choice([1, 2, 3, "([0]+[1]*3)", [1, 0, 1, 0], "[1]*5"]),
                "moe_expert_capacity_factor": rng.choice([None, 0.5, 1.25]),
                "moe_pad_expert_input_to_capacity": rng.random() < 0.3,
                "moe_shared_expert_intermediate_size": rng.choice([None, 512]),
                "recompute_granularity": rng.choice([None, "selective", "full"]),
                "recompute_modules": rng.choice([None, ["moe"], ["moe_act"], ["core_attn"]]),
                "moe_aux_loss_coeff": rng.choice([0.0, 1e-2, [1e-2, 0.0]]),
                "moe_router_load_balancing_type": rng.choice(["aux_loss", ["aux_loss", "seq_aux_loss"], "none"]),
                "fp8_format": rng.choice([None, "hybrid"]), "use_distributed_optimizer": rng.random() < 0.7}
        values = {d: rng.random() < 0.5 for d in memory_moe.MOE_DESTS}
        plan = decide({**args, **values}, {}, read_env({}), caps(rng.choice([81920.0, 143156.0])))
        mem = plan.memory
        assert (mem["stock_peak_mb"] is None) == bool(mem["note"] and mem["note"].startswith("no memory estimate")), mem
        if mem["stock_peak_mb"] is not None:
            assert mem["stock_peak_mb"] > 0 and mem["planned_peak_mb"] > 0


def test_fewer_query_groups_than_tp_ranks_still_split_the_qkv_weight_evenly():
    """Core 0.16 on, TP 4 over 2 query groups: the QKV projection stays one column-parallel weight
    split evenly over the ranks (each rank picks its group from the gathered activations), so its
    rows per rank are the whole projection's over TP."""
    from megatron_perf_toggles.core.memory.memory_layout import layout_from_args

    args = {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16, "group_query_attention": True,
            "num_query_groups": 2, "ffn_hidden_size": 4096, "seq_length": 512, "micro_batch_size": 1,
            "padded_vocab_size": 32000}
    kv_channels = 1024 // 16
    whole = 16 * kv_channels + 2 * 2 * kv_channels
    for tp in (1, 2, 4, 8):
        assert layout_from_args({**args, "tensor_model_parallel_size": tp}).linear_shapes()["qkv"][0] == whole // tp
