"""One memory story: each row of the memory column is its toggle's share of the change in the peak
the plan reports, the shares add up to the planned peak less stock's, and a row whose toggle moves
the peak (to the optimizer step, to another pipeline stage) says so (core/memory/peaks.py)."""

from __future__ import annotations

import json

import pytest
from conftest import explain_in_process, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.memory import peaks
from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.errors import EXIT_DOES_NOT_FIT
from megatron_perf_toggles.tools.llama3_8b import LLAMA3_8B_EXAMPLE

pytestmark = pytest.mark.usefixtures("clean_environment")

# GPT-3 175B on one node of eight H100s: TP 8, no pipeline, no distributed optimizer.
GPT_175B = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--tensor-model-parallel-size", "8", "--micro-batch-size", "1",
            "--global-batch-size", "1536", "--bf16", "--vocab-size", "50257"]
H100 = full_caps(apex_fused_wgrad=False, wgrad_fallback=True, gpu_memory_mb=81920.0, gpu_name="NVIDIA H100")


def adds_up(memory: dict) -> None:
    """The shares (the known ones) add up to the planned peak less stock's, and to the total."""
    change = memory["planned_peak_mb"] - memory["stock_peak_mb"]
    shares = sum(mb for mb in memory["peak_memory_delta_mb"].values() if mb is not None)
    assert shares == pytest.approx(change, rel=0.01, abs=0.1 * len(TOGGLES)), memory
    assert memory["total_peak_memory_delta_mb"] == pytest.approx(change, abs=0.1)


def test_the_175b_example_adds_up_and_says_that_the_peak_moved(capsys):
    code, out, err = explain_in_process(capsys, "--json", "--world-size", "8", "--gpu", "h100", "--", *GPT_175B)
    assert code == 0, err
    memory = json.loads(out)["memory"]
    adds_up(memory)
    change = memory["planned_peak_mb"] - memory["stock_peak_mb"]
    assert change > 0  # the step's fp32 gradient copies outgrow the backward: the plan peaks higher
    # bf16 gradient reduction halves the buffer (a saving in the backward) but, without the
    # distributed optimizer, copies every gradient to fp32 in the step: it moves the peak there.
    assert memory["peak_memory_delta_mb"]["grad_reduce_in_bf16"] > 0
    assert memory["peak_memory_notes"]["grad_reduce_in_bf16"] == "moves the peak to the optimizer step"
    assert (memory["stock_peak_at"], memory["planned_peak_at"]) == ("in forward and backward", "at the optimizer step")
    # the cross-entropy fusion's +50 MB is in the backward, below the step's peak: no share
    assert memory["peak_memory_delta_mb"]["cross_entropy_loss_fusion"] == 0
    assert memory["peak_memory_notes"]["cross_entropy_loss_fusion"] == "its +50 MB is in forward and backward"


def test_the_175b_table_says_one_thing(capsys):
    code, out, _ = explain_in_process(capsys, "--world-size", "8", "--gpu", "h100", "--", *GPT_175B)
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("grad_reduce_in_bf16"))
    assert "+11.2 GB peak per GPU (moves the peak to the optimizer step)" in row
    line = next(line for line in out.splitlines() if line.startswith("memory:"))
    assert "this plan +11.8 GB" in line and "planned peak 407.1 GB at the optimizer step" in line
    assert "stock's estimated peak 395.3 GB per GPU in forward and backward" in line
    assert "last stage" not in line and "in all" not in line


def test_pipeline_stages_name_their_figures(capsys):
    """Llama-3-8B on two nodes, PP 2 (the issue's job): the first stage peaks (PP micro-batches in
    flight), so the cross entropy's logits on the last stage change nothing there, and the largest
    allocation is the first stage's, named so."""
    argv = [w if w != "1" or LLAMA3_8B_EXAMPLE[i - 1] != "--pipeline-model-parallel-size" else "2"
            for i, w in enumerate(LLAMA3_8B_EXAMPLE)]
    code, out, err = explain_in_process(capsys, "--json", "--nnodes", "2", "--nproc-per-node", "8", "--gpu", "h100", "--", *argv)
    assert code == 0, err
    memory = json.loads(out)["memory"]
    adds_up(memory)
    assert memory["pipeline_stages"] == 2 and memory["planned_peak_at"].startswith("on the first pipeline stage")
    assert memory["peak_memory_delta_mb"]["cross_entropy_loss_fusion"] == 0
    assert memory["peak_memory_notes"]["cross_entropy_loss_fusion"] == "its +2.0 GB is on the last stage"
    assert memory["largest_allocation_stage"] == "first" and "logits" not in memory["largest_allocation"]


LAYOUTS = {  # (PP, distributed optimizer, micro-batch, layers): the peak lands in each of its places
    "pp1": (1, True, 1, 32), "pp1-no-dist-opt": (1, False, 1, 8), "pp2": (2, True, 1, 32),
    "pp4-no-dist-opt": (4, False, 4, 32), "pp2-long": (2, False, 8, 16),
}


@pytest.mark.parametrize("impl", ["native", "te"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_the_shares_add_up_on_every_layout(name, impl):
    pp, dist_opt, mbs, layers = LAYOUTS[name]
    args = {"num_layers": layers, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
            "group_query_attention": True, "num_query_groups": 8, "seq_length": 4096, "micro_batch_size": mbs,
            "vocab_size": 128256, "bf16": True, "swiglu": True, "untie_embeddings_and_output_weights": True,
            "position_embedding_type": "rope", "pipeline_model_parallel_size": pp, "world_size": 8 * pp,
            "use_distributed_optimizer": dist_opt, "transformer_impl": "transformer_engine"}
    for env in ({}, {"CROSS_ENTROPY_FUSION_IMPL": impl}, {"GRAD_REDUCE_IN_BF16": "0"}):
        adds_up(decide(args, {}, read_env(env), H100).memory)


def test_shares_follow_the_table_with_an_implementation_before_its_fusion():
    order = peaks.share_order()
    assert sorted(order) == sorted(t.dest for t in TOGGLES)
    assert order.index("cross_entropy_fusion_impl") == order.index("cross_entropy_loss_fusion") - 1
    rest = [d for d in order if d != "cross_entropy_fusion_impl"]
    assert rest == [t.dest for t in TOGGLES if t.dest != "cross_entropy_fusion_impl"]


@pytest.mark.parametrize("layers", [13, 14])
def test_the_guard_backs_off_what_moves_the_peak_past_the_card(layers):
    """Stock fits; with the defaults the optimizer step's fp32 gradient copies (bf16 gradient
    reduction without the distributed optimizer) take the job past the card. That default's term
    is a saving, but its share is what tips the job: it is backed off and the plan fits."""
    args = {"num_layers": layers, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
            "group_query_attention": True, "num_query_groups": 8, "seq_length": 1024, "micro_batch_size": 1,
            "vocab_size": 128256, "bf16": True, "swiglu": True, "untie_embeddings_and_output_weights": True,
            "position_embedding_type": "rope", "world_size": 1, "transformer_impl": "transformer_engine"}
    plan = decide(args, {}, read_env({}), H100)
    assert plan.memory["verdict"] == {"stock": "fits", "plan": "fits"}
    bf16 = plan.decisions["grad_reduce_in_bf16"]
    assert (bf16.value, bf16.source) == (False, "guard")
    assert "backed off to stock's off to fit" in bf16.reason
    adds_up(plan.memory)


def test_fail_if_no_fit_exits_3_after_the_plan(capsys, monkeypatch):
    argv = ["--world-size", "8", "--gpu", "h100", "--", *GPT_175B]
    code, out, err = explain_in_process(capsys, "--json", *argv)
    assert code == 0 and json.loads(out)["memory"]["verdict"]["plan"] == "does_not_fit"  # explain's default
    code, out, err = explain_in_process(capsys, "--json", "--fail-if-no-fit", *argv)
    assert code == EXIT_DOES_NOT_FIT == 3 and json.loads(out)["memory"]["planned_peak_mb"] > 0  # the plan, whole
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[perf-toggles] error: the plan does not fit: planned peak 407.1 GB")
    code, out, _ = explain_in_process(capsys, "--fail-if-no-fit", *argv)
    assert code == 3 and out.startswith("Megatron:")
    assert explain_in_process(capsys, "--fail-if-no-fit")[0] == 0  # the built-in example fits its eight H100s
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT", "1")
    assert explain_in_process(capsys, "--json", *argv)[0] == 3


def test_a_peak_moved_to_a_stages_step_reads_as_one_phrase():
    spot = peaks.Spot(stage="last", phase="step", mb=1.0)
    assert spot.place(1) == "the optimizer step"
    assert spot.place(2) == "the last stage's optimizer step"


MOE_TP2 = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
           "--max-position-embeddings", "4096", "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16",
           "--vocab-size", "50257", "--num-experts", "8", "--moe-router-topk", "2", "--disable-bias-linear",
           "--moe-token-dispatcher-type", "alltoall", "--tensor-model-parallel-size", "2"]


@pytest.mark.parametrize("pp", ["1", "2"])
def test_no_note_reads_zero_mb_and_only_the_logits_sit_on_the_last_stage(capsys, pp):
    """The router's term (under 1 MB) is no note; with two stages only the logits' toggles are said to
    sit on the last stage (a MoE toggle acts on every stage)."""
    code, out, err = explain_in_process(capsys, "--json", "--world-size", "8", "--gpu", "h100", "--", *MOE_TP2,
                             "--pipeline-model-parallel-size", pp)
    assert code == 0, err
    notes = json.loads(out)["memory"].get("peak_memory_notes") or {}
    assert notes and not any("+0 MB" in n or "-0 MB" in n for n in notes.values()), notes
    assert all(d.startswith("cross_entropy") for d, n in notes.items() if "on the last stage" in n), notes
