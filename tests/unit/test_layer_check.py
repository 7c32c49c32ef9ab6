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
    named = {u for t in TOGGLES for u in t.acts_in}
    assert named <= set(units.UNITS), named - set(units.UNITS)


def test_the_data_parallel_toggles_need_ranks_and_the_others_do_not():
    needs = {t.dest for t in units.measurable() if any(u.needs_ranks for u in units.units_of(t))}
    assert needs == {"grad_reduce_in_bf16", "ddp_average_in_collective"}


def test_gradient_accumulation_fusion_acts_in_every_layer_and_in_the_output_layer():
    gaf = BY_DEST["gradient_accumulation_fusion"]
    assert [u.name for u in units.units_of(gaf)] == ["layer_wgrad", "output_wgrad"]
    assert (units.UNITS["layer_wgrad"].per, units.UNITS["output_wgrad"].per) == ("layer", "model")
    assert "tied embeddings" in units.UNITS["output_wgrad"].what


@pytest.mark.parametrize("acts_in", ["layer_wgrad", ("layer_wgrad", "layer_wgrad"), ("",)])
def test_a_malformed_acts_in_stops_the_registry(acts_in):
    """A bare string would read as its letters; a unit named twice would be counted twice."""
    from dataclasses import replace

    from megatron_perf_toggles.core import registry, registry_check
    from megatron_perf_toggles.errors import RegistryError

    bad = replace(BY_DEST["gradient_accumulation_fusion"], acts_in=acts_in)
    with pytest.raises(RegistryError, match="acts_in must be a tuple of distinct unit names"):
        registry_check.validate([bad], [], registry.GROUPS, registry.BY_CAPABILITY, registry.CAPABILITY_RECORDS)


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
    gaf = [line.split(None, 1)[1] for line in done.stdout.splitlines() if line.startswith("gradient_accumulation_fusion")]
    assert gaf == ["layer_wgrad, 4 per micro-batch", "output_wgrad, 1 per micro-batch"]


@pytest.mark.own_process
def test_check_mode_says_why_one_of_a_toggles_units_cannot_be_built():
    """TP 2 and CP 2: the output layer is built with half the vocabulary; a layer, which needs the CP ring, is not."""
    line = [w for w in MOE_LINE if w != "--disable-bias-linear"]
    line = line[:line.index("--num-experts")] + line[line.index("--tokenizer-type"):]  # dense
    done = _layers("--check", "--", *line, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                   "--untie-embeddings-and-output-weights")
    assert done.returncode == 0, done.stderr
    gaf = [line.split(None, 1)[1] for line in done.stdout.splitlines() if line.startswith("gradient_accumulation_fusion")]
    assert len(gaf) == 2 and gaf[0].startswith("layer_wgrad: CP 2:") and gaf[1] == "output_wgrad, 1 per micro-batch"
    assert f"vocabulary slice {32000 // 2}" in done.stdout


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


def _summary(stock_ms, toggle_ms, per_step=None, step_ms=None):
    """A unit's result as the command makes it (step share where a step time is given)."""
    out = analysis.summarise({"stock_gpu": stock_ms, "toggle_gpu": toggle_ms, "stock_wall": stock_ms,
                              "toggle_wall": toggle_ms})
    out.update(peak_mb={"stock": 100.0, "toggle": 120.0})
    if per_step:
        out["step_share"] = analysis.step_share(out["gpu"]["saved_ms"], per_step, step_ms)
    return out


def _row(dest, unit, per_microbatch, status=design.MEASURE):
    return design.Row(BY_DEST[dest], units.UNITS[unit], status, per_microbatch)


def test_the_result_table_fits_the_screen_and_says_a_failure_in_one_row():
    from megatron_perf_toggles.launcher.screen import fit
    from megatron_perf_toggles.tools.layers.report import grouped, result_lines

    stock, toggle = [2.0 + 0.001 * (i % 5) for i in range(30)], [1.5 + 0.001 * (i % 3) for i in range(30)]
    todo = [_row("moe_router_fusion", "router", 4), _row("moe_permute_fusion", "dispatcher", 4)]
    results = grouped(todo, {("moe_router_fusion", "router"): _summary(stock, toggle, 4, 200.0),
                             ("moe_permute_fusion", "dispatcher"): {"error": "ValueError: nope"}})
    lines = fit(result_lines(results, 80), 80)
    assert max(map(len, lines)) <= 80
    text = "\n".join(lines)
    assert "x1.33" in text and "faster" in text and "+1.00" in text and "100 -> 120 MB" in text
    assert "failed" in text and "ValueError: nope" in text
    assert "sum of" not in text  # one unit each: no sum line


# --- a toggle acting in several units -------------------------------------------------------------


def test_summed_share_adds_the_estimates_and_combines_the_half_widths_in_quadrature():
    layer = {"estimate": 0.010, "low": 0.008, "high": 0.012, "calls_per_step": 32, "step_ms": 500.0}
    output = {"estimate": 0.004, "low": 0.001, "high": 0.007, "calls_per_step": 8, "step_ms": 500.0}
    got = analysis.summed_share([layer, output])
    assert got["estimate"] == pytest.approx(0.014)
    assert got["high"] - got["estimate"] == pytest.approx(math.sqrt(0.002 ** 2 + 0.003 ** 2))
    assert got["estimate"] - got["low"] == pytest.approx(math.sqrt(0.002 ** 2 + 0.003 ** 2))
    one = analysis.summed_share([layer])
    assert (one["estimate"], one["low"], one["high"]) == pytest.approx((0.010, 0.008, 0.012))


def test_no_sum_without_every_units_share_and_no_interval_without_every_units_interval():
    share = {"estimate": 0.01, "low": 0.008, "high": 0.012, "calls_per_step": 4, "step_ms": 100.0}
    assert analysis.summed_share([share, None]) is None and analysis.summed_share([]) is None
    few = analysis.summed_share([share, {**share, "low": None, "high": None}])
    assert few["estimate"] == pytest.approx(0.02) and few["low"] is None and few["high"] is None


def test_a_toggle_of_two_units_has_a_line_each_and_their_summed_share():
    from megatron_perf_toggles.launcher.screen import fit
    from megatron_perf_toggles.tools.layers.report import grouped, result_lines

    n = 30
    layer_stock, layer_toggle = [3.0 + 0.002 * (i % 7) for i in range(n)], [2.9 + 0.002 * (i % 5) for i in range(n)]
    out_stock, out_toggle = [6.0 + 0.003 * (i % 4) for i in range(n)], [5.5 + 0.003 * (i % 6) for i in range(n)]
    step_ms, per_step = 800.0, 8  # 8 micro-batches a step: 4 layers x 8 and one output layer x 8 calls
    todo = [_row(GAF, "layer_wgrad", 4), _row(GAF, "output_wgrad", 1)]
    results = grouped(todo, {(GAF, "layer_wgrad"): _summary(layer_stock, layer_toggle, 4 * per_step, step_ms),
                             (GAF, "output_wgrad"): _summary(out_stock, out_toggle, per_step, step_ms)})
    saved = (sum(layer_stock) - sum(layer_toggle)) / n * 4 * per_step + (sum(out_stock) - sum(out_toggle)) / n * per_step
    entry = results[GAF]
    assert list(entry["units"]) == ["layer_wgrad", "output_wgrad"] and entry["not_measured"] == []
    assert entry["step_share"]["estimate"] == pytest.approx(saved / step_ms)
    halves = [(u["step_share"]["high"] - u["step_share"]["low"]) / 2 for u in entry["units"].values()]
    assert entry["step_share"]["high"] - entry["step_share"]["estimate"] == pytest.approx(math.hypot(*halves))
    text = "\n".join(fit(result_lines(results, 200), 200))
    lines = [line for line in text.splitlines() if line.startswith(GAF)]
    assert [line.split()[1] for line in lines] == ["layer_wgrad", "output_wgrad", "sum"]
    assert f"{saved / step_ms * 100:+.2f} [" in lines[2] and "sum of 2" in lines[2]


def test_a_toggle_with_a_unit_not_measured_sums_the_others_and_says_which_is_missing():
    from megatron_perf_toggles.tools.layers.report import grouped, result_lines

    stock, toggle = [2.0 + 0.001 * (i % 5) for i in range(20)], [1.5 + 0.001 * (i % 3) for i in range(20)]
    todo = [_row(GAF, "layer_wgrad", 4, "CP 2: ..."), _row(GAF, "output_wgrad", 1)]
    results = grouped(todo, {(GAF, "output_wgrad"): _summary(stock, toggle, 8, 400.0)})
    assert results[GAF]["not_measured"] == ["layer_wgrad"]
    assert results[GAF]["step_share"]["partial"] is True and results[GAF]["step_share"]["without"] == ["layer_wgrad"]
    assert results[GAF]["step_share"]["estimate"] == pytest.approx(results[GAF]["units"]["output_wgrad"]["step_share"]["estimate"])
    assert "without layer_wgrad" in "\n".join(result_lines(results))
    both = [_row(GAF, "layer_wgrad", 4), _row(GAF, "output_wgrad", 1)]
    failed = grouped(both, {(GAF, "output_wgrad"): _summary(stock, toggle, 8, 400.0),
                            (GAF, "layer_wgrad"): {"error": "RuntimeError: x"}})
    assert failed[GAF]["step_share"] is None and "a unit failed" in "\n".join(result_lines(failed))


def _dense_te(**over):
    dense = {k: v for k, v in MOE_SHAPE.items() if not k.startswith(("num_experts", "moe_"))}
    return {**dense, "transformer_impl": "transformer_engine", "position_embedding_type": "rope", "world_size": 1,
            "global_batch_size": 16, **over}


def test_measure_times_each_unit_installs_the_fallback_as_a_run_does_and_records_the_sum(monkeypatch, tmp_path):
    """The command's loop with the GPU stood in for: each unit of each toggle timed, the plan's wgrad
    path handed to the run's own installer first, the toggle's share summed, the record readable."""
    import argparse
    import statistics

    from megatron_perf_toggles.runtime import wgrad_fallback
    from megatron_perf_toggles.tools.layers import command, gpu_build, gpu_units, report

    args = _dense_te(num_layers=4)
    caps = full_caps()
    plan = decide(args, {}, read_env({}), caps)
    shard = shard_of(args)
    todo = design.rows(plan, args, shard, [GAF, "cross_entropy_loss_fusion"])
    timings = {"layer_wgrad": ([3.0 + 0.002 * (i % 7) for i in range(20)], [2.9 + 0.002 * (i % 5) for i in range(20)]),
               "output_wgrad": ([6.0 + 0.003 * (i % 4) for i in range(20)], [5.5 + 0.003 * (i % 6) for i in range(20)]),
               "output_loss": ([9.0 + 0.001 * (i % 3) for i in range(20)], [8.0 + 0.001 * (i % 4) for i in range(20)])}
    installed, built = [], []
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(gpu_build, "init_one_rank", lambda seed: built.append("init"))
    monkeypatch.setattr(wgrad_fallback, "install_for", lambda path, assumed: installed.append((path, assumed, built[:])))

    def measured(job, unit, blocks, warmup, seed):
        built.append((job.toggle.dest, unit))
        return analysis.summarise(dict(zip(("stock_gpu", "toggle_gpu"), timings[unit], strict=True),
                                       stock_wall=timings[unit][0], toggle_wall=timings[unit][1]))

    monkeypatch.setattr(gpu_units, "measured", measured)
    ns = argparse.Namespace(megatron=str(tmp_path), seed=1, blocks=20, warmup=1)
    results = command.measure(ns, todo, args, shard, {"ms": 400.0}, (plan, caps))
    assert installed == [(plan.wgrad_path, caps.is_assumed("wgrad_fallback"), ["init"])]  # before any unit
    assert built[1:] == [(GAF, "layer_wgrad"), (GAF, "output_wgrad"), ("cross_entropy_loss_fusion", "output_loss")]
    per_step = 16 // 2  # global batch 16, micro-batch 2, one rank

    def share(unit, calls):
        stock, toggle = timings[unit]
        return statistics.fmean(s - t for s, t in zip(stock, toggle, strict=True)) * calls * per_step / 400.0

    gaf = results[GAF]
    assert gaf["units"]["layer_wgrad"]["step_share"]["estimate"] == pytest.approx(share("layer_wgrad", 4))
    assert gaf["units"]["output_wgrad"]["step_share"]["estimate"] == pytest.approx(share("output_wgrad", 1))
    assert gaf["step_share"]["estimate"] == pytest.approx(share("layer_wgrad", 4) + share("output_wgrad", 1))
    assert results["cross_entropy_loss_fusion"]["step_share"]["estimate"] == pytest.approx(share("output_loss", 1))

    path = report.write(tmp_path / "out", {"rows": report.rows_record(todo), "results": results})
    record = json.loads(path.read_text())
    assert record["schema"] == 2 and record["format"] == "megatron-perf-toggles/layers"
    assert {u: r["per_microbatch"] for u, r in record["rows"][GAF]["units"].items()} == {"layer_wgrad": 4,
                                                                                         "output_wgrad": 1}
    assert [(d, u) for d, u, _r in report.unit_results(record)] == [
        ("cross_entropy_loss_fusion", "output_loss"), (GAF, "layer_wgrad"), (GAF, "output_wgrad")]  # sorted keys
    assert record["results"][GAF]["step_share"]["estimate"] == pytest.approx(gaf["step_share"]["estimate"])


def test_a_record_of_one_unit_per_toggle_still_reads():
    """The records under docs/benchmarks/raw/layers (schema 1): one result per toggle, its fields flat."""
    from conftest import REPO

    from megatron_perf_toggles.tools.layers.report import unit_results

    old = json.loads((REPO / "docs" / "benchmarks" / "raw" / "layers" / "dense-run1.json").read_text())
    assert "schema" not in old
    read = {dest: (unit, r) for dest, unit, r in unit_results(old)}
    assert read["cross_entropy_loss_fusion"][0] == "output_loss" and "gpu" in read["cross_entropy_loss_fusion"][1]


# --- what one GPU cannot build, and the review's cases ---------------------------------------------


def _rows(args, environ=None):
    """The check's rows keyed by (toggle, unit)."""
    args = {"transformer_impl": "transformer_engine", "position_embedding_type": "rope", **args}
    return {(r.toggle.dest, r.unit.name): r for r in design.rows(_plan(args, environ), args, shard_of(args))}


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


GAF = "gradient_accumulation_fusion"


@pytest.mark.parametrize(("over", "dest", "unit", "words"), [
    ({"context_parallel_size": 2}, "fused_single_qkv_rope", "attention", "CP 2"),
    ({"context_parallel_size": 2}, GAF, "layer_wgrad", "CP 2"),
    ({"vocab_size": None}, "cross_entropy_loss_fusion", "output_loss", "pass --vocab-size"),
    ({"vocab_size": None}, GAF, "output_wgrad", "pass --vocab-size"),
    ({"defer_embedding_wgrad_compute": True, "pipeline_model_parallel_size": 2}, GAF, "output_wgrad",
     "--defer-embedding-wgrad-compute"),
    ({"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_output_proj": True}, GAF, "output_wgrad", "Transformer Engine's"),
    ({"expert_model_parallel_size": 16}, "moe_grouped_gemm", "moe_layer", "top-6 over the rank's 4 local experts"),
    ({"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"}, "moe_permute_fusion", "dispatcher",
     "allgather dispatcher permutes the tokens gathered"),
])
def test_a_unit_one_gpu_cannot_build_says_why(over, dest, unit, words):
    row = _rows({**MOE_ARGS, **MOE_SHAPE, **over}, {"MOE_PERMUTE_FUSION": "1"})[dest, unit]
    assert not row.measured and words in row.status and "\n" not in row.status, row.status


def test_gradient_accumulation_fusion_has_a_row_per_unit_counted_per_micro_batch():
    """Each layer of the rank's pipeline stage runs layer_wgrad; the output layer (the last stage's) runs once."""
    args = {**MOE_ARGS, **MOE_SHAPE, "num_layers": 12, "pipeline_model_parallel_size": 3}
    got = [(u, r.status, r.per_microbatch) for (dest, u), r in _rows(args).items() if dest == GAF]
    assert got == [("layer_wgrad", design.MEASURE, 12 // 3), ("output_wgrad", design.MEASURE, 1)]


def test_the_output_layer_is_measured_where_a_layer_cannot_be():
    """Under CP a layer's attention needs the ring, the output layer does not: one of GAF's two units is measured."""
    rows = _rows({**MOE_ARGS, **MOE_SHAPE, "context_parallel_size": 2})
    assert not rows[GAF, "layer_wgrad"].measured and rows[GAF, "output_wgrad"].measured


def test_an_unfused_plan_measures_neither_unit():
    rows = _rows({**MOE_ARGS, **MOE_SHAPE}, {"GRADIENT_ACCUMULATION_FUSION": "0"})
    assert all(rows[GAF, u].status.startswith("off in this plan (env)") for u in ("layer_wgrad", "output_wgrad"))


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
