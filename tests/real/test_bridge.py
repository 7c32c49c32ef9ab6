"""The Megatron-Bridge front end against real Bridge recipes (CPU; Transformer Engine stood in for).

Bridge needs its own Python (3.12 for 0.6.x), so the cases run in one subprocess of
``BRIDGE_PYTHON``, an interpreter with ``megatron-bridge`` installed (``.ci/run`` builds one
where it can). Megatron's core comes from that interpreter or, first, from a Megatron-LM tree:
``BRIDGE_MEGATRON_TREE``, else the ``main`` tree of ``MEGATRON_LM_TREES``. Skipped, saying how
to enable it, when either is missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import broken_te
import pytest
import tree_driver
from conftest import REPO, last_line

from megatron_perf_toggles.runtime.machine.capabilities import effective_assume
from megatron_perf_toggles.runtime.machine.target import make_target

H100_64 = make_target(64, gpu="h100")
QWEN3 = "megatron.bridge.recipes.qwen.h100.qwen3.qwen3_600m_pretrain_1gpu_h100_bf16_config"
MISSPELT = "megatron.bridge.recipes.llama:llama3_8b_pretrain_confg"  # one letter off the recipe users name
QWEN3_SFT = "megatron.bridge.recipes.qwen.h100.qwen3.qwen3_600m_sft_1gpu_h100_bf16_config"
ENABLE = ("set BRIDGE_PYTHON to a Python 3.12 with megatron-bridge installed (pip install --no-deps "
          "megatron-bridge; .ci/run builds one where Python 3.12 is found)")

CASES = {
    "defaults": {"recipe": QWEN3},
    "core_0_18_0": {"recipe": QWEN3, "planned_megatron": "0.18.0"},
    "core_0_18_2": {"recipe": QWEN3, "planned_megatron": "0.18.2"},
    "per_token_loss": {"recipe": QWEN3, "edits": {"model.calculate_per_token_loss": True}},
    "grad_reduce_off": {"recipe": QWEN3, "env": {"GRAD_REDUCE_IN_BF16": "0"}},
    "plugin_off": {"recipe": QWEN3, "env": {"MEGATRON_PERF_TOGGLES": "0"}},
    "explicit_te": {"recipe": QWEN3, "explicit": ["model.cross_entropy_fusion_impl"]},
    "explicit_both": {"recipe": QWEN3, "explicit": ["model.cross_entropy_fusion_impl", "cross_entropy_loss_fusion"]},
    "nvfp4": {"recipe": QWEN3, "edits": {"mixed_precision": "bf16_with_nvfp4_mixed"}},
    "nvfp4_recipe_layers": {"recipe": QWEN3, "edits": {"mixed_precision": "nemotron_3_super_bf16_with_nvfp4_mixed"}},
    "nvfp4_all_layers": {"recipe": QWEN3, "edits": {"mixed_precision": "bf16_with_nvfp4_mixed"},
                         "env": {"FP4_SELECTIVE_BF16": "0"}},
    "audio_provider": {"recipe": QWEN3, "model": ["megatron.bridge.models.qwen_audio.qwen2_audio_provider."
                                                  "Qwen2AudioModelProvider",
                                                  {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}]},
    "sft_packed": {"recipe": QWEN3_SFT, "edits": {"model.qk_layernorm": False}},  # offline packing: THD
    "sft_unpacked": {"recipe": QWEN3_SFT, "edits": {"model.qk_layernorm": False, "dataset.enable_offline_packing": False,
                                                    "dataset.offline_packing_specs": None}},
    "world_8": {"recipe": QWEN3, "env": {"WORLD_SIZE": "8"}},
    "env_impl": {"recipe": QWEN3, "env": {"CROSS_ENTROPY_FUSION_IMPL": "native", "CROSS_ENTROPY_LOSS_FUSION": "0"}},
    # Run-time protections: Bridge's own validation (runtime_config_update), the history a resume reads,
    # the cross-rank check at init_process_group.
    "validated": {"recipe": QWEN3, "validate": True, "rank_check": True},
    "late_gate": {"recipe": QWEN3, "edits": {"model.qk_layernorm": False}, "validate": True,
                  "late_edits": {"model.attention_output_gate": True}},  # set after apply: no guard saw it
    "late_gate_off": {"recipe": QWEN3, "edits": {"model.qk_layernorm": False}, "validate": True,
                      "late_edits": {"model.attention_output_gate": True}, "env": {"MEGATRON_PERF_TOGGLES": "0"}},
    "resume_changed": {"recipe": QWEN3, "resume": {}, "env": {"CROSS_ENTROPY_LOSS_FUSION": "0"}},
    "resume_same": {"recipe": QWEN3, "resume": {}},
    # The checkpoint saved a bf16 gradient buffer keyed by dtype: another one cannot load.
    "resume_layout_env": {"recipe": QWEN3, "resume": {}, "env": {"GRAD_REDUCE_IN_BF16": "0"}},
    "resume_layout_explicit": {"recipe": QWEN3, "resume": {}, "edits": {"ddp.grad_reduce_in_fp32": True},
                               "explicit": ["ddp.grad_reduce_in_fp32"]},
    # explain's plan of a 64-GPU H100 job, and apply on the same recipe where that job runs (the
    # planned stack of an H100, as MEGATRON_PERF_TOGGLES_ASSUME names it there; WORLD_SIZE 64).
    "explain_64": {"explain": ["--bridge-recipe", QWEN3.replace(".qwen3.", ".qwen3:"), "--world-size", "64",
                               "--gpu", "h100", "--json"]},
    "apply_64": {"recipe": QWEN3, "build": True,
                 "env": {"WORLD_SIZE": "64", "MEGATRON_PERF_TOGGLES_ASSUME": effective_assume(None, H100_64)}},
}


def _tree() -> Path | None:
    named = tree_driver.SESSION.environ.get("BRIDGE_MEGATRON_TREE")
    if named:
        return Path(named)
    trees = [Path(t) for t in tree_driver.trees()]  # as the session started: this runs beside the tests
    return next((t for t in trees if t.name == "main"), trees[-1] if trees else None)


def _run(cases: dict, tree: Path | None) -> dict:
    environ = tree_driver.SESSION.environ  # as the session started: this runs beside the unit tests
    python = environ.get("BRIDGE_PYTHON")
    if not python:
        pytest.skip(f"Megatron-Bridge suite: {ENABLE}")
    env = {k: v for k, v in environ.items() if not k.startswith(("MEGATRON_PERF_TOGGLES", "FP4_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree) if tree else "", str(REPO)) if p)
    # Its environment comes with its own bytecode: the session's bytecode directory (conftest) would
    # have Python 3.12 compile all of it again. Nothing is written into the tree either way.
    env.pop("PYTHONPYCACHEPREFIX", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # A recipe's checkpoint directory is relative ("nemo_experiments/..."): the resume history the
    # plugin writes there lands in a scratch directory, never in the checkout.
    with tempfile.TemporaryDirectory(prefix="bridge-cases-") as scratch:
        proc = subprocess.run([python, str(REPO / "tests" / "bridge_driver.py")],
                              input=json.dumps(list(cases.values())), capture_output=True, text=True, env=env,
                              timeout=600, cwd=scratch)
    if proc.returncode != 0 or not proc.stdout.strip():
        pytest.fail(f"bridge driver failed ({proc.returncode}): {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    if "import_error" in out:
        pytest.skip(f"Megatron-Bridge does not import under {python} with {tree or 'its own megatron-core'}: "
                    f"{last_line(out['import_error'])}")
    return dict(zip(cases, out["results"], strict=True))


# Both runs start with the session's workers (tests/tree_driver.py), beside the unit tests.
RUNS = tree_driver.SESSION.background("bridge", lambda: _run(CASES, _tree()), real=False)
# The same recipe with no Megatron-LM tree: the megatron-core installed beside Bridge (PyPI's
# wheel, which ships megatron.training too).
INSTALLED = tree_driver.SESSION.background("bridge-installed-core", lambda: _run({"defaults": CASES["defaults"]}, None),
                                           real=False)


def _explain_commands() -> list[dict]:
    """``megatron-perf-toggles explain --bridge-recipe`` as a user runs it on a CPU machine with Bridge
    and no Transformer Engine (the package's own stand-in, not the tests'), in the Bridge interpreter."""
    environ = tree_driver.SESSION.environ
    python = environ.get("BRIDGE_PYTHON")
    if not python:
        pytest.skip(f"Megatron-Bridge suite: {ENABLE}")
    tree = _tree()
    out = []
    with tempfile.TemporaryDirectory(prefix="bridge-explain-") as scratch:
        hf = Path(scratch) / "hf"
        subprocess.run([python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import bridge_driver; "
                        "bridge_driver._offline_hf_cache(sys.argv[2])", str(REPO / "tests"), str(hf)], check=True,
                       timeout=120)
        env = {k: v for k, v in environ.items() if not k.startswith(("MEGATRON_PERF_TOGGLES", "PYTHONPYCACHE"))}
        env.update(PYTHONPATH=os.pathsep.join(p for p in (str(tree) if tree else "", str(REPO)) if p),
                   PYTHONDONTWRITEBYTECODE="1", COLUMNS="100", HF_HOME=str(hf), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1")
        recipe = QWEN3.replace(".qwen3.", ".qwen3:")
        # the empty transformer-engine meta package, first on the path: a plan for another machine
        # does not rest on it
        broken = os.pathsep.join([str(broken_te.meta_package(Path(scratch) / "broken-te")), env["PYTHONPATH"]])
        for extra, more in (([recipe, "--world-size", "64", "--gpu", "h100"], {}),
                            ([recipe, "--world-size", "8", "--", "no_such_keyword=1"], {}),
                            ([recipe, "--world-size", "64", "--gpu", "h100"], {"PYTHONPATH": broken}),
                            ([MISSPELT, "--world-size", "8"], {})):
            proc = subprocess.run([python, "-m", "megatron_perf_toggles", "explain", "--bridge-recipe", *extra],
                                  capture_output=True, text=True, env={**env, **more}, timeout=600, cwd=scratch)
            out.append({"code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr})
    return out


EXPLAIN = tree_driver.SESSION.background("bridge-explain", _explain_commands, real=False)


def results() -> dict:
    return tree_driver.SESSION.outcome(RUNS)


def installed_core_results() -> dict:
    return tree_driver.SESSION.outcome(INSTALLED)


def case(name: str) -> dict:
    result = results()[name]
    assert "crash" not in result, result.get("crash")
    return result


def test_qk_layernorm_recipe_gets_fused_qkv_rope_off_with_reason():
    r = case("defaults")
    assert r["before"]["model.qk_layernorm"] is True
    d = r["decisions"]["fused_single_qkv_rope"]
    assert (d["value"], d["source"]) == (False, "guard")
    # In Bridge's words: the field the recipe set, not Megatron's flag for it.
    assert "cfg.model.qk_layernorm" in d["reason"] and "--" not in d["reason"]
    assert r["after"]["model.fused_single_qkv_rope"] is False


def test_packed_sequences_turn_fused_qkv_rope_off():
    # Bridge's SFT recipe packs sequences (THD), which the fused path asserts against at the first
    # forward; q/k layer norm is turned off here so that packing is the only blocker.
    packed, unpacked = case("sft_packed"), case("sft_unpacked")
    assert packed["before"]["model.qk_layernorm"] is False
    d = packed["decisions"]["fused_single_qkv_rope"]
    assert (d["value"], d["source"]) == (False, "guard") and "packed (THD) sequences" in d["reason"]
    assert packed["after"]["model.fused_single_qkv_rope"] is False
    assert unpacked["decisions"]["fused_single_qkv_rope"]["value"] is True


@pytest.mark.parametrize("name, expected", [("defaults", "native"), ("core_0_18_2", "native"), ("core_0_18_0", "te")])
def test_te_cross_entropy_becomes_native_from_core_0_18_2(name, expected):
    r = case(name)
    assert r["before"]["model.cross_entropy_fusion_impl"] == "te"  # the recipe's own choice
    assert r["after"]["model.cross_entropy_fusion_impl"] == expected
    assert r["after_setup"]["model.cross_entropy_fusion_impl"] == expected
    d = r["decisions"]["cross_entropy_fusion_impl"]
    if expected == "native":
        assert d["source"] == "guard" and "stability" in d["reason"]
        assert any("overridden to native" in m for m in r["messages"])  # the recipe's value was changed
    else:
        assert d["source"] == "config" and "cfg.model.cross_entropy_fusion_impl" in d["reason"]


def test_average_in_collective_goes_off_with_per_token_loss():
    base, r = case("defaults"), case("per_token_loss")
    assert base["after"]["ddp.average_in_collective"] is True
    assert base["decisions"]["ddp_average_in_collective"]["source"] == "config"  # the base recipe turns it on
    d = r["decisions"]["ddp_average_in_collective"]
    assert (d["value"], d["source"]) == (False, "guard") and "cfg.model.calculate_per_token_loss" in d["reason"]
    assert r["after"]["ddp.average_in_collective"] is False


def test_grad_reduce_in_bf16_off_leaves_both_fields_in_fp32():
    on, off = case("defaults"), case("grad_reduce_off")
    for field in ("ddp.grad_reduce_in_fp32", "mixed_precision.grad_reduce_in_fp32"):
        assert on["after"][field] is False and on["after_setup"][field] is False
        assert off["after"][field] is True and off["after_setup"][field] is True
    assert off["decisions"]["grad_reduce_in_bf16"]["reason"] == "GRAD_REDUCE_IN_BF16=0"


def test_switched_off_changes_no_field():
    r = case("plugin_off")
    # The recipe names its mixed precision ("bf16_mixed"), so its fields exist only once resolved.
    changed = {f for f in r["before"] if r["before"][f] is not None and r["before"][f] != r["after"][f]}
    assert not changed
    assert r["after"]["mixed_precision.grad_reduce_in_fp32"] is True  # bf16_mixed's own value stands


def test_explicit_te_is_held_like_a_command_line_flag():
    # As on the argparse path: te named explicitly stays, and the fusion (not named) yields instead.
    r = case("explicit_te")
    assert r["after"]["model.cross_entropy_fusion_impl"] == "te"
    assert r["after"]["model.cross_entropy_loss_fusion"] is False
    assert r["decisions"]["cross_entropy_fusion_impl"]["source"] == "cli"
    assert "named explicitly (cfg.model.cross_entropy_fusion_impl)" in r["decisions"]["cross_entropy_fusion_impl"]["reason"]


def test_explicit_fusion_and_te_are_refused_in_one_line():
    r = case("explicit_both")
    assert "CannotHonourError" in r["error"] and "\n" not in r["error"]
    assert "cfg.model.cross_entropy_fusion_impl te was requested" in r["error"] and " --" not in r["error"]


def test_a_model_providers_own_setting_is_kept():
    # Bridge's Qwen2-Audio provider declares gradient-accumulation fusion off for its model: the
    # plugin keeps it (a choice, although it equals Megatron's own default), as it keeps a recipe's.
    r = case("audio_provider")
    d = r["decisions"]["gradient_accumulation_fusion"]
    assert (d["value"], d["source"]) == (False, "config")
    assert r["after"]["model.gradient_accumulation_fusion"] is False


def test_environment_outranks_the_recipe():
    r = case("env_impl")
    assert r["after"]["model.cross_entropy_fusion_impl"] == "native"
    assert r["after"]["model.cross_entropy_loss_fusion"] is False
    assert r["decisions"]["cross_entropy_loss_fusion"]["source"] == "env"


FP4_FIELDS = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")


@pytest.mark.parametrize("name, expected, sources", [
    ("nvfp4", (True, 2, 8), ("default", "default", "default")),  # the nvfp4 recipe's selection
    ("nvfp4_recipe_layers", (True, 2, 14), ("config", "default", "config")),  # Bridge's recipe set two of them
    ("nvfp4_all_layers", (False, 0, 0), ("env",)),  # counts unused with selection off: left as they were
])
def test_fp4_layer_fields_in_mixed_precision_and_model(name, expected, sources):
    r = case(name)
    for section in ("mixed_precision", "model"):
        assert tuple(r["after_setup"][f"{section}.{f}"] for f in FP4_FIELDS[:len(sources)]) == expected[:len(sources)]
    assert tuple(r["decisions"][f]["source"] for f in FP4_FIELDS[:len(sources)]) == sources
    assert tuple(r["after"][f"mixed_precision.{f}"] for f in FP4_FIELDS) == expected


def test_installed_megatron_core_without_training_package():
    r = installed_core_results()["defaults"]
    assert "crash" not in r, r.get("crash")
    megatron = r["record"]["capabilities"]["megatron"]
    assert megatron["version"] == r["megatron_version"] and megatron["rules"]
    tree = _tree()
    assert tree is None or not str(megatron["path"] or "").startswith(str(tree))  # not the tree's
    # a release with a local part where Megatron stamps the enclosing checkout's commit ("0.19.2+abc1234")
    release = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)\.(\d+)", r["megatron_version"]).groups())
    expected = "native" if release >= (0, 18, 2) else "te"
    assert r["after"]["model.cross_entropy_fusion_impl"] == expected


def test_memory_model_reads_bridges_model_fields():
    # bf16 gradient reduction saves 2 B per parameter on the rank: the parameters the memory model
    # counts must be Qwen3-0.6B's (SwiGLU, grouped-query attention, tied embedding; from the fixture's
    # Hugging Face config, layer norms left out), as Megatron's --swiglu, --group-query-attention and
    # --untie-embeddings-and-output-weights describe it on the argparse path.
    hf = json.loads((REPO / "tests" / "fixtures" / "hf" / "Qwen3-0.6B" / "config.json").read_text())
    h, heads, kv, dim = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    layer = 2 * h * heads * dim + 2 * h * kv * dim + 3 * h * hf["intermediate_size"]
    params = hf["num_hidden_layers"] * layer + hf["vocab_size"] * h
    delta = case("defaults")["record"]["memory"]["peak_memory_delta_mb"]["grad_reduce_in_bf16"]
    assert abs(-delta * 2**20 / 2 - params) / params < 0.01


def test_memory_model_takes_the_data_parallel_size_from_the_world_size():
    # As Megatron's parse_args reads WORLD_SIZE: eight ranks of a TP=PP=1 recipe shard the
    # distributed optimizer's state eight ways, so stock's weights and optimizer state shrink.
    one, eight = (case(n)["record"]["memory"]["stock_parts_mb"]["weights_and_optimizer"] for n in ("defaults", "world_8"))
    assert eight < one * 0.6


def test_record_and_table_are_the_argparse_paths():
    r = case("defaults")
    assert r["record"]["decisions"] == r["decisions"]
    assert r["record"]["package"] == "megatron-perf-toggles"
    assert any(line.startswith("[perf-toggles] fused_single_qkv_rope: off (guard;") for line in r["table"])
    assert r["record"]["capabilities"]["megatron"]["version"] == r["megatron_version"]


def test_bridge_validation_passes_with_the_plugin_and_the_rank_check_runs():
    r = case("validated")
    assert r["validated"] is True
    assert r["fingerprint"]["toggles"] == {d: rec["value"] for d, rec in r["decisions"].items()}
    assert r["rank_check"] == {"armed": True, "checked": True}


def test_safety_net_backs_off_a_default_bridges_validation_rejects():
    # Gated attention set after apply: no guard saw it, and Megatron's TransformerConfig (built in
    # Bridge's validation) rejects fused single-QKV RoPE with it. Stock values pass: the net turns
    # the plugin default back, says so, and validation goes on.
    r, stock = case("late_gate"), case("late_gate_off")
    assert stock["validated"] is True and stock["after_validate"]["model.fused_single_qkv_rope"] is False
    assert r["after"]["model.fused_single_qkv_rope"] is True  # the plugin default, as planned
    assert r["validated"] is True, r["validated"]
    assert r["after_validate"]["model.fused_single_qkv_rope"] is False
    assert any("fused_single_qkv_rope: off (guard; Bridge's validation rejected the plugin default" in line
               for line in r["table_after_validate"])
    assert r["history"][-1]["decisions"]["fused_single_qkv_rope"] is False  # this launch's line, rewritten


def test_resume_history_and_a_changed_toggle_warn_as_argparse_does():
    changed, same = case("resume_changed"), case("resume_same")
    assert len(changed["history"]) == 2 and changed["history"][0]["start_iteration"] == 0
    assert changed["history"][1]["start_iteration"] == 100
    warning = [m for m in changed["messages"] if m.startswith("resuming from")]
    assert warning and "cross_entropy_loss_fusion on -> off" in warning[0]
    assert not [m for m in same["messages"] if m.startswith("resuming from")]


def test_a_resume_the_checkpoint_layout_cannot_take_is_kept_or_refused_as_on_argparse():
    # As on the argparse path: an environment value yields to the checkpoint with a warning; an
    # explicit request is refused, in one line, in Bridge's words.
    kept, refused = case("resume_layout_env"), case("resume_layout_explicit")
    d = kept["decisions"]["grad_reduce_in_bf16"]
    assert (d["value"], d["source"]) == (True, "guard") and "saved with a bf16 gradient buffer" in d["reason"]
    assert kept["after"]["ddp.grad_reduce_in_fp32"] is False
    assert "CannotHonourError: cfg.mixed_precision.grad_reduce_in_fp32 = True was requested" in refused["error"]
    assert "cfg.checkpoint.load_optim = False" in refused["error"] and "--" not in refused["error"]


def test_explain_plans_the_recipe_as_apply_decides_it():
    plan, applied = case("explain_64"), case("apply_64")
    assert plan["code"] == 0
    record = plan["explain"]
    assert record["target"]["world_size"] == 64 and record["stack"]
    assert record["decisions"] == applied["decisions"]  # value, source, reason and memory, toggle by toggle
    assert record["precision"] == applied["record"]["precision"]
    # The recipe assigns grad_reduce_in_fp32=True itself: its value, although Bridge's default, stands.
    d = record["decisions"]["grad_reduce_in_bf16"]
    assert (d["value"], d["source"]) == (False, "config") and "grad_reduce_in_fp32 = True" in d["reason"]


def test_explain_bridge_recipe_on_a_cpu_machine_fits_a_screen():
    planned, broken, _, _ = tree_driver.SESSION.outcome(EXPLAIN)
    assert planned["code"] == 0, planned["stderr"][-2000:]
    lines = planned["stdout"].splitlines()
    assert len(lines) <= 50 and max(len(line) for line in lines) <= 100, planned["stdout"]
    assert "world 64 (--world-size 64), h100" in planned["stdout"]
    assert any(line.startswith("fused_single_qkv_rope") and " off " in line for line in lines)
    # A recipe that cannot be built here: one line, exit 2.
    assert broken["code"] == 2 and broken["stdout"] == ""
    said = broken["stderr"].strip().splitlines()
    assert len(said) == 1 and "takes no keyword argument 'no_such_keyword'" in said[0], broken["stderr"][-2000:]
    assert "it takes" in said[0]  # the fix: what the recipe takes


def test_explain_shows_the_recipes_layout():
    planned = tree_driver.SESSION.outcome(EXPLAIN)[0]
    layout = next(line for line in planned["stdout"].splitlines() if line.startswith("Layout:"))
    assert "TP 1, PP 1, CP 1, EP 1, DP 64 (world 64)" in layout  # Qwen3 0.6B's recipe: one GPU per replica


def test_a_recipe_plans_for_another_machine_with_the_empty_te_meta_package_installed():
    """``pip install transformer-engine`` alone leaves a package whose import raises; planning a
    recipe for an H100 refused with "Found empty `transformer-engine` meta package installed"."""
    plain, _, beside_broken_te, _ = tree_driver.SESSION.outcome(EXPLAIN)
    assert beside_broken_te["code"] == 0, beside_broken_te["stderr"][-2000:]
    assert beside_broken_te["stdout"] == plain["stdout"]  # the same plan as without it


def test_a_recipe_one_letter_off_gets_the_one_it_meant_from_the_installed_bridge():
    misspelt = tree_driver.SESSION.outcome(EXPLAIN)[3]
    said = misspelt["stderr"].strip().splitlines()
    assert misspelt["code"] == 2 and len(said) == 1, misspelt["stderr"][-2000:]
    assert "did you mean 'megatron.bridge.recipes.llama:llama3_8b_pretrain_config'?" in said[0]


if __name__ == "__main__":  # pragma: no cover - a quick look at the driver's output
    json.dump(results(), sys.stdout, indent=1, default=str)
