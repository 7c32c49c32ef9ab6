"""Shared fixtures. Real Megatron trees come only from MEGATRON_LM_TREES (':'-separated)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import Capabilities, MegatronFacts
from megatron_perf_toggles.runtime.patches import PATCHES
from megatron_perf_toggles.tools.llama3_8b import llama3_8b_args

REPO = Path(__file__).resolve().parents[1]


def megatron_trees() -> list[Path]:
    raw = os.environ.get("MEGATRON_LM_TREES", "")
    return [Path(p) for p in raw.split(os.pathsep) if p.strip()]


def full_caps(**overrides) -> Capabilities:
    """A machine that can honour every toggle (TE with both kernels, APEX), on a Megatron like main."""
    megatron = overrides.pop("megatron", MegatronFacts(
        version="0.20.0", fused_single_qkv_rope_field=True, asserts_te_cross_entropy=False,
        asserts_ddp_average_with_gtp=True,
    ))
    base = dict(te_version="2.20.2", te_fused_qkv_rope=True, te_cross_entropy=True, apex_fused_wgrad=True,
                device="cuda", megatron=megatron)
    base.update(overrides)
    return Capabilities(**base)


# What the decision tests look at of the one Llama-3-8B definition (the one explain plans for).
LLAMA_ARGS = llama3_8b_args("bf16", "position_embedding_type", "num_layers", "pipeline_model_parallel_size",
                            "optimizer", "lr", "adam_eps")


@pytest.fixture(autouse=True)
def _process_left_as_found():
    """Whatever a test changes through PATCHES (hooks, the safety net, the rank check's wrapper)
    is undone when it ends, so no test sees another's patches."""
    with PATCHES.scope():
        yield


@pytest.fixture
def env():
    return lambda **kw: read_env({k: str(v) for k, v in kw.items()})


REAL_SUITES = ("tests/test_megatron_real.py", "tests/test_launcher.py", "tests/test_patches.py",
               "tests/test_ablate_real.py", "tests/test_cli.py", "tests/test_examples.py",
               "tests/test_safety_net.py", "tests/test_megatron_rules.py", "tests/test_megatron_corpus.py",
               "tests/test_megatron_fuzz.py", "tests/test_parity.py", "tests/test_front_door.py")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say plainly which real-Megatron suites ran, on which trees, and which were skipped."""
    trees = megatron_trees()
    suites = sorted({
        rep.nodeid.split("::")[0]
        for key in ("passed", "failed", "skipped", "error")
        for rep in terminalreporter.stats.get(key, [])
        if getattr(rep, "nodeid", "") and rep.nodeid.split("::")[0] in REAL_SUITES
    })
    terminalreporter.section("real-Megatron suites")
    if not trees:
        skipped = sum(1 for rep in terminalreporter.stats.get("skipped", [])
                      if rep.nodeid.split("::")[0] in REAL_SUITES)
        if not skipped:
            return
        terminalreporter.write_line(
            f"SKIPPED: {skipped} real-Megatron tests in {len(suites) or len(REAL_SUITES)} suites (contract tests "
            "against recorded surfaces did run); to run them: pip install torch --index-url "
            "https://download.pytorch.org/whl/cpu && pip install -e '.[test,megatron-cpu]', then "
            "MEGATRON_LM_TREES=/path/to/Megatron-LM[:/another/checkout] python -m pytest -q tests"
        )
        return
    ran = [t.name for t in trees]
    terminalreporter.write_line(f"RAN against {len(ran)} trees: {', '.join(ran)}")
    for suite in suites:
        skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.nodeid.startswith(suite)]
        terminalreporter.write_line(f"  {suite}: {len(skipped)} skipped case(s)" if skipped else f"  {suite}: all cases ran")
        for rep in skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            terminalreporter.write_line(f"    skipped {rep.nodeid.split('::', 1)[1]}: {reason}")
