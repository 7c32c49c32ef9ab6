"""bench/startup.py leaves the committed results alone unless told where to write."""

from __future__ import annotations

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
