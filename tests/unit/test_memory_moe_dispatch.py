"""The allgather dispatcher and the routing probabilities' dtype in the MoE memory model
(core/memory/memory_moe.py). Every expected number is worked out here from Megatron's shapes
(token_dispatcher.py ``MoEAllGatherTokenDispatcher``, moe_utils.py ``permute``, router.py), not taken
from the model's output."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.core.memory import memory_moe
from megatron_perf_toggles.core.memory import model as memory

MB = 2**20
H, MOE_FFN, E, K, SEQ, MBS, LAYERS = 1024, 2048, 8, 2, 1024, 2, 4
MOE = {"hidden_size": H, "ffn_hidden_size": 4096, "num_layers": LAYERS, "num_attention_heads": 8,
       "seq_length": SEQ, "micro_batch_size": MBS, "vocab_size": 32000, "untie_embeddings_and_output_weights": True,
       "swiglu": True, "bf16": True, "use_distributed_optimizer": True, "world_size": 1,
       "transformer_impl": "transformer_engine", "num_experts": E, "moe_router_topk": K,
       "moe_ffn_hidden_size": MOE_FFN, "add_bias_linear": False}
TOKENS = SEQ * MBS
OFF = dict.fromkeys(memory_moe.MOE_DESTS, False)

# TP 4 with sequence parallelism, EP 2, ETP 1, on 8 GPUs: the attention's TP splits the sequence,
# the allgather dispatcher gathers over ETP x EP = 2 ranks, not over TP x EP = 8
TP, EP, ETP = 4, 2, 1
SHARD = TOKENS // TP  # the MoE layer's input: the attention's sequence-parallel shard
GATHERED = SHARD * ETP * EP  # rows of tokens, routing map and probabilities after the all-gather
LOCAL = E // EP  # the rank's experts
ROUTED = GATHERED * K // EP  # in balance, the gathered top-k copies that go to the rank's experts


def allgather_layout(**extra):
    return memory.layout_from_args({**MOE, "moe_token_dispatcher_type": "allgather", "tensor_model_parallel_size": TP,
                                    "sequence_parallel": True, "expert_model_parallel_size": EP,
                                    "expert_tensor_parallel_size": ETP, "world_size": 8, **extra})


def test_allgather_gathers_over_etp_times_ep_not_tp():
    lay = allgather_layout()
    assert (lay.moe.etp, lay.moe.ep, lay.tp) == (ETP, EP, TP)
    assert memory_moe.routed_tokens(lay.moe, TOKENS, TP, True) == ROUTED
    # the gathered tokens stay in Megatron's global memory buffer: GATHERED x h in bf16
    assert memory.stock_peak(lay, False, True).parts["moe_buffers"] == pytest.approx(GATHERED * H * 2 / MB)


def test_allgather_moe_layer_from_first_principles():
    lay = allgather_layout()
    experts = ROUTED * (2 * H + 2 * 2 * MOE_FFN + 2 * MOE_FFN + 2)  # ETP 1: nothing split
    router = SHARD * K * (8 + 4)  # the router sees the rank's own shard
    # masked_select of the local probabilities keeps its bf16 input and its bool mask, GATHERED x LOCAL
    local_probs = GATHERED * LOCAL * (2 + 1)
    unfused = ROUTED * 8  # index_select's int64 index of the routed rows
    fused = GATHERED * (2 * LOCAL + 1) * 4  # TE's int32 row-id map over the gathered rows, local experts
    kept = memory_moe.moe_layer_bytes(lay.moe, H, TOKENS, TP, True, True, OFF)
    assert kept == pytest.approx(experts + router + local_probs + unfused)
    on = {**OFF, "moe_permute_fusion": True}
    assert memory_moe.moe_layer_bytes(lay.moe, H, TOKENS, TP, True, True, on) == pytest.approx(
        experts + router + local_probs + fused)
    change = memory.toggle_delta_mb("moe_permute_fusion", on, OFF, lay, True)
    assert change == pytest.approx(LAYERS * (fused - unfused) / MB)


def test_allgather_without_etp_or_ep_gathers_nothing():
    lay = memory.layout_from_args({**MOE, "moe_token_dispatcher_type": "allgather"})
    assert "moe_buffers" not in memory.stock_peak(lay, False, True).parts
    rows, routed = TOKENS, TOKENS * K
    fused = rows * (2 * E + 1) * 4 + rows * E * 3
    unfused = routed * 8 + rows * E * 3
    assert memory_moe.permute_bytes(lay.moe, TOKENS, True, routed) == fused
    assert memory_moe.permute_bytes(lay.moe, TOKENS, False, routed) == unfused


@pytest.mark.parametrize(("dtype", "size"), [(None, 2), ("fp32", 4), ("fp64", 8)])
def test_permuted_probabilities_are_in_the_router_dtype(dtype, size):
    lay = memory.layout_from_args({**MOE, "moe_router_dtype": dtype})
    routed = TOKENS * K
    fc1_in, fc1_out, act = 2 * H, 2 * 2 * MOE_FFN, 2 * MOE_FFN
    assert memory_moe.expert_activation_bytes(lay.moe, H, routed, True) == routed * (fc1_in + fc1_out + act + size)
