"""Real Megatron-LM: parse_args + validate_args + TransformerConfig on CPU, on each tree's worker (tree_driver).

Trees come from MEGATRON_LM_TREES (':'-separated checkouts). Expected values come from the
version facts of the product brief (e.g. the te cross-entropy assertion from core 0.18.2, the
fused_single_qkv_rope field from 0.15), never from the plugin's own output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tree_driver
from conftest import megatron_trees

from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.runtime.machine.capabilities import detect_rules

TREES = megatron_trees()
pytestmark = pytest.mark.real_megatron

CAPABLE = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"}
BF16 = ["--bf16"]
NVFP4 = ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]


GPU_TE = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.12,cuda"}
MFSDP_DEFER = [*BF16, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--ckpt-format",
               "fsdp_dtensor", "--pipeline-model-parallel-size", "2", "--defer-embedding-wgrad-compute"]
DEFER = [*BF16, "--pipeline-model-parallel-size", "2", "--defer-embedding-wgrad-compute"]
# A mixture-of-experts model as MoE recipes set one up; validate_args asks the GPU about grouped GEMM
MOE = [*BF16, "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
H100 = {"device_capability": [9, 0]}


def _delay_wgrad_graph_argv(tree: Path) -> list[str]:
    text = (tree / "megatron" / "training" / "arguments.py").read_text()
    scope = "--cuda-graph-modules" if "'--cuda-graph-modules'" in text else "--cuda-graph-scope"
    return [*BF16, "--num-experts", "4", "--delay-wgrad-compute", "--overlap-grad-reduce", "--use-distributed-optimizer",
            "--cuda-graph-impl", "transformer_engine", scope, "attn", "--disable-bias-linear",
            "--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall"]


def _dependency_cases(tree: Path) -> list[dict]:
    """Issue cases where a plugin default met a Megatron rule; each runs stock (no plugin) too."""
    delay = _delay_wgrad_graph_argv(tree)
    cases = [
        # Up to 0.18.2 deterministic mode wants NCCL_ALGO set (Megatron's own CI sets it).
        {"id": "deterministic", "argv": [*BF16, "--deterministic-mode"], "env": {**CAPABLE, "NCCL_ALGO": "Ring"}},
        {"id": "deterministic_cli_fusion", "argv": [*BF16, "--deterministic-mode", "--cross-entropy-loss-fusion"],
         "env": {**CAPABLE, "NCCL_ALGO": "Ring"}},
        {"id": "mfsdp_defer", "argv": MFSDP_DEFER, "env": {**GPU_TE, "WORLD_SIZE": "2"}, "device_arch": 9},
        {"id": "defer_no_wgrad_kernel", "argv": DEFER, "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "te=2.12", "WORLD_SIZE": "2"}},
        {"id": "delay_graph_fallback", "argv": delay, "te_version": "2.12.0",
         "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "te=2.12,cuda", "WORLD_SIZE": "2"}},
        {"id": "delay_graph_no_wgrad_kernel", "argv": delay, "te_version": "2.12.0",
         "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "te=2.12", "WORLD_SIZE": "2"}},
        {"id": "fp32_accumulation", "argv": [*BF16, "--accumulate-allreduce-grads-in-fp32"], "env": CAPABLE},
    ]
    return cases + [{**c, "id": f"stock:{c['id']}", "stock": True} for c in cases]


def _cases(tmp: str, tree: Path) -> list[dict]:
    cases = [
        *_dependency_cases(tree),
        {"id": "bf16", "argv": [*BF16, "--tensorboard-dir", f"{tmp}/tb", "--wandb-save-dir", f"{tmp}/wb"],
         "env": CAPABLE},
        {"id": "fp8_delayed", "argv": [*BF16, "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                       "--tensorboard-dir", f"{tmp}/tb8"], "env": CAPABLE},
        {"id": "fp8_tensorwise", "argv": [*BF16, "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                                          "--tensorboard-dir", f"{tmp}/tb8tw"], "env": CAPABLE},
        {"id": "detected", "argv": BF16, "env": {}},
        {"id": "plugin_off", "argv": [*BF16, "--tensorboard-dir", f"{tmp}/tboff"],
         "env": {**CAPABLE, "MEGATRON_PERF_TOGGLES": "0"}},
        {"id": "bad_assume", "argv": BF16, "env": {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,gpu9000"}},
        {"id": "fsdp2", "argv": [*BF16, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                 "--ckpt-format", "torch_dist"], "env": CAPABLE},
        {"id": "fsdp2_plugin_off", "argv": [*BF16, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                            "--ckpt-format", "torch_dist"],
         "env": {**CAPABLE, "MEGATRON_PERF_TOGGLES": "0"}},
        {"id": "fsdp2_explicit_fusion", "argv": [*BF16, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights",
                                                 "--ckpt-format", "torch_dist", "--gradient-accumulation-fusion"],
         "env": CAPABLE},
        {"id": "per_token_loss", "argv": [*BF16, "--calculate-per-token-loss"], "env": CAPABLE},
        {"id": "qk_layernorm", "argv": [*BF16, "--qk-layernorm"], "env": CAPABLE},
        {"id": "cli_te_impl", "argv": [*BF16, "--cross-entropy-fusion-impl", "te"], "env": CAPABLE},
        {"id": "adam_advice", "argv": [*BF16, "--lr", "8e-4", "--adam-eps", "1e-8"], "env": CAPABLE},
        {"id": "untagged", "argv": [*BF16, "--tensorboard-dir", f"{tmp}/tbu"],
         "env": {**CAPABLE, "MEGATRON_PERF_TOGGLES_TAG_LOG_DIR": "0"}},
        {"id": "resume", "argv": [*BF16, "--tensorboard-dir", f"{tmp}/tbr/bf16", "--save", f"{tmp}/ck",
                                  "--load", f"{tmp}/ck", "--save-interval", "1"], "env": CAPABLE},
        *_resume_cases(tmp),
        # validate_args wants TE >= 2.7 for FP4: these cases plan for a machine with TE 2.8, for
        # Megatron's checks as for the plugin's (CAPABLE), and build the TransformerConfig.
        {"id": "nvfp4", "argv": [*BF16, *NVFP4], "env": CAPABLE, "te_version": "2.8.0"},
        {"id": "nvfp4_pp8", "argv": [*BF16, *NVFP4, "--num-layers", "32", "--pipeline-model-parallel-size", "8"],
         "env": {**CAPABLE, "WORLD_SIZE": "8"}, "te_version": "2.8.0"},
        {"id": "nvfp4_plugin_off", "argv": [*BF16, *NVFP4], "env": {**CAPABLE, "MEGATRON_PERF_TOGGLES": "0"},
         "te_version": "2.8.0"},
        {"id": "nvfp4_plugin_off_fp4_env", "argv": [*BF16, *NVFP4], "te_version": "2.8.0",
         "env": {**CAPABLE, "MEGATRON_PERF_TOGGLES": "0", "FP4_SELECTIVE_BF16": "1", "FP4_BF16_END": "3"}},
        {"id": "nvfp4_plugin_off_counts", "argv": [*BF16, *NVFP4], "te_version": "2.8.0",
         "env": {**CAPABLE, "MEGATRON_PERF_TOGGLES": "0", "FP4_BF16_START": "3"}},
        {"id": "tag_by_script", "argv": [*BF16, "--tensorboard-dir", f"{tmp}/exp/bf16/2025-01-01_00-00-00"],
         "env": CAPABLE},
        {"id": "tag_mislabelled", "argv": [*BF16, "--tensorboard-dir", f"{tmp}/exp/fp8/2025-01-01_00-00-00"],
         "env": CAPABLE},
    ]
    cases.append({"id": "wgrad_sites", "kind": "wgrad_sites"})
    cases += _moe_cases()
    for t in TOGGLES:
        off, on = ("native", "te") if t.kind == "choice" else ("0", "1")
        # a MoE toggle is judged on a MoE model (TE's permutation kernels are not here: no TransformerConfig)
        argv, extra = (MOE, {**H100, "config": False}) if t.scope == "moe" else (BF16, {})
        cases.append({"id": f"env0:{t.dest}", "argv": argv, "env": {**CAPABLE, t.env: off}, **extra})
        cases.append({"id": f"env1:{t.dest}", "argv": argv, "env": {**CAPABLE, t.env: on}, **extra})
        cases.append({"id": f"envbad:{t.dest}", "argv": argv, "env": {**CAPABLE, t.env: "perhaps"}, **extra})
        cli_on = t.flag_for(True if t.kind == "bool" else "te")
        cli_off = t.flag_for(False if t.kind == "bool" else "native")
        cases.append({"id": f"cli_on_over_env0:{t.dest}", "argv": [*argv, *cli_on], "env": {**CAPABLE, t.env: off},
                      **extra})
        cases.append({"id": f"cli_off_over_env1:{t.dest}", "argv": [*argv, *cli_off], "env": {**CAPABLE, t.env: on},
                      **extra})
    return cases


def _moe_cases() -> list[dict]:
    """Issue 36: the MoE toggles on a MoE model (TransformerConfig built, the permutation left to stock,
    whose TE kernels this machine lacks), on a dense one (asked for by the environment), and fp16 where
    0.13 to 0.15 take grouped GEMM only under bf16."""
    fp16 = [w for w in MOE if w != "--bf16"] + ["--fp16"]
    return [
        {"id": "moe", "argv": MOE, "env": {**CAPABLE, "MOE_PERMUTE_FUSION": "0"}, **H100},
        {"id": "moe_dense", "argv": BF16, "env": {**CAPABLE, "MOE_GROUPED_GEMM": "1", "MOE_ROUTER_FUSION": "1"}},
        {"id": "moe_fp16", "argv": fp16, "env": CAPABLE, "config": False, **H100},
        {"id": "stock:moe_fp16_grouped_gemm", "argv": [*fp16, "--moe-grouped-gemm"], "stock": True, "config": False,
         **H100},
    ]


def _resume_cases(tmp: str) -> list[dict]:
    """Resume a checkpoint whose writer had grad_reduce_in_bf16 on and recorded no layout, so the
    layout is worked out from this tree's own parsed arguments."""
    out = []
    plain = {"start_iteration": 0, "precision": "bf16", "decisions": {"grad_reduce_in_bf16": True}}
    recorded = {**plain, "optimizer_layout": ["model-space", "fully_reshardable"], "grad_buffer_dtype": "bf16"}
    for name, extra, entry in (("resume_distopt", [], plain), ("resume_distopt_no_load_optim", ["--no-load-optim"], plain),
                               ("resume_recorded_model_space", [], recorded)):
        ck = f"{tmp}/{name}"
        history = json.dumps(entry)
        out.append({"id": name, "argv": [*BF16, "--use-distributed-optimizer", "--load", ck, *extra],
                    "env": {**CAPABLE, "GRAD_REDUCE_IN_BF16": "0"},
                    "files": {f"{ck}/perf_toggles_history.jsonl": history + "\n",
                              f"{ck}/latest_checkpointed_iteration.txt": "4"}})
    return out


def _version_of(tree: Path) -> tuple[int, ...]:
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    parts = [int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR", "PATCH")]
    return tuple(parts)


def _build(tree: str, work: Path) -> list[dict]:
    """The suite's cases for one tree's worker; what they write (records, checkpoints) goes under
    ``work``, which lives as long as the test session."""
    cases = [{"kind": "parse", **case, "name": case["id"]} for case in _cases(str(work), Path(tree))]
    return [{"tree": tree, "cases": cases}]


SUITE = tree_driver.SESSION.suite("parse", _build)


@pytest.fixture(params=TREES, ids=lambda p: p.name)
def tree(request):
    return request.param, _version_of(request.param), tree_driver.SESSION.results(SUITE, str(request.param))


def ok(result: dict) -> dict:
    assert result.get("validated"), {k: result.get(k) for k in ("exit", "error", "stderr", "traceback_tail")}
    return result


def test_bf16_defaults_reach_megatron(tree):
    _path, version, by_id = tree
    r = ok(by_id["bf16"])
    v = r["values"]
    assert v["gradient_accumulation_fusion"] is True and v["grad_reduce_in_bf16"] is True
    assert v["ddp_average_in_collective"] is True and v["cross_entropy_loss_fusion"] is True
    te_asserted = version >= (0, 18, 2)
    assert v["cross_entropy_fusion_impl"] == ("native" if te_asserted else "te")
    assert r["perf_toggles"]["cross_entropy_fusion_impl"]["source"] == ("guard" if te_asserted else "default")
    assert r["precision"] == "bf16"
    assert v["tensorboard_dir"].endswith("/tb/bf16") and v["wandb_save_dir"].endswith("/wb/bf16")
    record = json.loads((Path(v["tensorboard_dir"]) / "perf_toggles.json").read_text())
    assert record["decisions"] == r["perf_toggles"]
    assert "[perf-toggles] grad_reduce_in_bf16: on (default;" in r["stdout"]


def test_fused_single_qkv_rope_reaches_transformer_config(tree):
    _path, version, by_id = tree
    r = ok(by_id["bf16"])
    if version >= (0, 15):
        assert r["config_has_field"] and r["config_fused_single_qkv_rope"] is True
    else:
        assert not r["config_has_field"]
        assert r["perf_toggles"]["fused_single_qkv_rope"]["value"] is False
        assert "no fused_single_qkv_rope field" in r["perf_toggles"]["fused_single_qkv_rope"]["reason"]


@pytest.mark.parametrize("case, tag", [("fp8_delayed", "fp8"), ("fp8_tensorwise", "fp8_tensorwise")])
def test_fp8_tags(tree, case, tag):
    r = ok(tree[2][case])
    assert r["precision"] == tag and r["values"]["tensorboard_dir"].endswith(f"/{tag}")


def test_detection_on_this_cpu_machine_downgrades_instead_of_crashing(tree):
    r = ok(tree[2]["detected"])
    pt = r["perf_toggles"]
    # No APEX and no Transformer Engine on a CPU test machine: the defaults that need them go off.
    assert (pt["gradient_accumulation_fusion"]["value"], pt["gradient_accumulation_fusion"]["source"]) == (False, "guard")
    assert pt["cross_entropy_fusion_impl"]["value"] == "native"
    assert pt["fused_single_qkv_rope"]["value"] is False


def test_plugin_off_leaves_megatron_defaults(tree):
    v = ok(tree[2]["plugin_off"])["values"]
    assert v["grad_reduce_in_bf16"] is False and v["ddp_average_in_collective"] is False
    assert v["cross_entropy_loss_fusion"] is False and v["cross_entropy_fusion_impl"] == "native"
    assert v["gradient_accumulation_fusion"] is True  # Megatron's own default
    assert v["tensorboard_dir"].endswith("/tboff")  # stock's: as given, not tagged with the precision


def test_bad_assume_is_one_clear_line(tree):
    r = tree[2]["bad_assume"]
    assert r.get("exit") == 2 and "unknown entry 'gpu9000'" in r["stderr"] and "Traceback" not in r["stderr"]


def test_fsdp2_guard_lets_validate_pass(tree):
    r = ok(tree[2]["fsdp2"])
    assert r["values"]["gradient_accumulation_fusion"] is False
    assert r["perf_toggles"]["gradient_accumulation_fusion"]["source"] == "guard"


def test_fsdp2_with_the_master_switch_off_is_exactly_stock(tree):
    # MEGATRON_PERF_TOGGLES=0 leaves Megatron's own default (fusion on), which stock Megatron
    # rejects with FSDP2 itself: the same error, not a plugin change.
    r = tree[2]["fsdp2_plugin_off"]
    assert "--use-torch-fsdp2 is not supported with gradient accumulation fusion" in r.get("error", "")
    assert r.get("validated") is None and r.get("parsed") is True  # parsed as stock, refused by Megatron itself


def test_fsdp2_with_explicit_fusion_is_refused_before_validate(tree):
    r = tree[2]["fsdp2_explicit_fusion"]
    assert r.get("exit") == 2 and "--gradient-accumulation-fusion was requested" in r["stderr"]


def test_per_token_loss_turns_ddp_average_off(tree):
    r = ok(tree[2]["per_token_loss"])
    assert r["values"]["ddp_average_in_collective"] is False


def test_qk_layernorm_turns_fused_rope_off(tree):
    r = ok(tree[2]["qk_layernorm"])
    assert r["values"]["fused_single_qkv_rope"] is False
    if tree[1] >= (0, 15):
        assert r["config_fused_single_qkv_rope"] is False


def test_explicit_te_impl(tree):
    _path, version, by_id = tree
    r = ok(by_id["cli_te_impl"])  # stock Megatron accepts it on every version, so must we
    assert r["values"]["cross_entropy_fusion_impl"] == "te"
    if version >= (0, 18, 2):  # the fusion default yields to the explicit impl Megatron forbids with it
        d = r["perf_toggles"]["cross_entropy_loss_fusion"]
        assert (d["value"], d["source"]) == (False, "guard")


def test_adam_eps_advice_is_printed(tree):
    r = ok(tree[2]["adam_advice"])
    assert "[perf-toggles] advice: --adam-eps 1e-08 with --lr 0.0008" in r["stdout"]


def test_tagging_can_be_turned_off_and_resume_is_not_double_tagged(tree):
    assert ok(tree[2]["untagged"])["values"]["tensorboard_dir"].endswith("/tbu")
    v = ok(tree[2]["resume"])["values"]
    assert v["tensorboard_dir"].endswith("/tbr/bf16") and v["save"].endswith("/ck") and v["load"].endswith("/ck")


def _fp4_case(tree, case: str) -> dict:
    _path, version, by_id = tree
    if version < (0, 15):
        pytest.skip(f"core {'.'.join(map(str, version))} has no --fp4-format (FP4 arrived in core 0.15)")
    return ok(by_id[case])


def _fp4_layers(r: dict) -> tuple:
    v = r["values"]
    return v["first_last_layers_bf16"], v["num_layers_at_start_in_bf16"], v["num_layers_at_end_in_bf16"]


@pytest.mark.parametrize("case", ["nvfp4", "nvfp4_pp8"])
def test_nvfp4_keeps_first_2_and_last_8_layers_in_bf16(tree, case):
    # As the originating launch script passes them: FP4 picks bf16 layers by global layer number,
    # and Megatron bounds the counts per pipeline stage only under fp8, so its TransformerConfig
    # accepts 8 on a 4-layer model and on 32 layers in 8 stages of 4.
    r = _fp4_case(tree, case)
    assert _fp4_layers(r) == (True, 2, 8)
    assert r["config_fp4_layers"] == [True, 2, 8]
    assert r["perf_toggles"]["num_layers_at_end_in_bf16"]["source"] == "default"
    assert r["precision"] == "nvfp4"


def test_fp4_selection_with_the_master_switch_off_keeps_megatrons_values(tree):
    r = _fp4_case(tree, "nvfp4_plugin_off")
    assert _fp4_layers(r) == (False, 1, 1) and r["config_fp4_layers"] == [False, 1, 1]
    assert "MEGATRON_PERF_TOGGLES=0" in r["perf_toggles"]["first_last_layers_bf16"]["reason"]
    chosen = _fp4_case(tree, "nvfp4_plugin_off_fp4_env")  # the user's FP4_* variables still apply
    assert _fp4_layers(chosen) == (True, 1, 3) and chosen["config_fp4_layers"] == [True, 1, 3]


def test_fp4_counts_alone_do_not_switch_selection_on(tree):
    r = _fp4_case(tree, "nvfp4_plugin_off_counts")
    assert _fp4_layers(r) == (False, 1, 1)
    assert "[perf-toggles] warning: FP4_BF16_START set" in r["stdout"] and "FP4_SELECTIVE_BF16=1" in r["stdout"]


def test_a_log_dir_tagged_by_a_script_is_not_tagged_again(tree):
    r = ok(tree[2]["tag_by_script"])
    assert r["values"]["tensorboard_dir"].endswith("/exp/bf16/2025-01-01_00-00-00")
    assert "warning: --tensorboard-dir" not in r["stdout"]


def test_a_mislabelled_log_dir_is_warned_and_tagged(tree):
    r = ok(tree[2]["tag_mislabelled"])
    assert r["values"]["tensorboard_dir"].endswith("/exp/fp8/2025-01-01_00-00-00/bf16")
    assert "[perf-toggles] warning: --tensorboard-dir" in r["stdout"] and "'fp8'" in r["stdout"]


@pytest.mark.parametrize("t", TOGGLES, ids=lambda t: t.dest)
def test_env_vars_at_0_1_and_bad(tree, t):
    by_id = tree[2]
    off, on = ("native", "te") if t.kind == "choice" else (False, True)
    r0 = ok(by_id[f"env0:{t.dest}"])
    assert r0["values"][t.dest] == off and r0["perf_toggles"][t.dest]["source"] == "env"
    r1 = ok(by_id[f"env1:{t.dest}"])
    assert r1["perf_toggles"][t.dest]["source"] in ("env", "guard")
    if r1["perf_toggles"][t.dest]["source"] == "env":
        assert r1["values"][t.dest] == on
    bad = by_id[f"envbad:{t.dest}"]
    assert bad.get("exit") == 2 and f"{t.env}='perhaps'" in bad["stderr"]
    assert len(bad["stderr"].strip().splitlines()) == 1


@pytest.mark.parametrize("t", TOGGLES, ids=lambda t: t.dest)
def test_cli_overrides_env_both_directions(tree, t):
    _path, version, by_id = tree
    off, on = ("native", "te") if t.kind == "choice" else (False, True)
    r_off = ok(by_id[f"cli_off_over_env1:{t.dest}"])
    assert r_off["values"][t.dest] == off and r_off["perf_toggles"][t.dest]["source"] == "cli"
    r_on = by_id[f"cli_on_over_env0:{t.dest}"]
    unhonourable = (t.dest == "fused_single_qkv_rope" and version < (0, 15)) or (
        t.dest == "moe_router_fusion" and version < (0, 14))  # no TransformerConfig field there
    if unhonourable:  # refused with one clear line, not crashed later
        assert r_on.get("exit") == 2 and f"{t.flag} " in r_on["stderr"] and "Traceback" not in r_on["stderr"]
        return
    r_on = ok(r_on)
    assert r_on["perf_toggles"][t.dest]["source"] == "cli" and r_on["values"][t.dest] == on


def test_wgrad_fallback_lands_where_megatron_looks(tree):
    r = tree[2]["wgrad_sites"]
    before, after = r["before"], r["after"]
    # Megatron still calls APEX's two entry points by these names, and guards them with this flag.
    assert before["has_flag"] and before["flag"] is False  # no APEX on a CPU test machine
    assert before["calls_fp32"] and before["calls_fp16"] and before["utils_imports_lazily"]
    assert after["flag"] is True and after["module_is_fallback"] and after["lazy_import_is_fallback"]


def test_resume_keeps_the_grad_dtype_the_optimizer_checkpoint_is_keyed_by(tree):
    # Megatron's torch_dist default for the distributed optimizer: dp_reshardable (keyed by the
    # gradient dtype) from 0.15; before, fully_sharded_model_space (per parameter) with the default
    # fully parallel save.
    _path, version, by_id = tree
    keyed = version[:2] >= (0, 15)
    d = ok(by_id["resume_distopt"])["perf_toggles"]["grad_reduce_in_bf16"]
    assert d["value"] is keyed and d["source"] == ("guard" if keyed else "env")
    if keyed:
        assert "dp_reshardable" in d["reason"] and "(iteration 4)" in d["reason"]
    fresh = ok(by_id["resume_distopt_no_load_optim"])["perf_toggles"]["grad_reduce_in_bf16"]
    assert (fresh["value"], fresh["source"]) == (False, "env")
    # The layout the saving run recorded decides (Megatron loads what was saved).
    free = ok(by_id["resume_recorded_model_space"])["perf_toggles"]["grad_reduce_in_bf16"]
    assert (free["value"], free["source"]) == (False, "env")


# --- plugin defaults against Megatron's rules (issue cases; each failed before its guard) -------


def _stock_why(tree, case: str) -> str:
    r = tree[2][f"stock:{case}"]
    if r.get("error"):
        return r["error"]
    lines = [ln for ln in r.get("stderr", "").splitlines() if "error" in ln.lower()]
    return lines[-1] if lines else f"exit {r.get('exit')}"


def _stock_accepts(tree, case: str) -> bool:
    r = tree[2][f"stock:{case}"]
    return bool(r.get("validated")) and "error" not in r


def test_deterministic_mode_turns_the_fusion_default_off(tree):
    assert _stock_accepts(tree, "deterministic")
    r = ok(tree[2]["deterministic"])
    d = r["perf_toggles"]["cross_entropy_loss_fusion"]
    assert (d["value"], d["source"]) == (False, "guard") and "--deterministic-mode" in d["reason"]


def test_deterministic_mode_with_explicit_fusion_is_one_plugin_line(tree):
    r = tree[2]["deterministic_cli_fusion"]
    assert r.get("exit") == 2 and "Traceback" not in r["stderr"]
    assert "[perf-toggles] error: --cross-entropy-loss-fusion was requested" in r["stderr"]


def test_megatron_fsdp_keeps_fusion_where_megatron_allows_it(tree):
    if not _stock_accepts(tree, "mfsdp_defer"):
        pytest.skip(f"stock {tree[0].name} rejects this Megatron-FSDP layout: {_stock_why(tree, 'mfsdp_defer')}")
    r = ok(tree[2]["mfsdp_defer"])
    assert r["values"]["gradient_accumulation_fusion"] is True


def test_deferred_embedding_wgrad_without_a_wgrad_kernel_is_one_plugin_line(tree):
    assert _stock_accepts(tree, "defer_no_wgrad_kernel")
    r = tree[2]["defer_no_wgrad_kernel"]
    assert r.get("exit") == 2, r.get("error")
    line = [ln for ln in r["stderr"].splitlines() if ln.startswith("[perf-toggles] error:")]
    assert len(line) == 1 and "--defer-embedding-wgrad-compute" in line[0] and "fused_weight_gradient_mlp_cuda" in line[0]


def test_delay_wgrad_under_cuda_graphs_keeps_fusion_or_says_why_not(tree):
    if not _stock_accepts(tree, "delay_graph_fallback"):
        pytest.skip(f"stock {tree[0].name} rejects this layout: {_stock_why(tree, 'delay_graph_fallback')}")
    assert ok(tree[2]["delay_graph_fallback"])["values"]["gradient_accumulation_fusion"] is True
    r = tree[2]["delay_graph_no_wgrad_kernel"]
    if "delay_wgrad_cuda_graph_needs_fusion" not in (detect_rules(tree[0]) or ()):
        assert ok(r)["values"]["gradient_accumulation_fusion"] is False  # no such rule here: fusion may go
        return
    assert r.get("exit") == 2, r.get("error")
    assert "--delay-wgrad-compute" in r["stderr"] and "Traceback" not in r["stderr"]


def test_explicit_fp32_accumulation_survives_validation(tree):
    assert tree[2]["stock:fp32_accumulation"]["values"]["accumulate_allreduce_grads_in_fp32"] is True
    r = ok(tree[2]["fp32_accumulation"])
    assert r["values"]["accumulate_allreduce_grads_in_fp32"] is True
    assert (r["perf_toggles"]["grad_reduce_in_bf16"]["value"], r["perf_toggles"]["grad_reduce_in_bf16"]["source"]) \
        == (False, "guard")


# --- mixture-of-experts toggles (issue 36) ---------------------------------------------------------


def test_moe_toggles_reach_the_transformer_config(tree):
    _path, version, by_id = tree
    r = ok(by_id["moe"])
    pt, cfg = r["perf_toggles"], r["config_moe"]
    assert pt["moe_grouped_gemm"]["source"] == "default" and cfg["moe_grouped_gemm"] is True
    assert pt["moe_permute_fusion"]["source"] == "env" and cfg["moe_permute_fusion"] is False
    if version >= (0, 14):  # the field exists from core 0.14
        assert pt["moe_router_fusion"]["source"] == "default" and cfg["moe_router_fusion"] is True
    else:
        assert pt["moe_router_fusion"]["source"] == "guard" and r["values"]["moe_router_fusion"] is False
        assert "moe_router_fusion" not in cfg or cfg["moe_router_fusion"] is None
    assert "[perf-toggles] moe_grouped_gemm: on (default;" in r["stdout"]


def test_a_dense_model_keeps_megatrons_moe_values_and_the_table_leaves_them_out(tree):
    r = ok(tree[2]["moe_dense"])
    for dest in ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion"):
        assert r["values"][dest] is False
    assert "moe_" not in r["stdout"]


def test_fp16_moe_keeps_grouped_gemm_where_megatron_asserts_bf16(tree):
    _path, version, by_id = tree
    stock = by_id["stock:moe_fp16_grouped_gemm"]
    asserts_bf16 = version < (0, 16)  # validate_args: grouped GEMM for MoE only under bf16, up to 0.15
    assert ("bf16" in (stock.get("error") or "")) is asserts_bf16
    r = ok(by_id["moe_fp16"])
    assert r["values"]["moe_grouped_gemm"] is (not asserts_bf16)
    assert r["perf_toggles"]["moe_grouped_gemm"]["source"] == ("guard" if asserts_bf16 else "default")
