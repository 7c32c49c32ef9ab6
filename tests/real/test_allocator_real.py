"""The allocator verdicts from the command line and against the real tree: ``explain --json`` on a
job that fits only with expandable segments, and today's model against the committed H200 runs
(docs/benchmarks/allocator_validation.json), recomputed through Megatron main's parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import megatron_trees
from sandbox import clean_environ

REPO = Path(__file__).resolve().parents[2]
VALIDATION = json.loads((REPO / "docs" / "benchmarks" / "allocator_validation.json").read_text())


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", [t for t in megatron_trees() if t.name == "main"][:1] or [None])
def test_todays_model_still_gives_the_committed_verdicts(tree):
    """The report recomputed with today's model, from the raw runs: same verdicts, same outcomes."""
    if tree is None:
        pytest.skip("needs the Megatron-LM main tree in MEGATRON_LM_TREES")
    sys.path.insert(0, str(REPO / "bench"))
    import allocator_validation as bench

    for row in VALIDATION:
        argv = next(r["argv"] for f in (REPO / "docs" / "benchmarks" / "raw" / "allocator").glob("*.json")
                    for r in json.loads(f.read_text()) if (r["layout"], r["arm"], r["alloc"]) ==
                    (row["layout"], row["arm"], row["alloc"]))
        predicted = bench.predict(str(tree), argv, row["arm"], row["alloc"])
        assert predicted["verdict"] == row["plan"]["verdict"], row
        assert bench.held({**row, "expected": bench.expected(predicted["verdict"], row["alloc"])}), row




def test_explain_json_carries_the_verdicts_and_the_launch_variable():
    """From a laptop, on a recorded surface: a job that fits an H200 only with expandable segments."""
    argv = ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "3584", "--num-attention-heads", "16",
            "--group-query-attention", "--num-query-groups", "4", "--seq-length", "4096", "--max-position-embeddings",
            "4096", "--micro-batch-size", "14", "--global-batch-size", "28", "--vocab-size", "256000", "--swiglu",
            "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer"]
    proc = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "explain", "--json", "--gpu", "h200", "--",
                           *argv], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=clean_environ(PYTHONPATH=str(REPO), CROSS_ENTROPY_FUSION_IMPL="native"))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["memory"]["verdict"] == {"stock": "fits_with_expandable_segments",
                                           "plan": "fits_with_expandable_segments"}
    memory_record = record["memory"]
    assert memory_record["largest_allocation_mb"] == pytest.approx(4 * 57344 * 256000 / 2**20, abs=0.1)
    need = memory_record["allocator_need_mb"]
    assert need["expandable_segments"] == memory_record["planned_peak_mb"]
    assert need["fixed_segments"] == pytest.approx(memory_record["planned_peak_mb"] + memory_record["largest_allocation_mb"],
                                                   abs=0.2)
    assert need["fixed_segments"] > memory_record["limit_mb"] >= need["expandable_segments"]
    names = [v["name"] for v in record["launch_environment"]]
    assert "PYTORCH_CUDA_ALLOC_CONF" in names
