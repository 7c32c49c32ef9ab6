"""Bench scripts: bench/startup.py leaves the committed results alone unless told where to write;
bench/run_breakdown.py splits runs by arm, warm-ups apart."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_startup_bench_does_not_rewrite_the_committed_results():
    committed = REPO / "bench" / "results" / "startup.json"
    before = committed.read_bytes()
    proc = subprocess.run([sys.executable, "bench/startup.py", "--repeats", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "total" in proc.stdout and "wrote" not in proc.stdout
    assert committed.read_bytes() == before


def _breakdown_run(root, kind, arm, block, seconds, first_two_s):
    """A finished ablate run whose log carries Megatron's timestamps: set-up marks a second apart,
    then iterations 1-3, the second ``first_two_s`` after training starts."""
    from datetime import datetime, timedelta

    t0 = datetime(2026, 1, 1, 12, 0, 0)
    stamp = lambda s: (t0 + timedelta(seconds=s)).isoformat(sep=" ")  # noqa: E731
    marks = ["before library-setup", "before megatron-init", "after megatron is initialized",
             "after model, optimizer, and learning rate scheduler are built", "before the start of training step"]
    lines = [f"[{m}] datetime: {stamp(i)}" for i, m in enumerate(marks)]
    lines += [f" [{stamp(4 + t)}] iteration        {i}/     100 | loss" for i, t in
              ((1, first_two_s / 2), (2, first_two_s), (3, first_two_s + 1))]
    run = root / "runs" / kind / arm
    run.mkdir(parents=True)
    (run / "log.txt").write_text("\n".join(lines) + "\n")
    (run / "status.json").write_text(json.dumps({"arm": arm, "block": block, "status": "done", "seconds": seconds}))


def test_run_breakdown_splits_by_arm_and_keeps_warm_ups_apart(tmp_path):
    for b, first_two in enumerate((30.0, 34.0)):
        _breakdown_run(tmp_path, f"block0{b + 1}", "all-on", b, 80.0, first_two)
    _breakdown_run(tmp_path, "warmup", "all-on", -1, 60.0, 50.0)
    out = tmp_path / "breakdown.json"
    proc = subprocess.run([sys.executable, "bench/run_breakdown.py", str(tmp_path), "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    arms = json.loads(out.read_text())["by_arm"]
    assert arms["all-on"]["runs"] == 2 and arms["all-on"]["phases_median_s"]["iterations 1-2"] == 32.0
    assert arms["warm-up (all-on)"]["runs"] == 1  # never in the arm's median
    # start-up and exit: the run's total less the log's span (library set-up to the last iteration)
    assert arms["all-on"]["phases_median_s"]["start-up and exit"] == 80.0 - (4 + 33.0)
