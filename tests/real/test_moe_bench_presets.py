"""bench/moe_h200.py --smoke on a real Megatron tree: every preset's arms resolved through Megatron's
own parser (the confound check), the runs through the stand-in, and the results the report reads.
A real_megatron suite: it needs MEGATRON_LM_TREES (the tree named main where given, else the newest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, megatron_trees


def _tree():
    trees = megatron_trees()
    return next((t for t in trees if t.name == "main"), trees[-1])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_SEED_LOSS": "0.01"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "moe_h200.py"), "--megatron", str(_tree()),
                           "--out", str(out), "--smoke", "--parts", "loss,speed-a,speed-b", "--repeats", "2",
                           "--budget", "30"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_smoke_runs_the_loss_preset_seeds_at_once(smoke):
    out, text = smoke
    assert text.index("expected: ~") < text.index("[loss]")
    data = json.loads((out / "loss" / "results.json").read_text())
    assert data["blocks_run"] == 2 and data["block_seeds"] == [1234, 1235] and data["concurrent"] == 10
    # no common start in the loss part, so no compile warm-up (it would need a wave of its own)
    assert data["loss_window"] == 50 and data["warmup_run"] is False and data["compile_warmup"] is None
    base = data["rows"][0]
    assert base["baseline"] and base["loss_test"]["toggle"] == "baseline" and data["loss_test"]["margin"] == 1.0
    assert all("speedup" not in r and r["loss_test"]["values"] for r in data["rows"])
    assert all(r["loss_test"]["verdict"] for r in data["rows"][1:])
    assert (out / "corpus" / "stdlib.idx").is_file()
    assert all(run["command"].count("--data-cache-path") == 1 for run in data["runs"])


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_smoke_runs_the_speed_presets_with_intervals_memory_and_each_arm_s_command(smoke):
    out, _ = smoke
    for part, experts in (("speed-a", "8"), ("speed-b", "64")):
        data = json.loads((out / part / "results.json").read_text())
        assert data["blocks_run"] == 2 and len(data["rows"]) == 5 and data["runs"][0]["block"] == -1
        for row in data["rows"][1:]:
            assert row["speedup"]["verdict"] and row["max_allocated_mb"] == 200.5
        for name, command in data["commands"].items():
            argv = command["argv"]
            assert argv[argv.index("--num-experts") + 1] == experts and "env" in command, name
        assert all(r["summary"]["memory_mb"]["max_allocated"] for r in data["runs"])


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_the_report_reads_the_smoke_results(smoke, tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import report_moe

    out, _ = smoke
    adds = [w for part in ("loss", "speed-a", "speed-b") for w in ("--add", f"{part}={out / part}")]
    assert report_moe.main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "docs"), *adds]) == 0
    md = (tmp_path / "docs" / "moe_h200.md").read_text()
    assert "## Loss" in md and "## Speed: speed-a" in md and "## Speed: speed-b" in md and "## Peak memory" in md
    # the stand-in's loss moves with the seed alike in every arm (FAKE_SEED_LOSS): each arm's paired
    # differences are 0 at both seeds, so an interval of [0, 0]: equivalent
    assert "## Loss: equivalence within +-1 %" in md and md.count("| equivalent within +-1 % |") == 4
    assert md.count("no detectable difference") == 6
    # the stand-in is faster (900 ms against 1000) with grad_reduce_in_bf16, which only the defaults arm has
    assert md.count("| defaults (every toggle on) | 900.0 | 1.111 [1.111, 1.111] | faster |") == 2
    assert str(out) not in (tmp_path / "raw" / "loss.json").read_text()
