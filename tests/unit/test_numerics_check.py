"""bench/numerics_check.py's pure parts: the pass rule, the expert-name mapping, the error measure,
and its one-line refusal on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("numerics_check", REPO / "bench" / "numerics_check.py")
assert spec and spec.loader
nc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nc)


def test_a_fused_error_within_the_multiple_passes_and_beyond_it_fails():
    assert nc.verdict(1.9e-3, 1e-3, 2.0)
    assert not nc.verdict(2.2e-3, 1e-3, 2.0)
    # at float32 round-off both are ~0: the floor keeps such noise from failing a fusion
    assert nc.verdict(5e-7, 0.0, 2.0)
    assert not nc.verdict(5e-6, 0.0, 2.0)


def test_grouped_expert_weights_map_onto_the_sequential_names():
    assert nc.canonical("decoder.layers.1.mlp.experts.linear_fc1.weight3") == \
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert nc.canonical("decoder.layers.0.mlp.experts.linear_fc2.weight12") == \
        "decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight"
    same = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert nc.canonical(same) == same
    assert nc.canonical("output_layer.weight") == "output_layer.weight"


def test_the_error_is_relative_l2_over_all_parameters_and_names_the_worst():
    torch = pytest.importorskip("torch")
    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 1.0])}
    got = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 1.5])}
    total, worst, name = nc.rel_l2(got, ref)
    assert math.isclose(total, 0.5 / math.sqrt(26.0), rel_tol=1e-9)
    assert math.isclose(worst, 0.5, rel_tol=1e-9) and name == "b"


def test_without_a_gpu_it_says_so_in_one_line():
    proc = subprocess.run([sys.executable, "bench/numerics_check.py", "--out", "/nonexistent-dir"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "GPU" in proc.stderr or "Megatron" in proc.stderr


def _model(fusions: dict, unfused=(1e-5, 1e-2)) -> dict:
    def run(loss, grad):
        return {"loss_rel_err": loss, "grad_rel_l2": grad}
    return {"model": "moe", "unfused": [run(*unfused), run(*unfused)],
            "fusions": {n: {"runs": [run(*e), run(*e)], "repeat_grad_rel_l2": 0.0} for n, e in fusions.items()}}


def test_a_saved_check_is_judged_against_each_toggles_stock_path():
    model = _model({"moe_permute_fusion": (1e-5, 1.5e-2), "moe_router_fusion": (1e-5, 5e-2),
                    "rope_fusion": (9e-5, 1e-2), "fused_single_qkv_rope": (9e-5, 1e-2)})
    lines = nc.judge(model, 2.0)
    f = model["fusions"]
    assert f["moe_permute_fusion"]["passed"] is True
    assert f["moe_router_fusion"]["passed"] is False  # 5x the unfused gradient error
    # stock fuses RoPE itself: measured, not judged; the single-QKV toggle is held to that path
    assert f["rope_fusion"]["passed"] is None and f["fused_single_qkv_rope"]["base"] == "rope_fusion"
    assert f["fused_single_qkv_rope"]["passed"] is True
    assert len(lines) == 4 and any("FAIL" in line for line in lines)


def test_the_committed_check_passes_every_toggle_it_covers():
    proc = subprocess.run([sys.executable, "bench/numerics_check.py", "--report",
                           "docs/benchmarks/raw/numerics/numerics.json"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "numerics: every toggle passed"
    assert "moe   moe_grouped_gemm" in proc.stdout and "dense gradient_accumulation_fusion" in proc.stdout
