"""Shared fixtures. Real Megatron trees come only from MEGATRON_LM_TREES (':'-separated)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_perf_toggles.core import registry
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import Capabilities, MegatronFacts
from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES
from megatron_perf_toggles.tools.llama3_8b import llama3_8b_args

REPO = Path(__file__).resolve().parents[1]
# The three layers: unit/ (pure, fast), real/ (Megatron trees, front ends) and support/ (drivers,
# cases, helpers), which the tests and the trees' workers import by name.
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))


def last_line(text: str) -> str:
    """What a failed command says last, whole: the exception of a traceback, pip's own error line (a
    skip reason is that line, never a cut-off tail)."""
    said = [line.strip() for line in text.splitlines() if line.strip()]
    return said[-1] if said else "no output"


def explain_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    """``megatron-perf-toggles explain ARGV`` in this process: its exit status, stdout and stderr."""
    from megatron_perf_toggles.tools import cli

    try:
        code = cli.main(["explain", *argv])
    except SystemExit as done:
        code = int(done.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def megatron_trees() -> list[Path]:
    raw = os.environ.get("MEGATRON_LM_TREES", "")
    return [Path(p) for p in raw.split(os.pathsep) if p.strip()]


def full_caps(**overrides) -> Capabilities:
    """A machine that can honour every toggle, on a Megatron like main: every capability a toggle of
    the registry needs is present (derived from ``registry.TOGGLES``, so a new toggle's capability is
    here too), and TE 2.20.2 on CUDA."""
    needed = {name for t in registry.TOGGLES for name in t.needs}
    facts = {registry.BY_CAPABILITY[n].detected.removeprefix("megatron:"): True
             for n in needed if not registry.BY_CAPABILITY[n].stored}
    megatron = overrides.pop("megatron", MegatronFacts(
        version="0.20.0", asserts_te_cross_entropy=False, asserts_ddp_average_with_gtp=True, **facts,
    ))
    base = {**dict.fromkeys(sorted(n for n in needed if registry.BY_CAPABILITY[n].stored), True),
            "te_version": "2.20.2", "device": "cuda", "megatron": megatron}
    base.update(overrides)
    return Capabilities(**base)


# What the decision tests look at of the one Llama-3-8B definition (the one explain plans for).
LLAMA_ARGS = llama3_8b_args("bf16", "position_embedding_type", "num_layers", "pipeline_model_parallel_size",
                            "optimizer", "lr", "adam_eps")
# The same model as a mixture of experts, as MoE recipes set it up (no bias in the linear layers): every
# MoE toggle applies and no guard has a reason to act.
MOE_ARGS = {**LLAMA_ARGS, "num_experts": 8, "moe_router_topk": 2, "add_bias_linear": False}


@pytest.fixture(autouse=True)
def _process_left_as_found():
    """Whatever a test changes through PROCESS_CHANGES (hooks, the safety net, the rank check's wrapper)
    is undone when it ends, so no test sees another's patches."""
    with PROCESS_CHANGES.scope():
        yield


@pytest.fixture
def env():
    return lambda **kw: read_env({k: str(v) for k, v in kw.items()})


@pytest.fixture
def clean_environment(monkeypatch):
    """The process environment emptied down to what a user's shell would hold without any of the
    plugin's variables (support/sandbox.py's ``clean_environ``), for tests that run the command in
    this process: what the session or the developer exported cannot change their answer."""
    from sandbox import clean_environ

    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in clean_environ().items():
        monkeypatch.setenv(name, value)


REAL_MEGATRON = "real_megatron"
NO_TREES = "MEGATRON_LM_TREES is not set: a real-Megatron test (run with ':'-separated Megatron-LM checkouts)"


OWN_PROCESS = "own_process"


def _share_bytecode(config) -> None:
    """This process and those the tests start with the session's environment (the trees' workers,
    dry runs, the command line) compile each module once per session, into one directory, and read
    it from there: Megatron's files are never written to (a tree may be read-only, or shared) and
    are not compiled again by every process that imports them. A directory the user names with
    PYTHONPYCACHEPREFIX is used and kept; otherwise the session makes one and removes it at the end.
    Everything changed here is put back as it was (``_unshare_bytecode``), COLUMNS too."""
    config.stash[_BYTECODE_BEFORE] = ({k: os.environ.get(k) for k in _SESSION_VARS},
                                      (sys.pycache_prefix, sys.dont_write_bytecode))
    named = os.environ.get("PYTHONPYCACHEPREFIX")
    made = named or tempfile.mkdtemp(prefix="ptt-bytecode-")
    if not named:
        config.stash[_BYTECODE] = made
    os.environ["PYTHONPYCACHEPREFIX"] = made
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    # This process too, for what it imports from now on (torch, for one, shared with the others).
    sys.pycache_prefix, sys.dont_write_bytecode = made, False


def _unshare_bytecode(config) -> None:
    environ, flags = config.stash.get(_BYTECODE_BEFORE, (None, None))
    if environ is None:
        return
    for key, value in environ.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.pycache_prefix, sys.dont_write_bytecode = flags
    made = config.stash.get(_BYTECODE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


# The variables the session sets or removes for its processes, put back when it ends.
_SESSION_VARS = ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE", "COLUMNS")
_BYTECODE = pytest.StashKey[str]()  # the directory the session made (removed at the end)
_BYTECODE_BEFORE = pytest.StashKey[tuple]()
# When this session started: bytecode in a tree older than this was not written by it.
SESSION_STARTED = time.time()


def pytest_configure(config):
    _share_bytecode(config)
    os.environ.pop("COLUMNS", None)  # the command line fits its text to COLUMNS: tests read whole lines
    config.addinivalue_line("markers", f"{REAL_MEGATRON}: runs against real Megatron-LM trees (MEGATRON_LM_TREES); "
                                       f"-m 'not {REAL_MEGATRON}' runs the fast set")
    config.addinivalue_line("markers", f"{OWN_PROCESS}: runs a script or entry point as a process of its own "
                                       "(seconds), not on the tree driver: such tests run first")


def _order(item, waiting: set[str]) -> int:
    """When a test runs, so that the two kinds of long work overlap and nothing long is left for
    the end: tests that start processes of their own first (beside the trees' workers), then the
    unit tests, then those that wait for a background job (tests/tree_driver.py), and real-Megatron
    tests that read the workers' results last, when the workers are done or nearly."""
    if item.get_closest_marker(OWN_PROCESS) is not None:
        return 0
    if item.get_closest_marker(REAL_MEGATRON) is not None:
        return 3
    return 2 if item.path.stem in waiting else 1


def pytest_collection_modifyitems(config, items):
    """The order of _order (a stable sort: each group keeps its files' order). Without trees each
    real-Megatron test is skipped here, for one reason."""
    driver = sys.modules.get("tree_driver")
    waiting = set().union(*(owners for _, owners, _ in driver.SESSION.jobs.values())) if driver else set()
    items.sort(key=lambda item: _order(item, waiting))
    if megatron_trees():
        return
    skip = pytest.mark.skip(reason=NO_TREES)
    for item in items:
        if item.get_closest_marker(REAL_MEGATRON) is not None:
            # first, so that it is the reason given: a test parametrized over the trees has none to run
            # on, and pytest's own "got empty parameter set" would not say why
            item.add_marker(skip, append=False)


def pytest_collection_finish(session):
    """Start the trees' workers now (tests/tree_driver.py), so they work while the unit tests run."""
    driver = sys.modules.get("tree_driver")  # imported by the suites that use it
    if driver is None or session.config.option.collectonly:
        return
    # Only what the selected tests need: suites for their real-Megatron tests, jobs for any test.
    real = {item.path.stem for item in session.items if item.get_closest_marker(REAL_MEGATRON) is not None}
    driver.SESSION.start(real, {item.path.stem for item in session.items})


def pytest_unconfigure(config):
    driver = sys.modules.get("tree_driver")
    if driver is not None:
        driver.SESSION.close()
    _unshare_bytecode(config)


def _frontend_corpus_summary(terminalreporter) -> None:
    """The config front ends' corpus counts (tests/real/test_frontend_corpus.py), one line each."""
    lines = [value for key in ("passed", "failed") for rep in terminalreporter.stats.get(key, [])
             for name, value in getattr(rep, "user_properties", ()) if name == "front-end corpus"]
    if lines:
        terminalreporter.section("front-end corpus")
        for line in lines:
            terminalreporter.write_line(line)


def skip_reason(rep) -> str:
    """A skipped test's reason, whole and on one line (pytest's own summary shows the first line only)."""
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    return " ".join(str(reason).removeprefix("Skipped: ").split())


def _skips_summary(terminalreporter) -> None:
    """Every skipped test, counted once under its reason, the most frequent first: the counts add up
    to pytest's own "N skipped"."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    by_reason: dict[str, int] = {}
    for rep in skipped:
        reason = skip_reason(rep)
        by_reason[reason] = by_reason.get(reason, 0) + 1
    terminalreporter.section("skipped tests")
    terminalreporter.write_line(f"{len(skipped)} skipped, for {len(by_reason)} reason(s):")
    for reason, count in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{count:5d}  {reason}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say plainly which real-Megatron suites ran, on which trees, and why each skipped test was skipped."""
    _frontend_corpus_summary(terminalreporter)
    _real_megatron_summary(terminalreporter)
    _skips_summary(terminalreporter)


def _real_megatron_summary(terminalreporter) -> None:
    """Which real-Megatron suites ran, on which trees (each skipped case is in the skips' summary)."""
    trees = megatron_trees()
    suites = sorted({
        rep.nodeid.split("::")[0]
        for key in ("passed", "failed", "skipped", "error")
        for rep in terminalreporter.stats.get(key, [])
        if getattr(rep, "nodeid", "") and REAL_MEGATRON in getattr(rep, "keywords", {})
    })
    if not suites:  # none collected (-m "not real_megatron", or a selection without them)
        return
    terminalreporter.section("real-Megatron suites")
    if not trees:
        skipped = sum(1 for rep in terminalreporter.stats.get("skipped", [])
                      if rep.nodeid.split("::")[0] in suites)
        if not skipped:
            return
        terminalreporter.write_line(
            f"SKIPPED: {skipped} real-Megatron tests in {len(suites)} suites (contract tests "
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
            terminalreporter.write_line(f"    skipped {rep.nodeid.split('::', 1)[1]}: {skip_reason(rep)}")
