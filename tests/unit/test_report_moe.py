"""bench/report_moe.py: the MoE page from ablate results (synthetic here; the smoke runs' own in
tests/real/test_moe_bench_presets.py)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import report_moe


def _loss_part(tmp_path):
    out = tmp_path / "run" / "loss"
    rows = [{"arm": "all-off", "baseline": True, "max_allocated_mb": 3000.0, "max_allocated_delta_mb": 0.0,
             "loss_window": {"window": 50, "seeds": [1, 2], "losses": [2.10, 2.13], "band": 0.03}},
            {"arm": "only:moe_grouped_gemm", "baseline": False, "max_allocated_mb": 3100.0, "max_allocated_delta_mb": 100.0,
             "loss_window": {"window": 50, "seeds": [1, 2], "losses": [2.11, 2.12], "band": 0.03,
                             "differences": [0.01, -0.01], "verdict": "within the seed-to-seed band"}}]
    runs = [{"arm": a, "block": b, "status": "done", "log": f"{out}/runs/block0{b + 1}/{a}/log.txt",
             "command": ["/opt/py/bin/python", "-m", "megatron_perf_toggles.run", "/trees/main/pretrain_gpt.py"],
             "iterations": [{"iteration": 1, "lm_loss": 5.0, "grad_norm": 1.0}]}
            for a in ("all-off", "only:moe_grouped_gemm") for b in (0, 1)]
    data = {"rows": rows, "runs": runs, "iters": 300, "concurrent": 4, "versions": {"megatron": {"path": "/trees/main"}}}
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(data))
    return out


def _speed_part(tmp_path):
    out = tmp_path / "run" / "speed-a"
    rows = [{"arm": "all-off", "baseline": True, "ms_per_iter": {"median": 880.0}, "max_allocated_mb": 40000.0,
             "max_allocated_delta_mb": 0.0},
            {"arm": "only:moe_grouped_gemm", "baseline": False, "ms_per_iter": {"median": 611.0},
             "speedup": {"estimate": 1.44, "low": 1.40, "high": 1.48, "verdict": "faster"},
             "max_allocated_mb": 39000.0, "max_allocated_delta_mb": -1000.0},
            {"arm": "only:moe_router_fusion", "baseline": False, "ms_per_iter": {"median": 875.0},
             "speedup": {"estimate": 1.006, "low": 0.99, "high": 1.02, "verdict": "no detectable difference"}}]
    data = {"rows": rows, "runs": [], "blocks_run": 3, "iters": 20, "warmup": 8, "confidence": 0.95}
    out.mkdir(parents=True)
    (out / "results.json").write_text(json.dumps(data))
    return out


def test_the_page_has_the_loss_speed_and_memory_tables(tmp_path):
    loss, speed = _loss_part(tmp_path), _speed_part(tmp_path)
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"),
                            "--add", f"loss={loss}", "--add", f"speed-a={speed / 'results.json'}"]) == 0
    md = (tmp_path / "docs" / "moe_h200.md").read_text()
    assert "Seed-to-seed band (stock's spread across seeds): 0.0300" in md
    assert "| moe_grouped_gemm alone | 2.1100 | 2.1200 | +0.0100, -0.0100 | within the seed-to-seed band |" in md
    assert "| moe_grouped_gemm alone | 611.0 | 1.440 [1.400, 1.480] | faster | 39000 | -1000 |" in md
    assert "| moe_router_fusion alone | 875.0 | 1.006 [0.990, 1.020] | no detectable difference |" in md
    assert "| loss | moe_grouped_gemm alone | 3100 | +100 |" in md
    summary = json.loads((tmp_path / "docs" / "moe_h200.json").read_text())
    assert summary["loss"]["band"] == 0.03 and summary["loss"]["seeds"] == [1, 2]
    assert summary["speed"]["speed-a"]["arms"][1]["ratio"] == 1.44
    # the raw copy: generic paths, and per iteration only what the report reads
    raw = (tmp_path / "raw" / "loss.json").read_text()
    assert "/trees/main" not in raw and "/path/to/Megatron-LM/pretrain_gpt.py" in raw and str(tmp_path) not in raw
    assert json.loads(raw)["runs"][0]["iterations"] == [{"iteration": 1, "lm_loss": 5.0}]
    # rebuilt from raw alone, the same page; --check passes on it and fails on a changed one
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"), "--check"]) == 0
    (tmp_path / "docs" / "moe_h200.md").write_text("old\n")
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"), "--check"]) == 1


def test_other_machine_paths_keep_their_last_part_and_bad_input_is_exit_2(tmp_path, capsys):
    part = _speed_part(tmp_path)
    data = json.loads((part / "results.json").read_text())
    data["environment"] = {"CUDA_HOME": "/somewhere/cuda"}
    (part / "results.json").write_text(json.dumps(data))
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"),
                            "--add", f"speed-a={part}"]) == 0
    assert "1 other machine path(s) kept as /path/to/<last part>: /somewhere/cuda" in capsys.readouterr().out
    raw = json.loads((tmp_path / "raw" / "speed-a.json").read_text())
    assert raw["environment"] == {"CUDA_HOME": "/path/to/cuda"}
    with pytest.raises(SystemExit) as info:
        report_moe.main(["--raw", str(tmp_path / "raw"), "--add", f"loss={tmp_path / 'nothing'}"])
    assert info.value.code == 2 and "no readable results.json" in capsys.readouterr().err
    assert report_moe.main(["--raw", str(tmp_path / "empty"), "--out", str(tmp_path / "docs2")]) == 1
    assert "no MoE results" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        report_moe.main(["--raw", str(tmp_path / "raw"), "--add", "speed-z=x"])
    assert info.value.code == 2


def test_arm_labels():
    assert [report_moe.label(a) for a in ("all-off", "baseline", "defaults", "only:moe_router_fusion", "+all-moe")] == [
        "stock", "stock", "defaults (every toggle on)", "moe_router_fusion alone", "all-moe (flags added to stock)"]


def test_the_plot_or_one_line_saying_why_not(tmp_path, capsys):
    loss, speed = _loss_part(tmp_path), _speed_part(tmp_path)
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"),
                            "--add", f"loss={loss}", "--add", f"speed-a={speed}"]) == 0
    png, out = tmp_path / "docs" / "moe_h200.png", capsys.readouterr().out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists() and "matplotlib is not installed: the plot is not written" in out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in out
