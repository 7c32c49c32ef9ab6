"""The one driver skeleton for real Megatron-LM trees, shared by every real-tree suite.

Megatron trees share module names and importing one costs seconds, so each tree gets ONE
subprocess that imports it once and runs a plan of cases in-process, and the trees run in
parallel, one per CPU. The suites differ only in their cases and in what a case does:

- ``megatron_runs.py``: the launcher, patched checkouts, the safety net (test_launcher,
  test_patches, test_safety_net, test_parity, test_ablate_real);
- ``megatron_driver.py``: parse + validate + TransformerConfig per case (test_megatron_real);
- ``corpus_driver.py``: Megatron's own functional-test configs and fuzz samples, stock against
  the plugin (test_megatron_corpus, test_megatron_fuzz).

Here is what they share: the parent side (the subprocess's environment, running it with a plan
file and reading its results file, running every tree once in parallel and caching the outcome)
and, for the subprocess, planning the Transformer Engine version Megatron's own checks see.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TREES_ENV = "MEGATRON_LM_TREES"


def trees() -> list[str]:
    return [t for t in os.environ.get(TREES_ENV, "").split(os.pathsep) if t.strip()]


def tree_id(tree: str | os.PathLike[str] | None) -> str:
    return Path(tree).name if tree else "no-trees"


def driver_env(work: Path | None = None, drop: tuple[str, ...] = ("MEGATRON_PERF_TOGGLES", "PTT_"),
               path: Iterable[str | os.PathLike[str]] = ()) -> dict[str, str]:
    """The subprocess's environment: this one without the plugin's (and the tests') variables, the
    repository, the tests and ``path`` importable, no bytecode written into the trees."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), *map(str, path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if work is not None:
        env["TMPDIR"] = str(work)
    return env


def run_driver(script: Path, args: list[str], plan: Any, work: Path, *, env: dict[str, str] | None = None,
               timeout: int = 1800, tag: str = "") -> Any:
    """Run ``python SCRIPT *args PLAN RESULTS`` in ``work`` (the plan written as JSON there) and
    return the results file's JSON; an AssertionError with the end of stderr where it failed."""
    work.mkdir(parents=True, exist_ok=True)
    plan_file, results_file = work / f"plan{tag}.json", work / f"results{tag}.json"
    plan_file.write_text(json.dumps(plan))
    done = subprocess.run([sys.executable, str(script), *args, str(plan_file), str(results_file)],
                          env=driver_env(work) if env is None else env, cwd=work, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if done.returncode != 0 or not results_file.exists():
        raise AssertionError(f"{script.name} {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-5000:]}")
    return json.loads(results_file.read_text())


def workers(count: int) -> int:
    """Trees run in parallel, one per CPU (PTT_CORPUS_WORKERS overrides)."""
    wanted = int(os.environ.get("PTT_CORPUS_WORKERS", "0") or 0) or (os.cpu_count() or 1)
    return max(1, min(count, wanted))


class PerTree:
    """Runs ``job(tree, work)`` for every tree once, in parallel, and caches the outcome; a tree
    whose job failed fails only its own tests."""

    def __init__(self, prefix: str, job: Callable[[str, Path], Any]) -> None:
        self.prefix = prefix
        self.job = job
        self.lock = threading.Lock()
        self.cache: dict[str, Any] = {}

    def get(self, tree: str | os.PathLike[str]) -> Any:
        with self.lock:
            if not self.cache:
                names = trees()
                work = Path(tempfile.mkdtemp(prefix=self.prefix))
                try:
                    with ThreadPoolExecutor(max_workers=workers(len(names))) as pool:
                        futures = {t: pool.submit(self.job, t, work / f"{i}-{tree_id(t)}") for i, t in enumerate(names)}
                        for t, future in futures.items():
                            try:
                                self.cache[t] = future.result()
                            except Exception as error:  # noqa: BLE001 - reported per tree by the test
                                self.cache[t] = {"__error__": str(error)}
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        found = self.cache[str(tree)]
        assert not (isinstance(found, dict) and "__error__" in found), found["__error__"]
        return found


# --- in the subprocess ----------------------------------------------------------------------------


def plan_te_version(version: str | None) -> None:
    """Let Megatron's own ``is_te_min_version`` checks see Transformer Engine ``version`` (a machine
    with that TE, as MEGATRON_PERF_TOGGLES_ASSUME=te=... plans for the plugin); ``None`` goes back
    to detection."""
    utils = sys.modules.get("megatron.core.utils")
    if utils is None:
        if version is None:
            return
        from megatron_perf_toggles.launcher.import_shims import megatron_importable

        with megatron_importable():  # the first case of a launcher run may come before Megatron's import
            from megatron.core import utils

    if version is None:
        utils._te_version = None
        return
    from packaging.version import Version

    utils._te_version = Version(version)
