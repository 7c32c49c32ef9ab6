"""MEGATRON_PERF_TOGGLES=0 is stock Megatron: nothing patched, refused, or reported as a change;
where stock itself would fail, a note says so and explain still exits 0."""

from __future__ import annotations

import json

import pytest

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
