"""The layer-level check (``megatron-perf-toggles layers``): where each toggle acts, one rank's shard,
what is measured or why not, the statistics, the command's CPU mode and its one-line mistakes; and
the permute-fusion rule the check's sweep gave."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import MOE_ARGS, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.registry import BY_DEST, TOGGLES
from megatron_perf_toggles.core.rules import guards_moe
from megatron_perf_toggles.tools.layers import analysis, design, units
from megatron_perf_toggles.tools.layers.command import args_from_ablate, layout_world
from megatron_perf_toggles.tools.layers.shard import DENSE, one_gpu_args, shard_of

MOE_SHAPE = {"hidden_size": 2048, "num_attention_heads": 16, "group_query_attention": True, "num_query_groups": 8,
             "seq_length": 4096, "micro_batch_size": 2, "num_experts": 64, "moe_router_topk": 6,
             "ffn_hidden_size": 5632, "moe_ffn_hidden_size": 1024, "vocab_size": 32000,
             "make_vocab_size_divisible_by": 128, "num_layers": 8}


# --- where each toggle acts --------------------------------------------------------------------


def test_every_unit_a_toggle_names_exists():
    named = {t.acts_in for t in TOGGLES if t.acts_in}
    assert named <= set(units.UNITS), named - set(units.UNITS)


def test_the_data_parallel_toggles_need_ranks_and_the_others_do_not():
    needs = {t.dest for t in units.measurable() if units.unit_of(t).needs_ranks}
    assert needs == {"grad_reduce_in_bf16", "ddp_average_in_collective"}


def test_a_choice_between_implementations_is_not_measured_alone():
    assert "cross_entropy_fusion_impl" not in {t.dest for t in units.measurable()}


def test_units_per_microbatch_follow_the_stage_and_the_moe_layers():
    args = {"num_layers": 8, "pipeline_model_parallel_size": 2}
    assert units.units_per_microbatch(units.UNITS["attention"], args) == 4
    assert units.units_per_microbatch(units.UNITS["output_loss"], args) == 1
    assert units.units_per_microbatch(units.UNITS["router"], {**args, "moe_layer_freq": 2}) == 2
    assert units.units_per_microbatch(units.UNITS["router"], {**args, "moe_layer_freq": [1, 0, 1, 0, 0, 0, 1, 1]}) == 2


# --- one rank's shard --------------------------------------------------------------------------


def test_one_gpu_layout_is_built_at_full_size():
    s = shard_of(MOE_SHAPE)
    assert (s.heads, s.query_groups, s.ffn, s.local_experts, s.tokens) == (16, 8, 5632, 64, 8192)
    assert s.vocab == 32000  # already a multiple of 128
    assert "full size" in s.describe()


def test_tp_ep_sp_shard_is_one_ranks_share():
    args = {**MOE_SHAPE, "tensor_model_parallel_size": 2, "expert_model_parallel_size": 4,
            "sequence_parallel": True, "vocab_size": 32001}
    s = shard_of(args)
    assert (s.heads, s.query_groups, s.ffn) == (8, 4, 2816)
    assert (s.experts, s.local_experts, s.moe_ffn) == (64, 16, 512)  # ETP defaults to TP
    assert s.tokens == 4096 * 2 // 2
    assert s.vocab == math.ceil(32001 / 256) * 256 // 2
    assert "TP 2" in s.describe() and "EP 4" in s.describe()
    built = one_gpu_args(args, s)
    assert built["tensor_model_parallel_size"] == built["expert_model_parallel_size"] == 1
    assert built["num_attention_heads"] == 8 and built["sequence_parallel"] is False


def test_fewer_query_groups_than_tp_ranks_gives_each_rank_one_group():
    assert shard_of({**MOE_SHAPE, "num_query_groups": 2, "tensor_model_parallel_size": 4}).query_groups == 1


def test_a_layout_megatron_refuses_is_one_line():
    with pytest.raises(Exception, match="not divisible by 3"):
        shard_of({**MOE_SHAPE, "tensor_model_parallel_size": 3})


def test_dense_units_of_an_moe_model_carry_no_expert_settings():
    assert DENSE["num_experts"] is None and DENSE["moe_ffn_hidden_size"] is None


@pytest.mark.parametrize(("words", "world"), [([], 1), (["--tensor-model-parallel-size", "2"], 2),
                                              (["--expert-model-parallel-size", "4"], 4),
                                              (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size",
                                                "3"], 6),
                                              (["--pipeline-model-parallel-size", "2", "--context-parallel-size",
                                                "2"], 4)])
def test_the_smallest_world_of_a_layout(words, world):
    assert layout_world(["--num-layers", "4", *words]) == world


# --- what is measured, or why not ----------------------------------------------------------------


def _plan(args, environ=None):
    return decide(args, {}, read_env(environ or {}), full_caps())


def test_rows_say_why_a_toggle_is_not_measured():
    args = {**MOE_ARGS, **MOE_SHAPE, "transformer_impl": "transformer_engine", "position_embedding_type": "rope"}
    plan = _plan(args, {"MOE_ROUTER_FUSION": "0"})
    rows = {r.toggle.dest: r for r in design.rows(plan, args, shard_of(args))}
    assert "2 or more ranks" in rows["grad_reduce_in_bf16"].status
    assert rows["moe_router_fusion"].status.startswith("off in this plan (env)")
    assert rows["moe_grouped_gemm"].measured and rows["moe_grouped_gemm"].per_microbatch == 8


def test_moe_toggles_do_not_apply_to_a_dense_model():
    dense = {k: v for k, v in MOE_SHAPE.items() if not k.startswith(("num_experts", "moe_"))}
    args = {**dense, "transformer_impl": "transformer_engine", "position_embedding_type": "rope"}
    rows = {r.toggle.dest: r for r in design.rows(_plan(args), args, shard_of(args))}
    assert "does not apply" in rows["moe_router_fusion"].status
    assert rows["cross_entropy_loss_fusion"].measured


def test_a_misspelt_toggle_is_one_line_with_a_suggestion():
    with pytest.raises(Exception, match="did you mean 'moe_router_fusion'"):
        design.asked(["moe_routr_fusion"])


def test_microbatches_per_step():
    assert design.microbatches_per_step({"world_size": 8, "tensor_model_parallel_size": 2, "micro_batch_size": 2,
                                         "global_batch_size": 64}) == 8


# --- statistics ---------------------------------------------------------------------------------


def test_paired_difference_is_the_mean_saving_with_a_t_interval():
    stock, toggle = [10.0, 10.2, 9.9, 10.1], [9.0, 9.1, 9.0, 9.2]
    d = [1.0, 1.1, 0.9, 0.9]
    got = analysis.paired_difference(stock, toggle)
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    assert got["estimate"] == pytest.approx(mean)
    assert got["high"] - got["estimate"] == pytest.approx(3.182446 * sd / 2, rel=1e-4)  # t(0.975, 3)


def test_step_share_scales_by_calls_and_step_time():
    share = analysis.step_share({"estimate": 0.5, "low": 0.4, "high": 0.6}, 16, 400.0)
    assert share["estimate"] == pytest.approx(0.02) and share["low"] == pytest.approx(0.016)
    assert analysis.step_share({"estimate": 0.5}, 16, None) is None


def test_summarise_calls_a_faster_toggle_faster_and_resolves_within_one_percent():
    stock = [10.0 + 0.01 * (i % 3) for i in range(40)]
    toggle = [9.0 + 0.01 * ((i + 1) % 3) for i in range(40)]
    out = analysis.summarise({"stock_gpu": stock, "toggle_gpu": toggle, "stock_wall": stock, "toggle_wall": stock})
    assert out["gpu"]["speedup"]["verdict"] == "faster" and analysis.resolved_within(out)
    assert out["wall"]["speedup"]["estimate"] == pytest.approx(1.0)


# --- the command on a CPU ------------------------------------------------------------------------


def _layers(*words):
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "layers", *words], capture_output=True,
                          text=True, timeout=120, check=False)


MOE_LINE = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--micro-batch-size", "2", "--global-batch-size", "16", "--bf16",
            "--num-experts", "16", "--moe-router-topk", "2", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "32000", "--train-iters", "10", "--lr", "1e-4", "--transformer-impl", "transformer_engine",
            "--position-embedding-type", "rope", "--disable-bias-linear"]


@pytest.mark.own_process
def test_check_mode_lists_each_toggles_unit_on_the_recorded_surface():
    done = _layers("--check", "--step-ms", "500", "--", *MOE_LINE)
    assert done.returncode == 0, done.stderr
    for dest in ("moe_router_fusion", "moe_permute_fusion", "cross_entropy_loss_fusion"):
        assert dest in done.stdout
    assert "router, 4 per micro-batch" in done.stdout and "needs 2 or more ranks" in done.stdout
    assert "not timed: --check" in done.stdout and "500 ms (--step-ms)" in done.stdout


@pytest.mark.own_process
@pytest.mark.parametrize(("words", "message"), [
    (["--blocks", "0", "--check", "--", *MOE_LINE], "--blocks must be 1 or more"),
    (["--check", "--toggles", "moe_routr_fusion", "--", *MOE_LINE], "did you mean 'moe_router_fusion'"),
    (["--check"], "no Megatron arguments"),
    (["--check", "--ablate-results", "/nonexistent/results.json"], "no baseline ms/iter and command there"),
    (["--check", "--step-ms", "-3", "--", *MOE_LINE], "--step-ms must be above 0"),
    (["--megatron", "/nonexistent", "--", *MOE_LINE], "is not a Megatron-LM checkout"),
])
def test_each_mistake_is_one_line_and_exit_2(words, message):
    done = _layers(*words)
    assert done.returncode == 2, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and message in said[0], done.stderr


def test_an_ablate_result_gives_the_command_it_measured(tmp_path):
    results = {"rows": [{"arm": "all-off", "baseline": True, "ms_per_iter": {"median": 179.0}}],
               "runs": [{"arm": "all-off", "command": ["python3", "-m", "megatron_perf_toggles.run",
                                                      "/x/pretrain_gpt.py", "--num-layers", "4", "--bf16"]}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert args_from_ablate(str(path)) == ["--num-layers", "4", "--bf16"]


# --- the rule the sweep gave ----------------------------------------------------------------------


def _moe(**over):
    return {**MOE_ARGS, "hidden_size": 2048, "seq_length": 4096, "micro_batch_size": 1, "moe_router_topk": 2,
            "moe_token_dispatcher_type": "alltoall", **over}


def test_routed_elements_count_one_ranks_tokens():
    assert guards_moe.routed_elements(_moe()) == 4096 * 2 * 2048
    sp = _moe(sequence_parallel=True, tensor_model_parallel_size=2, context_parallel_size=2)
    assert guards_moe.routed_elements(sp) == 4096 // 2 * 1 // 2 * 2 * 2048


def test_permute_fusion_is_off_by_default_where_measured_slower():
    d = _plan(_moe()).decisions["moe_permute_fusion"]  # 16 Mi elements routed, under 64 Mi
    assert (d.value, d.source) == (False, "guard") and "measured slower" in d.reason


def test_permute_fusion_stays_on_where_measured_faster_or_not_measured():
    assert _plan(_moe(micro_batch_size=8)).decisions["moe_permute_fusion"].value is True  # 128 Mi
    assert _plan(_moe(expert_model_parallel_size=2)).decisions["moe_permute_fusion"].value is True  # EP 2: not measured
    assert _plan(_moe(moe_token_dispatcher_type="flex")).decisions["moe_permute_fusion"].value is True


def test_the_allgather_threshold_is_its_own():
    at_64 = _moe(micro_batch_size=4)  # 64 Mi: faster with alltoall, slower with allgather
    assert _plan(at_64).decisions["moe_permute_fusion"].value is True
    assert _plan({**at_64, "moe_token_dispatcher_type": "allgather"}).decisions["moe_permute_fusion"].value is False


def test_an_asked_for_permute_fusion_is_left_alone():
    d = _plan(_moe(), {"MOE_PERMUTE_FUSION": "1"}).decisions["moe_permute_fusion"]
    assert (d.value, d.source) == (True, "env")


def test_the_rule_is_in_the_guard_table_as_no_megatron_rule():
    from megatron_perf_toggles.core.rules.guards import GUARDS

    ours = [g for g in GUARDS if g.name == "moe_permute_fusion_slower_here"]
    assert len(ours) == 1 and ours[0].answers == () and ours[0].moves == ("moe_permute_fusion",)
    assert BY_DEST["moe_permute_fusion"].default is True  # the rule, not the default, turns it off


def test_the_result_table_fits_the_screen_and_says_a_failure_in_one_row():
    from megatron_perf_toggles.launcher.screen import fit
    from megatron_perf_toggles.tools.layers.report import result_lines

    stock, toggle = [2.0 + 0.001 * (i % 5) for i in range(30)], [1.5 + 0.001 * (i % 3) for i in range(30)]
    ok = analysis.summarise({"stock_gpu": stock, "toggle_gpu": toggle, "stock_wall": stock, "toggle_wall": stock})
    ok.update(peak_mb={"stock": 100.0, "toggle": 120.0},
              step_share=analysis.step_share(ok["gpu"]["saved_ms"], 4, 200.0))
    lines = fit(result_lines({"moe_router_fusion": ok, "moe_permute_fusion": {"error": "ValueError: nope"}}, 80), 80)
    assert max(map(len, lines)) <= 80
    text = "\n".join(lines)
    assert "x1.33" in text and "faster" in text and "+1.00" in text and "100 -> 120 MB" in text
    assert "failed" in text and "ValueError: nope" in text


# --- what one GPU cannot build, and the review's cases ---------------------------------------------


def _rows(args, environ=None):
    args = {"transformer_impl": "transformer_engine", "position_embedding_type": "rope", **args}
    return {r.toggle.dest: r for r in design.rows(_plan(args, environ), args, shard_of(args))}


def test_moe_layers_per_stage_round_up_as_megatron_counts_them():
    assert units.moe_layers_per_stage({"moe_layer_freq": 3}, 4) == 2  # layers 0 and 3


def test_the_experts_take_their_tokens_gathered_over_etp_and_the_shared_expert_is_split_over_tp():
    args = {**MOE_SHAPE, "tensor_model_parallel_size": 2, "sequence_parallel": True,
            "moe_shared_expert_intermediate_size": 2048, "moe_token_dispatcher_type": "flex",
            "overlap_moe_expert_parallel_comm": True}
    s = shard_of(args)
    assert s.tokens == 4096 and s.expert_tokens == 4096 * 2
    built = one_gpu_args(args, s)
    assert built["moe_shared_expert_intermediate_size"] == 1024
    assert built["moe_token_dispatcher_type"] == "alltoall" and built["overlap_moe_expert_parallel_comm"] is False


def test_each_unit_sees_its_experts():
    from megatron_perf_toggles.tools.layers.shard import unit_changes

    s = shard_of({**MOE_SHAPE, "expert_model_parallel_size": 4})
    assert unit_changes("router", s) == {"num_experts": 64} == unit_changes("dispatcher", s)
    layer = unit_changes("moe_layer", s)
    assert layer["num_experts"] == 16 and layer["moe_router_num_groups"] is None
    assert unit_changes("attention", s)["num_experts"] is None and unit_changes("output_loss", s) == DENSE


@pytest.mark.parametrize(("over", "dest", "words"), [
    ({"context_parallel_size": 2}, "fused_single_qkv_rope", "CP 2"),
    ({"context_parallel_size": 2}, "gradient_accumulation_fusion", "CP 2"),
    ({"vocab_size": None}, "cross_entropy_loss_fusion", "pass --vocab-size"),
    ({"expert_model_parallel_size": 16}, "moe_grouped_gemm", "top-6 over the rank's 4 local experts"),
    ({"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"}, "moe_permute_fusion",
     "allgather dispatcher permutes the tokens gathered"),
])
def test_a_unit_one_gpu_cannot_build_says_why(over, dest, words):
    row = _rows({**MOE_ARGS, **MOE_SHAPE, **over}, {"MOE_PERMUTE_FUSION": "1"})[dest]
    assert not row.measured and words in row.status, row.status


def test_a_missing_size_is_one_line():
    with pytest.raises(Exception, match="needs the model's sizes: --hidden-size"):
        shard_of({k: v for k, v in MOE_SHAPE.items() if k != "hidden_size"})


@pytest.mark.own_process
def test_a_command_line_without_sizes_is_one_line_exit_2():
    done = _layers("--check", "--", "--num-layers", "4")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("over", [{"tensor_model_parallel_size": 2}, {"expert_tensor_parallel_size": 2}])
def test_the_permute_rule_covers_only_the_layout_measured(over):
    assert _plan(_moe(**over)).decisions["moe_permute_fusion"].value is True


def test_the_permute_rule_covers_only_the_platform_measured():
    plan = decide(_moe(), {}, read_env({}), full_caps(device="rocm"))
    assert plan.decisions["moe_permute_fusion"].value is True


def test_a_measured_unit_is_summarised_and_a_failing_one_is_one_line(monkeypatch):
    """The one path the command and the sweep both time through (the GPU parts stood in for)."""
    from megatron_perf_toggles.tools.layers import gpu_timing, gpu_units

    stock, toggle = [2.0 + 0.001 * (i % 5) for i in range(20)], [1.0 + 0.001 * (i % 3) for i in range(20)]
    timed = {"stock_gpu": stock, "toggle_gpu": toggle, "stock_wall": stock, "toggle_wall": toggle,
             "peak_mb": {"stock": 1.0, "toggle": 2.0}}
    monkeypatch.setattr(gpu_timing, "time_pair", lambda *a: timed)
    monkeypatch.setitem(gpu_units.BUILDERS, "router", lambda job: gpu_units.Pair(lambda: None, lambda: None, True, "n"))
    got = gpu_units.measured(None, "router", 20, 1, 0)
    assert got["gpu"]["speedup"]["verdict"] == "faster" and got["peak_mb"] == timed["peak_mb"] and got["note"] == "n"

    def refuses(job):
        raise ValueError("num_moe_experts (4) should be divisible by moe_router_num_groups (8).\nmore")

    monkeypatch.setitem(gpu_units.BUILDERS, "router", refuses)
    assert gpu_units.measured(None, "router", 20, 1, 0) == {
        "error": "ValueError: num_moe_experts (4) should be divisible by moe_router_num_groups (8)."}
