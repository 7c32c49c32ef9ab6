"""Every speedup interval the documentation quotes (docs/benchmarks.md, the README) is one that an
``ablate`` run (or a phase of ``tune``,
which writes the same results) under docs/benchmarks/raw measured: a number typed by hand, or left
behind when the data changed, fails here."""

from __future__ import annotations

import json
import re
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import report_h200  # the one reader of which raw files hold ablate results (the report's own)

from megatron_perf_toggles.tools.layers.report import unit_results

# an interval may wrap across a line of the README
CLAIM = re.compile(r"(\d\.\d{3})\s+\[(\d\.\d{3}),\s+(\d\.\d{3})\]")


def _layer_intervals() -> set[tuple[str, str, str]]:
    """The layer-level check's intervals (``megatron-perf-toggles layers`` and the MoE sweep), both clocks."""
    out = set()
    for path in sorted((REPO / "docs" / "benchmarks" / "raw" / "layers").glob("*.json")):
        data = json.loads(path.read_text())
        results = [r for _dest, _unit, r in unit_results(data)]  # each unit's, in either schema of layers.json
        results += [r for shape in data.get("shapes", {}).values() for k, r in shape.items() if k != "shape"]
        for result in results:
            for clock in ("gpu", "wall"):
                sp = (result.get(clock) or {}).get("speedup") or {}
                if sp.get("low") is not None:
                    out.add(tuple(f"{sp[k]:.3f}" for k in ("estimate", "low", "high")))
    return out


def measured() -> set[tuple[str, str, str]]:
    out = _layer_intervals()
    # bench/moe_h200.py's parts are ablate results too, kept beside the MoE page's other data
    moe = [json.loads(p.read_text()) for p in sorted((REPO / "docs" / "benchmarks" / "raw" / "moe").glob("*.json"))]
    for result in [*report_h200.ablate_results().values(), *(m for m in moe if "rows" in m)]:
        for row in result["rows"]:
            sp = row.get("speedup") or {}
            if sp.get("low") is not None:
                out.add(tuple(f"{sp[k]:.3f}" for k in ("estimate", "low", "high")))
    return out


def test_every_quoted_interval_was_measured():
    claims = CLAIM.findall((REPO / "docs" / "benchmarks.md").read_text() + (REPO / "README.md").read_text())
    assert len(claims) >= 20  # the section exists and the pattern still matches it
    known = measured()
    unknown = [f"{e} [{lo}, {hi}]" for e, lo, hi in claims if (e, lo, hi) not in known]
    assert not unknown, f"quoted intervals with no ablate result behind them: {unknown}"


def test_the_check_notices_a_changed_digit():
    text = "x 1.011 [1.008, 1.014] y 1.011 [1.008, 1.015] z 1.011\n[1.008,\n1.016]"
    known = measured()
    assert [c in known for c in CLAIM.findall(text)] == [True, False, False]
