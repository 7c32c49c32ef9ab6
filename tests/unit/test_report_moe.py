"""bench/report_moe.py: the MoE page from ablate results (synthetic here; the smoke runs' own in
tests/real/test_moe_bench_presets.py)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import report_moe


def _loss_part(tmp_path, fmt="today"):
    """A loss part as ablate writes it: three seeds, stock and grouped GEMM alone (today's results
    carry the loss test per row; an earlier ablate's carried a band verdict instead)."""
    out = tmp_path / "run" / "loss"
    arms = {"all-off": [2.10, 2.13, 2.16], "only:moe_permute_fusion": [2.11, 2.14, 2.16]}
    rows = [{"arm": "all-off", "baseline": True, "max_allocated_mb": 3000.0, "max_allocated_delta_mb": 0.0},
            {"arm": "only:moe_permute_fusion", "baseline": False, "max_allocated_mb": 3100.0,
             "max_allocated_delta_mb": 100.0}]
    if fmt == "earlier":
        rows[1]["loss_window"] = {"window": 1, "band": 0.06, "verdict": "old words"}
    runs = [{"arm": a, "block": b, "status": "done", "log": f"{out}/runs/block0{b + 1}/{a}/log.txt",
             "command": ["/opt/py/bin/python", "-m", "megatron_perf_toggles.run", "/trees/main/pretrain_gpt.py"],
             "iterations": [{"iteration": 1, "lm_loss": 5.0, "grad_norm": 1.0}, {"iteration": 2, "lm_loss": v}]}
            for a, vals in arms.items() for b, v in enumerate(vals)]
    env = {"all-off": "0", "only:moe_permute_fusion": "1"}
    commands = {a: {"env": {"MOE_PERMUTE_FUSION": v, "MOE_GROUPED_GEMM": "0"}, "argv": []} for a, v in env.items()}
    data = {"rows": rows, "runs": runs, "iters": 2, "concurrent": 6, "blocks_run": 3, "block_seeds": [1, 2, 3],
            "loss_window": 1, "commands": commands, "versions": {"megatron": {"path": "/trees/main"}}}
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


@pytest.mark.parametrize("fmt", ["today", "earlier"])
def test_the_page_has_the_loss_speed_and_memory_tables(tmp_path, fmt):
    loss, speed = _loss_part(tmp_path, fmt), _speed_part(tmp_path)
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"),
                            "--add", f"loss={loss}", "--add", f"speed-a={speed / 'results.json'}"]) == 0
    md = (tmp_path / "docs" / "moe_h200.md").read_text()
    # per seed: +0.01, +0.01, 0.00 over stock's mean 2.13: +0.4695, +0.4695, 0 %; mean 0.3130, sd 0.2711,
    # t(0.95, 2) = 2.92 (a table): [-0.144, +0.770], inside +-1 %; seeds for +-1 %: at n = 3,
    # (t(0.95, 2) + t(0.9, 2)) x 0.2711 / sqrt(3) = (2.920 + 1.886) x 0.1565 = 0.75 <= 1 (at n = 2: 1.8)
    assert "## Loss: equivalence within +-1 %" in md and "band" not in md
    assert ("| moe_permute_fusion | only:moe_permute_fusion | 3 | +0.31 % [-0.14, +0.77] | +-0.77 % | "
            "3 | paired | equivalent within +-1 % |") in md
    assert "| moe_permute_fusion alone | 2.1100 | 2.1400 | 2.1600 |" in md
    assert "| moe_grouped_gemm alone | 611.0 | 1.440 [1.400, 1.480] | faster | 39000 | -1000 |" in md
    assert "| moe_router_fusion alone | 875.0 | 1.006 [0.990, 1.020] | no detectable difference |" in md
    assert "| loss | moe_permute_fusion alone | 3100 | +100 |" in md
    summary = json.loads((tmp_path / "docs" / "moe_h200.json").read_text())
    assert summary["loss"]["seeds"] == [1, 2, 3] and summary["loss"]["margin"] == 1.0
    assert summary["loss"]["arms"][1]["verdict"] == "equivalent within +-1 %"
    assert summary["speed"]["speed-a"]["arms"][1]["ratio"] == 1.44
    # the raw copy: generic paths, and per iteration only what the report reads
    raw = (tmp_path / "raw" / "loss.json").read_text()
    assert "/trees/main" not in raw and "/path/to/Megatron-LM/pretrain_gpt.py" in raw and str(tmp_path) not in raw
    assert json.loads(raw)["runs"][0]["iterations"] == [{"iteration": 1, "lm_loss": 5.0}, {"iteration": 2, "lm_loss": 2.1}]
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
