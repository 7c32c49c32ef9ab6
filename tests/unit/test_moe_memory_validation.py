"""bench/moe_memory_validation.py: each ablate arm's planned peak against its measured one, on stand-in
results shaped as ablate writes them (rows with max_allocated_mb, each arm's command and environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from megatron_perf_toggles.core.registry import TOGGLES

sys.path.insert(0, str(REPO / "bench"))
import moe_memory_validation as mmv

# the run mode's shape, without the flag its stock runs need (no APEX): the plugin's arms choose that toggle
ARGV = [w for w in [*mmv.COMMON, *mmv.SHAPES["mixtral-a"], "--train-iters", "20"] if w != "--no-gradient-accumulation-fusion"]
CAPS = {"te_version": "2.20.2", "apex_fused_wgrad": False, "megatron": {"asserts_te_cross_entropy": True}}
ALL_OFF = {t.env: "0" for t in TOGGLES}


def command(env: dict[str, str], *flags: str) -> dict:
    return {"env": env, "argv": ["python3", "-m", "megatron_perf_toggles.run", "/path/to/Megatron-LM/pretrain_gpt.py",
                                 *ARGV, *flags]}


def results(stock_mb: float, grouped_mb: float) -> dict:
    """Stock (every plugin toggle off) and grouped GEMM added to it, with these measured peaks."""
    return {"rows": [{"arm": "stock", "baseline": True, "max_allocated_mb": stock_mb},
                     {"arm": "grouped-gemm", "baseline": False, "max_allocated_mb": grouped_mb},
                     {"arm": "crashed", "baseline": False, "max_allocated_mb": None}],
            "commands": {"stock": command(ALL_OFF), "grouped-gemm": command(ALL_OFF, "--moe-grouped-gemm"),
                         "crashed": command(ALL_OFF)},
            "versions": {"capabilities": CAPS}}


def test_arm_values_follow_the_launch_environment_and_flags():
    plugin = ["python3", "-m", "megatron_perf_toggles.run", "pretrain_gpt.py", *ARGV]
    defaults = mmv.arm_values(plugin, {}, {}, apex=False, impl="native")
    assert all(defaults[t.dest] == t.default for t in TOGGLES if t.dest != "cross_entropy_fusion_impl")
    off = mmv.arm_values(plugin, ALL_OFF, {}, apex=False, impl="native")
    assert not any(off[t.dest] for t in TOGGLES if t.kind == "bool")
    moe = mmv.arm_values(plugin, {**ALL_OFF, "MOE_ROUTER_FUSION": "1"}, {}, apex=False, impl="native")
    assert (moe["moe_router_fusion"], moe["moe_grouped_gemm"]) == (True, False)
    flagged = mmv.arm_values([*plugin, "--moe-permute-fusion"], ALL_OFF, {}, apex=False, impl="native")
    assert flagged["moe_permute_fusion"] is True
    stock = mmv.arm_values(["python3", "pretrain_gpt.py", *ARGV], {}, {}, apex=False, impl="native")
    assert not stock["gradient_accumulation_fusion"] and not stock["moe_grouped_gemm"]  # Megatron's own values


def test_report_compares_planned_and_measured_peaks():
    stock_planned = mmv.report_file("x/results.json", results(1.0, 1.0))[0]["planned_mb"]
    rows = mmv.report_file("x/results.json", results(stock_planned * 1.05, stock_planned * 1.05 + 117))
    assert [r["arm"] for r in rows] == ["stock", "grouped-gemm"]  # the run without a peak has no row
    stock, grouped = rows
    assert stock["within"] and grouped["within"]
    assert stock["error_mb"] == pytest.approx(stock_planned - stock_planned * 1.05, abs=0.2)
    assert grouped["moe_values"]["moe_grouped_gemm"] and not stock["moe_values"]["moe_grouped_gemm"]
    # grouped GEMM: four 32 MiB cuBLAS workspaces against the 117 MB measured, within 25 % of 117
    assert grouped["change"] == {"against": "stock", "planned_mb": 128.0, "measured_mb": 117.0, "tolerance_mb": 29.2,
                                 "within": True, "wrong_sign": False}
    missed = mmv.report_file("x/results.json", results(stock_planned * 1.3, stock_planned * 1.3))
    assert not missed[0]["within"] and missed[0]["error_pct"] < -15


@pytest.mark.parametrize(("measured_change", "within", "wrong_sign"), [
    (-53.0, False, True),  # planned +128, measured -53: the wrong sign, far beyond 16 MB
    (60.0, False, False),  # half the planned change: beyond 25 % of 60 (16 MB, the larger)
    (140.0, True, False),  # 12 MB off, within 25 % of 140 (35 MB)
    (300.0, False, False)])  # within the peaks' 300 MB, not within 25 % of the change (75 MB)
def test_a_change_against_the_baseline_has_a_tolerance_of_its_own_size(measured_change, within, wrong_sign):
    stock_planned = mmv.report_file("x/results.json", results(1.0, 1.0))[0]["planned_mb"]
    rows = mmv.report_file("x/results.json", results(stock_planned, stock_planned + measured_change))
    change = rows[1]["change"]
    assert change["tolerance_mb"] == round(max(0.25 * abs(measured_change), 16), 1)
    assert (change["within"], change["wrong_sign"]) == (within, wrong_sign)
    text = mmv.markdown(rows)
    assert ("(NO, wrong sign)" in text) == wrong_sign and ("(yes)" in text) == within


def test_report_command_writes_json_and_markdown_without_machine_paths(tmp_path):
    stock_planned = mmv.report_file("x/results.json", results(1.0, 1.0))[0]["planned_mb"]
    run_dir = tmp_path / "speed-a"
    run_dir.mkdir()
    (run_dir / "results.json").write_text(json.dumps(results(stock_planned + 100, stock_planned + 217)))
    out = tmp_path / "out"
    assert mmv.main(["report", str(tmp_path), "--write", "--out-dir", str(out)]) == 0
    text = (out / "moe_memory_validation.md").read_text()
    data = json.loads((out / "moe_memory_validation.json").read_text())
    assert "2 of 2 arms within" in text and "speed-a/results.json" in text
    assert str(tmp_path) not in text + json.dumps(data)
    assert data["tolerance"] == {"relative": 0.15, "absolute_mb": 300.0}
    (run_dir / "results.json").write_text(json.dumps(results(stock_planned * 2, stock_planned * 2)))
    assert mmv.main(["report", str(run_dir / "results.json")]) == 1


@pytest.mark.parametrize(("content", "words"), [
    (None, "no such file"), ("not json", "not an ablate results file"), ("[1, 2]", "not an ablate results file"),
    ('{"commands": {}}', "not an ablate results file"), ('{"rows": [3]}', "not an ablate results file"),
    ('{"rows": []}', "empty results set")])
def test_report_refuses_what_is_not_results_in_one_line_with_exit_2(tmp_path, capsys, content, words):
    path = tmp_path / "run" / "results.json"
    if content is not None:
        path.parent.mkdir()
        path.write_text(content)
    assert mmv.main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and err.endswith("\n")


def test_report_refuses_a_directory_without_results(tmp_path, capsys):
    assert mmv.main(["report", str(tmp_path)]) == 2
    assert "no results.json" in capsys.readouterr().err


@pytest.mark.own_process
def test_run_smoke_writes_results_the_report_reads(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "bench/moe_memory_validation.py", "run", "--smoke", "--out", str(tmp_path),
                           "--shapes", "mixtral-a", "--iters", "1"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "mixtral-a" / "results.json").read_text())
    assert [r["arm"] for r in data["rows"]] == ["none", "grouped_gemm", "permute_fusion", "router_fusion"]
    assert all(r["probe"]["status"] == "ran" for r in data["rows"])
    assert "--moe-grouped-gemm" in data["commands"]["grouped_gemm"]["argv"]
    # a stand-in measures no peak: nothing to compare, which the report says with exit 1
    assert mmv.main(["report", str(tmp_path)]) == 1
