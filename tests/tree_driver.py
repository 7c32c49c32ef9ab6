"""The one driver for real Megatron-LM trees: one long-lived process per tree, every suite's cases.

Megatron trees share module names, so each tree needs its own interpreter, and importing one costs
seconds. So the test session starts ONE worker process per tree (``python tree_driver.py``) that
imports the tree once and runs every case asked of it in-process, and the trees run in parallel,
one per CPU. It starts as soon as pytest has collected (tests/conftest.py), so the unit tests run
while the trees work.

Each real-tree suite registers what it needs with :data:`SESSION`:

- ``SESSION.suite(name, build)``: ``build(tree, work)`` returns phases, ``[{"tree": path, "cases":
  [...]}]``, run once per tree before anything else (a phase on another path, e.g. a patched copy of
  the tree, runs first; the tree's own cases run together after). ``SESSION.results(name, tree)``
  returns ``{case name: result}``.
- ``SESSION.run(tree, cases)``: cases a test computes itself (e.g. every arm of an ablation), run
  on that tree's worker when asked.

A case is a dict with a ``name`` and a ``kind``, which picks the code that runs it in the worker:

- ``launcher`` / ``cli`` / ``script``: the launcher's ``main``, the command line's ``main`` or a script
  as ``python SCRIPT`` (launcher_cases.py);
- ``parse`` / ``wgrad_sites``: parse + validate + TransformerConfig, the wgrad fallback's sites (parse_cases.py);
- ``corpus``: a batch of functional-test configs or fuzz samples, stock against the plugin (corpus_cases.py).

Every case runs inside ``PATCHES.scope()``: what the plugin patches during one case is undone
before the next. A worker that dies fails only its own tree's tests, with the end of its log.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TREES_ENV = "MEGATRON_LM_TREES"
REPLY_FD_ENV = "PTT_DRIVER_REPLY_FD"
# Which module runs a case of each kind, in the worker (the function ``run_case(case)``).
KINDS = {"launcher": "launcher_cases", "script": "launcher_cases", "cli": "launcher_cases", "parse": "parse_cases",
         "wgrad_sites": "parse_cases", "corpus": "corpus_cases"}
# Kinds that answer Megatron's device probes like a GPU machine for their batch run after the others.
LAST_KINDS = frozenset({"corpus"})
TIMEOUT = 1800


def trees() -> list[str]:
    return [t for t in os.environ.get(TREES_ENV, "").split(os.pathsep) if t.strip()]


def tree_id(tree: str | os.PathLike[str] | None) -> str:
    return Path(tree).name if tree else "no-trees"


def driver_env(work: Path | None = None, drop: tuple[str, ...] = ("MEGATRON_PERF_TOGGLES", "PTT_"),
               path: Iterable[str | os.PathLike[str]] = (), base: dict[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: ``base`` (the session's environment as it started: tests change
    theirs while workers start) without the plugin's (and the tests') variables, the repository,
    the tests and ``path`` importable, no bytecode written into the trees."""
    env = {k: v for k, v in (SESSION.environ if base is None else base).items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), *map(str, path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if work is not None:
        env["TMPDIR"] = str(work)
    return env


def workers(count: int) -> int:
    """Trees run in parallel, one per CPU (PTT_CORPUS_WORKERS overrides)."""
    wanted = int(os.environ.get("PTT_CORPUS_WORKERS", "0") or 0) or (os.cpu_count() or 1)
    return max(1, min(count, wanted))


# --- the parent side ------------------------------------------------------------------------------


class Worker:
    """One tree's process: requests go in on its stdin, ``done`` comes back on a pipe of its own
    (Megatron prints to stdout and stderr, which go to a log file)."""

    def __init__(self, tree: str, work: Path) -> None:
        self.tree, self.work = tree, work
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "worker.log"
        self.lock = threading.Lock()
        self.count = 0
        read_end, write_end = os.pipe()
        env = driver_env(work, path=[work])
        env[REPLY_FD_ENV] = str(write_end)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--serve"], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, cwd=work, env=env, text=True,
                                         pass_fds=(write_end,))
        os.close(write_end)
        self.replies = os.fdopen(read_end)

    def request(self, phases: list[dict[str, Any]], timeout: int = TIMEOUT) -> list[dict[str, Any]]:
        """Run ``phases`` in the worker; the results of their cases, in order."""
        with self.lock:
            self.count += 1
            plan_file, results_file = self.work / f"plan{self.count}.json", self.work / f"results{self.count}.json"
            plan_file.write_text(json.dumps({"phases": phases}))
            timer = threading.Timer(timeout, self.proc.kill)
            timer.start()
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(f"{plan_file}\t{results_file}\n")
                self.proc.stdin.flush()
                reply = self.replies.readline()
            except (BrokenPipeError, OSError):
                reply = ""
            finally:
                timer.cancel()
            if reply.strip() != "done" or not results_file.exists():
                tail = self.log.read_text(errors="replace")[-5000:] if self.log.exists() else ""
                raise AssertionError(f"the driver for {tree_id(self.tree)} stopped (exit {self.proc.poll()}):\n{tail}")
            return json.loads(results_file.read_text())

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.replies.close()


class Session:
    """Every real-tree suite's cases, one worker per tree, for the whole test session."""

    def __init__(self) -> None:
        self.suites: dict[str, Callable[[str, Path], list[dict[str, Any]]]] = {}
        self.lock = threading.Lock()
        self.base: Path | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.bulk: dict[str, Future[dict[str, Any]]] = {}
        self.workers: dict[str, Worker] = {}
        self.environ: dict[str, str] = dict(os.environ)
        self.jobs: dict[str, Callable[[], Any]] = {}
        self.started: dict[str, Future[Any]] = {}
        self.side: ThreadPoolExecutor | None = None

    def suite(self, name: str, build: Callable[[str, Path], list[dict[str, Any]]]) -> str:
        """Register a suite: ``build(tree, work)`` gives its phases for one tree."""
        self.suites[name] = build
        return name

    def background(self, name: str, job: Callable[[], Any]) -> str:
        """Register a job of another kind (e.g. the Megatron-Bridge suite's own interpreter) that
        starts with the workers; ``outcome(name)`` waits for it and returns (or raises) what it did."""
        self.jobs[name] = job
        return name

    def outcome(self, name: str) -> Any:
        self.start()
        future = self.started.get(name)
        return future.result() if future is not None else self.jobs[name]()

    def start(self) -> None:
        """Start every tree's worker on every registered suite (at most one per CPU at a time),
        and the background jobs beside them."""
        with self.lock:
            if self.pool is None and self.side is None:
                self.environ = dict(os.environ)  # before any test changes it
            if self.jobs and self.side is None:
                self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side")
                self.started = {name: self.side.submit(job) for name, job in self.jobs.items()}
            if self.pool is not None or not trees() or not self.suites:
                return
            self.base = Path(tempfile.mkdtemp(prefix="ptt-trees-"))
            names = trees()
            self.pool = ThreadPoolExecutor(max_workers=workers(len(names)), thread_name_prefix="tree")
            for i, tree in enumerate(names):
                self.bulk[tree] = self.pool.submit(self._run_suites, tree, self.base / f"{i}-{tree_id(tree)}")

    def work(self, tree: str) -> Path:
        """The tree's working directory (lives until the session ends)."""
        self.start()
        assert self.base is not None
        return self.base / f"{trees().index(str(tree))}-{tree_id(tree)}"

    def _run_suites(self, tree: str, work: Path) -> dict[str, Any]:
        started = time.perf_counter()
        worker = self.workers[tree] = Worker(tree, work)
        by_tree: dict[str, list[dict[str, Any]]] = {}  # one phase per path: copies first, the tree last
        for name, build in list(self.suites.items()):
            (work / name).mkdir(parents=True, exist_ok=True)
            for phase in build(tree, work / name):
                by_tree.setdefault(str(Path(phase["tree"]).resolve()), []).extend(
                    {**case, "suite": name} for case in phase["cases"])
        own = by_tree.pop(str(Path(tree).resolve()), [])
        own.sort(key=lambda case: case.get("kind") in LAST_KINDS)
        phases = [{"tree": path, "cases": cases} for path, cases in by_tree.items()]
        phases.append({"tree": str(Path(tree).resolve()), "cases": own})
        found: dict[str, Any] = {name: {} for name in self.suites}
        for result in worker.request(phases):
            found[result.pop("suite")][result["name"]] = result
        found["__seconds__"] = round(time.perf_counter() - started, 1)
        return found

    def _bulk_of(self, tree: str) -> dict[str, Any]:
        self.start()
        future = self.bulk.get(str(tree))
        assert future is not None, f"{tree} is not in {TREES_ENV}"
        return future.result()

    def results(self, suite: str, tree: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
        """Every case of ``suite`` on ``tree``, by name (waits for the tree's worker)."""
        return self._bulk_of(str(tree))[suite]

    def run(self, tree: str | os.PathLike[str], cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``cases`` on the tree's worker, now, by name (after the registered suites' cases)."""
        tree = str(tree)
        with contextlib.suppress(Exception):  # a failed suite run is reported by its own tests
            self._bulk_of(tree)
        worker = self.workers[tree]
        found = worker.request([{"tree": str(Path(tree).resolve()), "cases": cases}])
        return {r["name"]: r for r in found}

    def close(self) -> None:
        if self.side is not None:
            self.side.shutdown(wait=True, cancel_futures=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for worker in self.workers.values():
            worker.close()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)


SESSION = Session()


# --- in the worker --------------------------------------------------------------------------------


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


def cache_parser_help_text() -> None:
    """Megatron 0.16+ builds part of its parser from dataclass docstrings, parsing the source with
    ``ast`` on every ``parse_args`` (~0.4 s a call). The text depends on the class alone, so it is
    cached per class; the parser Megatron builds is the same."""
    module = sys.modules.get("megatron.training.argument_utils")
    for cls in vars(module).values() if module else ():
        original = getattr(cls, "_get_field_docstrings", None) if isinstance(cls, type) else None
        if original is None or getattr(original, "_ptt_cached", False):
            continue
        memo: dict[type, dict[str, str]] = {}

        def cached(self: Any, src_cfg_class: type, _original: Any = original, _memo: dict = memo) -> dict[str, str]:
            if src_cfg_class not in _memo:
                _memo[src_cfg_class] = _original(self, src_cfg_class)
            return dict(_memo[src_cfg_class])

        cached._ptt_cached = True  # type: ignore[attr-defined]
        cls._get_field_docstrings = cached


class _Trees:
    """The tree the worker has on ``sys.path``; moving to another drops every Megatron module."""

    current: str | None = None

    @classmethod
    def enter(cls, tree: str) -> None:
        if tree == cls.current:
            return
        if cls.current is not None:
            for name, module in list(sys.modules.items()):
                path = getattr(module, "__file__", None) or ""
                if name == "megatron" or name.startswith("megatron.") or path.startswith(cls.current + os.sep):
                    del sys.modules[name]
            with contextlib.suppress(ValueError):
                sys.path.remove(cls.current)
        sys.path.insert(0, tree)
        cls.current = tree


def run_one(case: dict[str, Any]) -> dict[str, Any]:
    from megatron_perf_toggles.runtime.patches import PATCHES

    cache_parser_help_text()
    head = {"suite": case.get("suite"), "name": case["name"]}
    try:
        runner = importlib.import_module(KINDS[case["kind"]]).run_case
        with PATCHES.scope():
            return {**runner(case), **head}
    except BaseException as exc:  # noqa: BLE001 - one broken case must not hide the others
        lines = traceback.format_exception(exc)
        return {**head, "driver_error": "".join(lines)[-3000:], "error": "".join(lines)[-3000:]}


def serve() -> int:
    """Read ``PLAN<TAB>RESULTS`` lines from stdin until ``quit``; answer ``done`` on the reply pipe."""
    reply = os.fdopen(int(os.environ[REPLY_FD_ENV]), "w")
    for line in sys.stdin:
        if line.strip() == "quit" or not line.strip():
            break
        plan_file, results_file = line.rstrip("\n").split("\t")
        plan = json.loads(Path(plan_file).read_text())
        found = []
        for phase in plan["phases"]:
            _Trees.enter(phase["tree"])
            found += [run_one(case) for case in phase["cases"]]
        Path(results_file).write_text(json.dumps(found, default=repr))
        reply.write("done\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve())
