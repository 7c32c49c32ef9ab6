"""MEGATRON_PERF_TOGGLES=0 is stock Megatron: nothing patched, refused, or reported as a change;
where stock itself would fail, a note says so and explain still exits 0."""

from __future__ import annotations

import json

import pytest
from conftest import LLAMA_ARGS, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.tools import cli

MOE = ["--num-experts", "8", "--moe-permute-fusion", "--num-layers", "2", "--hidden-size", "64",
       "--num-attention-heads", "4"]


pytestmark = pytest.mark.usefixtures("clean_environment")


def _explain(capsys, *argv: str) -> tuple[int, dict, str]:
    try:
        code = cli.main(["explain", "--json", *argv])
    except SystemExit as done:
        code = int(done.code or 0)
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else {}), out.err


def test_off_reports_no_change_and_notes_where_stock_would_fail(capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES", "0")
    code, record, _ = _explain(capsys)  # the built-in Llama-3-8B on an H100's planned stack: no APEX
    assert code == 0
    assert record["wgrad_path"] == "missing"  # no torch fallback is installed: that would be a patch
    deltas = record["memory"]["peak_memory_delta_mb"]
    assert all(mb in (0, None) for mb in deltas.values()), deltas
    assert record["memory"]["total_peak_memory_delta_mb"] in (0, None)
    assert record["memory"]["planned_peak_mb"] == record["memory"]["stock_peak_mb"]
    assert all(d["source"] != "guard" for d in record["decisions"].values())
    notes = [m["text"] for m in record["messages"] if m["level"] == "note"]
    assert len(notes) == 1 and "stock Megatron would fail here" in notes[0]


def test_on_the_same_plan_is_a_change_through_the_fallback(capsys):
    code, record, _ = _explain(capsys)
    assert code == 0 and record["wgrad_path"] == "fallback"
    assert record["memory"]["peak_memory_delta_mb"]["gradient_accumulation_fusion"] > 0
    assert not [m for m in record["messages"] if m["level"] == "note"]


def test_off_leaves_an_explicit_request_to_megatron(capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES_ASSUME", "none")  # no Transformer Engine: no fused permutation
    code, _, err = _explain(capsys, "--world-size", "8", "--", *MOE)
    assert code == 2 and "--moe-permute-fusion was requested" in err  # on: the plugin refuses it
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES", "0")
    code, record, err = _explain(capsys, "--world-size", "8", "--", *MOE)
    assert code == 0, err
    decision = record["decisions"]["moe_permute_fusion"]
    assert decision["value"] is True and decision["source"] == "cli"


# --- off is stock on every front end: no log-directory tag, each value labelled by where stock takes it --

LOG_DIRS = ["--bf16", "--tensorboard-dir", "/tmp/tb", "--wandb-save-dir", "/tmp/wandb/fp8"]


def test_off_tags_no_log_directory_and_warns_of_no_tag(capsys, monkeypatch):
    """The namespace a plan with the plugin off hands Megatron holds the directories as given (the
    bf16 tag and the mislabelled fp8 path alike), and the plan says why they are untagged."""
    code, on, _ = _explain(capsys, "--", *LOG_DIRS)
    assert code == 0 and on["log_dirs"] == {"tensorboard_dir": "/tmp/tb/bf16", "wandb_save_dir": "/tmp/wandb/fp8/bf16"}
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES", "0")
    code, off, _ = _explain(capsys, "--", *LOG_DIRS)
    assert code == 0 and off["log_dirs"] == {}
    assert not [m for m in off["messages"] if "names precision" in m["text"]]  # no "logging to ... instead"
    assert cli.main(["explain", "--", *LOG_DIRS]) == 0
    shown = capsys.readouterr().out
    assert "tensorboard_dir: /tmp/tb\n" in shown and "wandb_save_dir: /tmp/wandb/fp8\n" in shown
    assert "(log directories not tagged: MEGATRON_PERF_TOGGLES=0)" in shown


def test_decide_with_the_plugin_off_leaves_the_log_directories_to_stock(env):
    args = {**LLAMA_ARGS, "tensorboard_dir": "/tmp/tb"}
    assert decide(args, {}, env(), full_caps()).log_dirs == {"tensorboard_dir": "/tmp/tb/bf16"}
    assert decide(args, {}, env(MEGATRON_PERF_TOGGLES=0), full_caps()).log_dirs == {}
    assert decide(args, {}, env(MEGATRON_PERF_TOGGLES_TAG_LOG_DIR=0), full_caps()).log_dirs == {}


def test_the_stack_names_the_wgrad_fallback_only_where_the_plugin_installs_it(capsys, monkeypatch):
    """A plan for an H100 (no APEX in its planned stack): on, the torch fallback stands in; off,
    none is installed, and the stack line says so as the note below it does."""
    def stack() -> tuple[str, str]:
        code, record, _ = _explain(capsys)
        assert code == 0 and cli.main(["explain"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Stack:"))
        return record["stack"], line

    on = stack()
    assert all("no APEX (torch wgrad fallback)" in text for text in on), on
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES", "0")
    off = stack()
    assert all("no APEX, no wgrad fallback" in text and "torch wgrad fallback" not in text for text in off), off


def test_off_labels_a_front_ends_stock_values_by_where_they_come_from(env):
    """A front end's value nobody set is labelled by where stock takes it (its own default, here a
    Primus YAML default), never as Megatron's; a value its configuration set keeps the config tier,
    and with the plugin off no guard moves it (stock's checks judge it)."""
    from megatron_perf_toggles.core.decision.plan import Decision

    stock = {"gradient_accumulation_fusion": False, "fused_single_qkv_rope": True}
    where = {"gradient_accumulation_fusion": "Primus's default (YAML key gradient_accumulation_fusion: false)"}
    preset = {"fused_single_qkv_rope": Decision(True, "config", "set in the configuration (YAML key x)")}
    args = {**LLAMA_ARGS, "position_embedding_type": "learned_absolute"}  # not RoPE: a guard wants it off
    off = decide(args, {}, env(MEGATRON_PERF_TOGGLES=0), full_caps(), stock, preset=preset, stock_from=where)
    gaf = off.decisions["gradient_accumulation_fusion"]
    assert (gaf.value, gaf.source) == (False, "default")
    assert gaf.reason == "MEGATRON_PERF_TOGGLES=0: Primus's default (YAML key gradient_accumulation_fusion: false)"
    rope = off.decisions["fused_single_qkv_rope"]
    assert (rope.value, rope.source) == (True, "config") and "left as given although" in rope.reason
    assert off.decisions["grad_reduce_in_bf16"].reason == "MEGATRON_PERF_TOGGLES=0: Megatron's own default"
    on = decide(args, {}, env(), full_caps(), stock, preset=preset, stock_from=where)
    assert (on.decisions["fused_single_qkv_rope"].value, on.decisions["fused_single_qkv_rope"].source) == (False, "guard")


def test_off_on_a_bridge_recipe_from_the_catalog_tags_nothing_and_names_the_configurations_fields(capsys,
                                                                                                  monkeypatch):
    recipe = ["--bridge-recipe", "megatron.bridge.recipes.llama:llama3_8b_pretrain_config", "--world-size", "64",
              "--gpu", "h100"]
    code, on, err = _explain(capsys, *recipe)
    assert code == 0, err
    assert on["log_dirs"]["tensorboard_dir"].endswith("/bf16")
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES", "0")
    code, off, err = _explain(capsys, *recipe)
    assert code == 0, err
    assert off["log_dirs"] == {}
    defaults = {d: r["reason"] for d, r in off["decisions"].items() if r["source"] == "default"}
    assert defaults["fused_single_qkv_rope"] == ("MEGATRON_PERF_TOGGLES=0: the configuration's default "
                                                 "(cfg.model.fused_single_qkv_rope)")
    assert all(r["source"] in ("config", "default") for r in off["decisions"].values())
