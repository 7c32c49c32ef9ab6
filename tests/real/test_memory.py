"""The memory model and the memory guard: against measured H200 peaks, and on planned layouts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import launcher_cases as runs
import pytest
from conftest import REPO, full_caps, megatron_trees
from sandbox import clean_environ

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.memory import model as memory
from megatron_perf_toggles.core.memory.memory_guard import HEADROOM_VAR, headroom_mb
from megatron_perf_toggles.errors import EnvValueError

sys.path.insert(0, str(REPO / "bench"))
import memory_validation
import moe_memory_validation

RAW = REPO / "docs" / "benchmarks" / "raw"
# The reference model as the H200 runs had it (docs/benchmarks/raw/ablate/one-at-a-time.json).
REFERENCE = json.loads((RAW / "ablate" / "one-at-a-time.json").read_text())
REFERENCE_ARGV = next(iter(REFERENCE["commands"].values()))["argv"][4:]


def measured_change(results: dict, arm: str) -> float:
    rows = {r["arm"]: r for r in results["rows"]}
    base = next(r for r in results["rows"] if r["baseline"])
    return rows[arm]["max_allocated_mb"] - base["max_allocated_mb"]


def within(predicted: float | None, measured: float, rel: float = 0.15) -> bool:
    return predicted is not None and abs(predicted - measured) <= max(rel * abs(measured), 1.0)


def test_every_measured_toggle_arm_is_predicted_within_tolerance():
    rows = memory_validation.validate()
    shapes = {r["shape"] for r in rows}
    assert len(shapes) >= 3
    assert any("vocab 256000" in s for s in shapes)  # large vocabulary, small hidden size
    assert any("fp8" in s and "hidden 4096" in s for s in shapes)  # the reference model under FP8
    assert any("bf16" in s and "hidden 4096" in s for s in shapes)
    assert len(rows) >= 40
    missed = [r for r in rows if not r["within"]]
    assert not missed, missed


def test_committed_validation_is_what_the_script_writes():
    assert memory_validation.main(["--check"]) == 0


def test_reference_terms_match_the_h200_one_at_a_time_run():
    layout = memory.layout_from_args(memory_validation.args_of(REFERENCE_ARGV))
    assert within(memory.cross_entropy_mb(layout, True, "native"),
                  measured_change(REFERENCE, "only:cross_entropy_loss_fusion"), 0.02)
    assert within(memory.dummy_wgrads_mb(layout), measured_change(REFERENCE, "only:gradient_accumulation_fusion"), 0.02)
    assert within(memory.grad_reduce_bf16_mb(layout), measured_change(REFERENCE, "only:grad_reduce_in_bf16"), 0.02)


def test_te_cross_entropy_is_the_leaner_path_measured():
    """Megatron 0.18 with TE: the te implementation against the native one on the logits-heavy shape."""
    data = json.loads((RAW / "memory" / "lean-ce-core_v0.18.0.json").read_text())
    layout = memory.layout_from_args(memory_validation.args_of(data["commands"]["baseline"]["argv"]))
    predicted = memory.cross_entropy_mb(layout, True, "native") - memory.cross_entropy_mb(layout, True, "te")
    assert within(predicted, measured_change(data, "+native-ce"), 0.02)
    rows = {r["arm"]: r for r in data["rows"]}
    assert rows["baseline"]["ms_per_iter"]["max"] < rows["+native-ce"]["ms_per_iter"]["min"]  # te is also faster


def test_stock_estimate_is_near_the_measured_all_off_peak():
    """The H200 had no APEX, so its all-off arm is stock (fusion off) for both measured shapes."""
    for name in ("one-at-a-time", "noop1"):
        data = json.loads((RAW / "ablate" / f"{name}.json").read_text())
        base = next(r for r in data["rows"] if r["baseline"])
        layout = memory.layout_from_args(memory_validation.args_of(data["commands"][base["arm"]]["argv"]))
        estimate = memory.stock_peak(layout, grad_accum_fusion=False, te_installed=True)
        assert abs(estimate.peak_mb - base["max_allocated_mb"]) <= 0.1 * base["max_allocated_mb"], (name, estimate)


def test_layout_terms_follow_tp_cp_and_pipeline():
    base = memory.layout_from_args(memory_validation.args_of(REFERENCE_ARGV))
    tp2 = replace(base, tp=2, sequence_parallel=True)
    cp2 = replace(base, cp=2)
    assert memory.fp32_logits_mb(tp2) == memory.fp32_logits_mb(base) / 2  # the vocabulary is split
    assert memory.fp32_logits_mb(cp2) == memory.fp32_logits_mb(base) / 2  # the sequence is split
    pp2 = replace(base, pp=2, split=None)  # the even split of the same layers
    assert pp2.last_stage_params() < base.last_stage_params()


def test_unknown_layouts_are_refused_with_a_reason():
    for extra, words in (({"multi_latent_attention": True}, "multi-latent attention"), ({"vocab_size": None}, "vocabulary"),
                         ({"num_experts": 8, "moe_latent_size": 256}, "MoE latent projections")):
        args = {**memory_validation.args_of(REFERENCE_ARGV), **extra}
        with pytest.raises(memory.Unknown, match=words):
            memory.layout_from_args(args)


# --- the guard ------------------------------------------------------------------------------------

# A logits-heavy job: vocabulary 128256, seq 8192, micro-batch 4 (32768 tokens), hidden 2048.
HEAVY = {**memory_validation.args_of(REFERENCE_ARGV), "hidden_size": 2048, "ffn_hidden_size": 8192,
         "num_attention_heads": 16, "num_layers": 10, "seq_length": 8192, "micro_batch_size": 4}
H100_MB, H200_MB = 80 * 1024.0, 141 * 1024.0


def plan_for(gpu_mb: float | None, args: dict | None = None, explicit: dict | None = None, **environ: str):
    caps = full_caps(apex_fused_wgrad=False, wgrad_fallback=True, gpu_memory_mb=gpu_mb, gpu_name="GPU")
    return decide(args or HEAVY, explicit or {}, read_env(environ), caps)


def test_guard_backs_off_the_costliest_default_where_stock_fits_and_the_defaults_do_not():
    plan = plan_for(H100_MB, CROSS_ENTROPY_FUSION_IMPL="native")
    stock = plan.memory["stock_peak_mb"]
    limit = plan.memory["limit_mb"]
    assert stock < limit == pytest.approx(H100_MB * 0.9)
    ce = plan.decisions["cross_entropy_loss_fusion"]
    assert ce.value is False and ce.source == "guard"
    assert "fits" in ce.reason and f"{stock / 1024:.1f} GB" in ce.reason and "72.0 GB" in ce.reason
    assert plan.memory["peak_memory_delta_mb"]["cross_entropy_loss_fusion"] == 0
    assert plan.memory["planned_peak_mb"] <= limit


def test_same_job_on_an_h200_keeps_the_default():
    plan = plan_for(H200_MB, CROSS_ENTROPY_FUSION_IMPL="native")
    ce = plan.decisions["cross_entropy_loss_fusion"]
    assert (ce.value, ce.source) == (True, "default")
    assert plan.memory["planned_peak_mb"] <= plan.memory["limit_mb"]
    # With TE's implementation the fusion saves memory: nothing to back off, even on an H100.
    plan = plan_for(H100_MB)
    assert plan.decisions["cross_entropy_fusion_impl"].value == "te"
    assert plan.decisions["cross_entropy_loss_fusion"].value is True
    assert plan.memory["peak_memory_delta_mb"]["cross_entropy_loss_fusion"] < 0


def test_explicit_request_is_kept_and_no_default_is_backed_off_that_cannot_help():
    """The user's own choice takes the job past the card: backing off gradient accumulation fusion
    (the one default that adds memory) would not make it fit, so it stays on, and the warning says why."""
    plan = plan_for(H100_MB, explicit={"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"})
    assert plan.decisions["cross_entropy_loss_fusion"].value is True
    assert plan.memory["peak_memory_delta_mb"]["gradient_accumulation_fusion"] > 0
    assert plan.decisions["gradient_accumulation_fusion"].source == "default"
    assert plan.memory["verdict"] == {"stock": "fits_with_expandable_segments", "plan": "does_not_fit"}
    warning = [m.text for m in plan.messages if m.text.startswith("memory: what was asked for")]
    assert warning and "cross_entropy_loss_fusion (cli" in warning[0] and "would not change that" in warning[0]


def test_headroom_setting():
    assert headroom_mb(read_env({}), 1000) == pytest.approx(100)
    assert headroom_mb(read_env({HEADROOM_VAR: "8GB"}), 1000) == 8 * 1024
    assert headroom_mb(read_env({HEADROOM_VAR: "25%"}), 1000) == 250
    with pytest.raises(EnvValueError):
        headroom_mb(read_env({HEADROOM_VAR: "lots"}), 1000)
    # A larger headroom tips the reference model on an H100 too.
    es = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # the allocator's need is the peak alone
    loose = plan_for(H100_MB, args={**HEAVY, "num_layers": 4}, CROSS_ENTROPY_FUSION_IMPL="native", **es)
    tight = plan_for(H100_MB, args={**HEAVY, "num_layers": 4}, CROSS_ENTROPY_FUSION_IMPL="native",
                     **{HEADROOM_VAR: "40%"}, **es)
    assert loose.decisions["cross_entropy_loss_fusion"].value is True
    assert tight.decisions["cross_entropy_loss_fusion"].source == "guard"


def test_no_estimate_or_no_gpu_memory_says_so():
    plan = plan_for(H100_MB, args={"num_layers": 2})
    assert "no memory estimate" in plan.memory["note"]
    assert all(v is None for v in plan.memory["peak_memory_delta_mb"].values())
    plan = plan_for(None)
    assert "not known" in plan.memory["note"] and plan.memory["stock_peak_mb"] > 0


def run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:

    base = clean_environ()
    return subprocess.run([sys.executable, "-m", "megatron_perf_toggles", *argv], capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **(env or {})}, cwd=REPO, timeout=600)


def test_explain_json_on_the_reference_model_predicts_the_measured_changes():
    proc = run_cli("explain", "--json", "--", *REFERENCE_ARGV)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    decisions = record["decisions"]
    assert decisions["cross_entropy_fusion_impl"]["value"] == "native"  # Megatron 0.20 rejects te
    ce = decisions["cross_entropy_loss_fusion"]["peak_memory_delta_mb"]
    bf16 = decisions["grad_reduce_in_bf16"]["peak_memory_delta_mb"]
    assert within(ce, measured_change(REFERENCE, "only:cross_entropy_loss_fusion"))
    assert within(bf16, measured_change(REFERENCE, "only:grad_reduce_in_bf16"))
    assert "total_peak_memory_delta_mb" in record["memory"]


def test_explain_table_shows_each_decisions_memory():
    proc = run_cli("explain", "--", *REFERENCE_ARGV)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("cross_entropy_loss_fusion"))
    assert "  +3.9 GB peak per GPU  " in line  # its own column, before the reason
    assert "memory: stock's estimated peak" in proc.stdout


def heavy_argv(layers: int = 10) -> list[str]:
    argv = list(REFERENCE_ARGV)
    for flag, value in (("--hidden-size", "2048"), ("--ffn-hidden-size", "8192"), ("--num-attention-heads", "16"),
                        ("--num-layers", str(layers)), ("--seq-length", "8192"), ("--max-position-embeddings", "8192"),
                        ("--micro-batch-size", "4")):
        argv[argv.index(flag) + 1] = value
    return argv


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", megatron_trees()[-2:] or [None])
def test_real_tree_h100_backs_off_and_h200_keeps(tree):
    env = {"CROSS_ENTROPY_FUSION_IMPL": "native"}
    h100 = runs.cli_on_worker(tree, ["explain", "--json", "--megatron", str(tree), "--gpu", "h100", "--", *heavy_argv()],
                              env)
    assert h100.returncode == 0, h100.stderr[-2000:]
    record = json.loads(h100.stdout)
    ce = record["decisions"]["cross_entropy_loss_fusion"]
    memory_record = record["memory"]
    assert memory_record["stock_peak_mb"] < memory_record["limit_mb"]
    assert ce["value"] is False and ce["source"] == "guard", ce
    assert "fits" in ce["reason"] and "GB" in ce["reason"] and "backed off" in ce["reason"]
    h200 = runs.cli_on_worker(tree, ["explain", "--json", "--megatron", str(tree), "--gpu", "h200", "--", *heavy_argv()],
                              env)
    assert h200.returncode == 0, h200.stderr[-2000:]
    assert json.loads(h200.stdout)["decisions"]["cross_entropy_loss_fusion"]["value"] is True


def test_the_start_up_and_dry_run_lines_give_each_decisions_memory():
    from megatron_perf_toggles.runtime import provenance

    args = memory_validation.args_of(REFERENCE_ARGV)
    caps = full_caps(apex_fused_wgrad=False, wgrad_fallback=True, gpu_memory_mb=H200_MB, gpu_name="NVIDIA H200")
    plan = decide(args, {}, read_env({"CROSS_ENTROPY_FUSION_IMPL": "native"}), caps)
    lines = provenance.lines(plan)
    ce = next(x for x in lines if "cross_entropy_loss_fusion:" in x)
    wgrad = next(x for x in lines if "gradient_accumulation_fusion:" in x)
    assert ce.endswith("; +3.9 GB peak per GPU)")  # 4008 MB
    assert wgrad.endswith("; +1.4 GB peak per GPU)")  # 1418 MB: TE's placeholders, stock has no APEX
    assert any("memory: stock's estimated peak" in x and "limit 126.9 GB" in x for x in lines)
    record = provenance.build_record(plan, caps, {})
    total = record["memory"]["total_peak_memory_delta_mb"]
    assert total == pytest.approx(sum(d["peak_memory_delta_mb"] for d in record["decisions"].values()
                                      if "peak_memory_delta_mb" in d))
    assert within(total, measured_change(json.loads((RAW / "ablate" / "headline.json").read_text()), "all-on"))


def test_a_live_gpu_reports_its_own_memory():
    from types import SimpleNamespace

    from megatron_perf_toggles.runtime.machine.capabilities import gpu_memory_here

    props = SimpleNamespace(total_memory=143771 * 2**20)
    cuda = SimpleNamespace(is_available=lambda: True, get_device_properties=lambda index: props)
    assert gpu_memory_here(SimpleNamespace(cuda=cuda)) == 143771
    assert gpu_memory_here(SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False))) is None


def test_sequence_parallel_with_selective_recompute_uses_megatrons_formula():
    args = {**memory_validation.args_of(REFERENCE_ARGV), "tensor_model_parallel_size": 2, "sequence_parallel": True,
            "recompute_granularity": "selective"}
    estimate = memory.stock_peak(memory.layout_from_args(args), False, True)
    assert estimate.source == memory.MEGATRON_FORMULA
    assert memory.stock_peak(memory.layout_from_args(memory_validation.args_of(REFERENCE_ARGV)), False, True
                             ).source == memory.PLUGIN_ESTIMATE


def test_data_parallel_size_comes_from_the_world_before_validate_args():
    args = {**memory_validation.args_of(REFERENCE_ARGV), "world_size": 16, "tensor_model_parallel_size": 2}
    assert memory.layout_from_args(args).dp == 8
    assert memory.layout_from_args({**args, "data_parallel_size": 4}).dp == 4


def test_added_results_name_no_machine_paths(tmp_path):
    results = {"versions": {"megatron": {"path": "/srv/x/Megatron-LM"}}, "environment": {"CUDAHOSTCXX": "/opt/gcc/g++"},
               "runs": [{"command": ["/venv/bin/python", "-m", "m", "/srv/x/Megatron-LM/pretrain_gpt.py"],
                         "log": "/scratch/out/part/runs/block01/a/log.txt"}], "rows": []}
    src = tmp_path / "results.json"
    src.write_text(json.dumps(results))
    written = json.loads(memory_validation.import_results("part", src, raw=tmp_path).read_text())
    assert written["runs"][0]["command"] == ["python3", "-m", "m", "/path/to/Megatron-LM/pretrain_gpt.py"]
    assert written["runs"][0]["log"] == "out/part/runs/block01/a/log.txt"
    assert written["environment"]["CUDAHOSTCXX"] == "/path/to/g++"
    results["rows"] = [{"note": "/srv/elsewhere/file"}]
    src.write_text(json.dumps(results))
    with pytest.raises(SystemExit, match="machine paths"):
        memory_validation.import_results("part", src, raw=tmp_path)


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", megatron_trees()[-1:] or [None])
def test_a_planned_world_reaches_the_memory_model_and_the_rules_of_the_checkout(tree):
    """At the plugin's step Megatron has not set args.world_size yet (parse_args does it after the
    parser): the planned world must still give the data-parallel size the distributed optimizer
    shards over, and the facts read from validate_args must see through the safety net's wrapper."""
    def explain(world: int) -> dict:
        proc = runs.cli_on_worker(tree, ["explain", "--json", "--megatron", str(tree), "--world-size", str(world), "--gpu",
                                         "h100"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout)

    dp8, dp64 = explain(8), explain(64)
    w8, w64 = (r["memory"]["stock_parts_mb"]["weights_and_optimizer"] for r in (dp8, dp64))
    # the distributed optimizer: 6 B per parameter plus 12 B sharded over DP (the built-in example's TP 2)
    assert w64 / w8 == pytest.approx((6 + 12 / 32) / (6 + 12 / 4), rel=1e-6)
    if dp64["capabilities"]["megatron"].get("version", "0") >= "0.18.2":
        impl = dp64["decisions"]["cross_entropy_fusion_impl"]
        assert (impl["value"], impl["source"]) == ("native", "guard"), impl


def test_grad_reduce_in_bf16_changes_memory_only_under_bf16():
    """validate_args reads --grad-reduce-in-bf16 only under --bf16: fp16 and fp32 training keep the
    buffer in the parameters' dtype, and --main-grads-dtype bf16 has it in bf16 already."""
    bf16 = memory_validation.args_of(REFERENCE_ARGV)
    assert bf16["bf16"] and memory.grad_reduce_bf16_mb(memory.layout_from_args(bf16)) < -3000
    for other in ({"bf16": False, "fp16": True}, {"bf16": False}, {"main_grads_dtype": "bf16"}):
        layout = memory.layout_from_args({**bf16, **other})
        assert memory.grad_reduce_bf16_mb(layout) == 0, other
    plan = plan_for(H100_MB, args={**bf16, "bf16": False, "fp16": True})
    assert plan.memory["peak_memory_delta_mb"]["grad_reduce_in_bf16"] == 0


def test_a_bad_headroom_is_refused_on_every_plan():
    for bad in ("nan", "inf", "nan%", "-inf"):
        with pytest.raises(EnvValueError):
            headroom_mb(read_env({HEADROOM_VAR: bad}), 1000)
    # No GPU memory known here, or no estimate for the layout: the bad value is still refused.
    with pytest.raises(EnvValueError):
        plan_for(None, **{HEADROOM_VAR: "lots"})
    with pytest.raises(EnvValueError):
        plan_for(H100_MB, args={"num_layers": 2}, **{HEADROOM_VAR: "lots"})
    proc = run_cli("explain", "--", "--num-layers", "2", env={HEADROOM_VAR: "nan"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and HEADROOM_VAR in proc.stderr


def test_pipeline_first_stage_peak_is_not_priced_with_the_last_stages_logits():
    """PP 4: the first stage (four micro-batches in flight) peaks above the last, which alone holds
    the logits. The cross-entropy fusion's +7.8 GB lands on the last stage, well under the first
    stage's peak: the plan fits a 58 GB GPU (52.2 GB limit) and the default stays."""
    args = {**HEAVY, "pipeline_model_parallel_size": 4, "num_layers": 32, "micro_batch_size": 2, "world_size": 4}
    layout = memory.layout_from_args(args)
    logits = memory.cross_entropy_mb(layout, True, "native")
    plan = plan_for(58 * 1024.0, args=args, CROSS_ENTROPY_FUSION_IMPL="native")
    record = plan.memory
    assert record["stock_peak_mb"] < record["limit_mb"] < record["stock_peak_mb"] + logits
    ce = plan.decisions["cross_entropy_loss_fusion"]
    assert (ce.value, ce.source) == (True, "default"), ce.reason
    assert record["planned_peak_mb"] <= record["limit_mb"]
    from megatron_perf_toggles.core.memory.memory_words import summary

    assert f"planned peak {record['planned_peak_mb'] / 1024:.1f} GB" in summary(record)
    # The last stage does carry the logits' copy: a smaller GPU tips it, and the guard backs it off.
    last_only = {**args, "pipeline_model_parallel_size": 1, "num_layers": 8, "world_size": 1}
    assert plan_for(44 * 1024.0, args=last_only, CROSS_ENTROPY_FUSION_IMPL="native"
                    ).decisions["cross_entropy_loss_fusion"].source == "guard"


def test_tied_embeddings_keep_the_output_layers_placeholder():
    """With tied embeddings the output layer passes the shared embedding weight through the same fused
    linear path (its main_grad and grad_added_to_main_grad are DDP's), so TE caches the placeholder of
    the output layer's shape there too: 2 B x 128256 x 4096 = 1002 MB on the reference model."""
    untied = memory.layout_from_args(memory_validation.args_of(REFERENCE_ARGV))
    tied = replace(untied, untied=False)
    assert memory.dummy_wgrads_mb(tied) == memory.dummy_wgrads_mb(untied)
    assert memory.dummy_wgrads_mb(tied) - memory.dummy_wgrads_mb(tied, stage="first") == 2 * 128256 * 4096 / 2**20


def test_the_distributed_optimizer_shards_over_data_and_context_parallel_ranks():
    """Megatron builds the distributed optimizer on the data-parallel group with context parallelism
    (intra_dp_cp): with CP 2 and DP 1 each rank holds half the 12 B of optimizer state."""
    args = {**memory_validation.args_of(REFERENCE_ARGV), "context_parallel_size": 2, "world_size": 2}
    layout = memory.layout_from_args(args)
    assert (layout.dp, layout.cp, layout.distributed_optimizer) == (1, 2, True)
    assert memory.bytes_per_param(layout) == 6 + 12 / 2


def test_the_reason_states_the_headroom_with_its_unit():
    for setting, words in (("8", "less 8.0 GB headroom = 72.0 GB"), ("10%", "less 10% (8.0 GB) headroom = 72.0 GB")):
        plan = plan_for(H100_MB, CROSS_ENTROPY_FUSION_IMPL="native", **{HEADROOM_VAR: setting})
        ce = plan.decisions["cross_entropy_loss_fusion"]
        assert ce.source == "guard" and words in ce.reason, ce.reason


# --- mixture-of-experts jobs through each tree's parser --------------------------------------------

MOE_ARGV = [*moe_memory_validation.COMMON, *moe_memory_validation.SHAPES["fine-b"], "--train-iters", "10",
            "--moe-layer-freq", "([0]+[1]*3)"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", megatron_trees() or [None])
def test_explain_prices_an_moe_job_as_the_bench_plans_it(tree):
    """real_megatron: the tree's parsed namespace (its defaults, validate_args' expert FFN size and
    ETP, the layer pattern parsed by Megatron) reaches the MoE model with the same result as the
    validation bench's plan from the bare command line; each MoE toggle the registry holds has its
    memory change."""
    proc = runs.cli_on_worker(tree, ["explain", "--json", "--megatron", str(tree), "--gpu", "h200", "--", *MOE_ARGV])
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout)
    mem = record["memory"]
    assert mem["note"] is None and mem["verdict"] == {"stock": "fits", "plan": "fits"}
    bench = moe_memory_validation.plan_peak(MOE_ARGV, moe_memory_validation.megatron_values(False), True, False)
    assert mem["stock_peak_mb"] == pytest.approx(bench["stock_planned_mb"], abs=0.2)
    assert mem["stock_parts_mb"]["activations"] > 0
    for dest in memory.MOE_DESTS:
        if dest in record["decisions"]:
            assert record["decisions"][dest]["peak_memory_delta_mb"] is not None
