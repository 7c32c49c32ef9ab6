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
- ``corpus``: a batch of functional-test configs or fuzz samples, stock against the plugin (corpus_cases.py);
- ``pp_split``: each pipeline rank's layers, Megatron's own count against the memory model's (pp_split_cases.py).

Every case runs inside ``PROCESS_CHANGES.scope()``: what the plugin patches during one case is undone
before the next. A worker that dies fails only its own tree's tests, with the end of its log.
"""

from __future__ import annotations

import contextlib
import dataclasses
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

TESTS = Path(__file__).resolve().parent  # tests/support: the cases the workers import
REPO = TESTS.parents[1]
TREES_ENV = "MEGATRON_LM_TREES"
FDS_ENV = "PTT_DRIVER_FDS"  # the worker's request and reply pipes
# What a worker's environment leaves out besides the toggles' own variables.
DROP = ("MEGATRON_PERF_TOGGLES", "PTT_", "FP4_")
# Which module runs a case of each kind, in the worker (the function ``run_case(case)``).
KINDS = {"launcher": "launcher_cases", "script": "launcher_cases", "cli": "launcher_cases", "parse": "parse_cases",
         "pp_split": "pp_split_cases",
         "wgrad_sites": "parse_cases", "corpus": "corpus_cases"}
# Kinds that answer Megatron's device probes like a GPU machine for their batch run after the others.
LAST_KINDS = frozenset({"corpus"})
TIMEOUT = 1800


def trees() -> list[str]:
    """The trees in MEGATRON_LM_TREES, as the session started (tests change the environment while
    the workers' threads read this)."""
    return [t for t in SESSION.environ.get(TREES_ENV, "").split(os.pathsep) if t.strip()]


def _key(tree: str | os.PathLike[str]) -> str:
    """A tree as the session knows it, however it was spelled (a trailing slash, ``./``)."""
    return str(Path(tree).resolve())


def tree_id(tree: str | os.PathLike[str] | None) -> str:
    return Path(tree).name if tree else "no-trees"


def driver_env(work: Path | None = None, path: Iterable[str | os.PathLike[str]] = ()) -> dict[str, str]:
    """A worker's (or a test's own process's) environment: the session's as it started, without the
    plugin's and the tests' variables or a toggle's, with the repository, the tests and ``path``
    importable and no bytecode written into the trees (it goes to the session's directory)."""
    from megatron_perf_toggles.core.registry import TOGGLES

    toggles = {t.env for t in TOGGLES}
    env = {k: v for k, v in SESSION.environ.items() if not k.startswith(DROP) and k not in toggles}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), *map(str, path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    if not env.get("PYTHONPYCACHEPREFIX"):  # the session's own bytecode directory (conftest), else none
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if work is not None:
        env["TMPDIR"] = str(work)
    return env


def workers(count: int) -> int:
    """Trees run in parallel, one per CPU (PTT_TREE_WORKERS overrides)."""
    wanted = int(SESSION.environ.get("PTT_TREE_WORKERS", "0") or 0) or (os.cpu_count() or 1)
    return max(1, min(count, wanted))


# --- the parent side ------------------------------------------------------------------------------


class Worker:
    """One tree's process. Requests go in on a pipe of its own and ``done`` comes back on another
    (stdin is closed: a case that reads it gets nothing); Megatron's output goes to a log file,
    with each case's name before it."""

    def __init__(self, tree: str, work: Path) -> None:
        self.tree, self.work = tree, work
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "worker.log"
        self.lock = threading.Lock()
        self.count = 0
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        env = driver_env(work, path=[work])
        env[FDS_ENV] = f"{request_read},{reply_write}"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__))], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=work, env=env, pass_fds=(request_read, reply_write))
        os.close(request_read)
        os.close(reply_write)
        self.requests = os.fdopen(request_write, "w")
        self.replies = os.fdopen(reply_read)

    def request(self, phases: list[dict[str, Any]], timeout: int = TIMEOUT) -> list[dict[str, Any]]:
        """Run ``phases`` in the worker; the results of their cases, in order."""
        with self.lock:
            self.count += 1
            plan_file, results_file = self.work / f"plan{self.count}.json", self.work / f"results{self.count}.json"
            plan_file.write_text(json.dumps({"phases": phases}))
            timer = threading.Timer(timeout, self.proc.kill)
            timer.start()
            try:
                self.requests.write(f"{plan_file}\t{results_file}\n")
                self.requests.flush()
                reply = self.replies.readline()
            except (BrokenPipeError, OSError, ValueError):
                reply = ""
            finally:
                timer.cancel()
            if reply.strip() != "done" or not results_file.exists():
                tail = self.log.read_text(errors="replace")[-5000:] if self.log.exists() else ""
                raise AssertionError(f"the driver for {tree_id(self.tree)} stopped (exit {self.proc.poll()}; the log "
                                     f"names the case it was on):\n{tail}")
            return json.loads(results_file.read_text())

    def stop(self) -> None:
        """Ask an idle worker to end; stop a busy one (an interrupted session)."""
        if self.lock.acquire(blocking=False):
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                self.requests.write("quit\n")
                self.requests.close()
            self.lock.release()
        else:
            self.proc.kill()
            with contextlib.suppress(OSError, ValueError):
                self.requests.close()

    def close(self) -> None:
        """Wait for the worker to end (after ``stop``)."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        with contextlib.suppress(OSError, ValueError):
            self.replies.close()


@dataclasses.dataclass
class _Suite:
    build: Callable[[str, Path], list[dict[str, Any]]]
    owners: frozenset[str]
    weight: Callable[[str], float] | None = None


class Session:
    """Every real-tree suite's cases, one worker per tree, for the whole test session."""

    def __init__(self) -> None:
        self.suites: dict[str, _Suite] = {}
        self.jobs: dict[str, tuple[Callable[[], Any], frozenset[str], bool]] = {}
        self.lock = threading.Lock()
        self.environ: dict[str, str] = dict(os.environ)
        self.base: Path | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.side: ThreadPoolExecutor | None = None
        self.bulk: dict[str, Future[dict[str, Any]]] = {}
        self.started: dict[str, Future[Any]] = {}
        self.workers: dict[str, Worker] = {}
        self.scratch: list[Path] = []
        self.begun = False

    @staticmethod
    def _owners(owners: Iterable[str] | None) -> frozenset[str]:
        """The test files a suite or job serves, by stem (the registering file, unless named)."""
        return frozenset(owners) if owners is not None else frozenset({Path(sys._getframe(2).f_globals["__file__"]).stem})

    def suite(self, name: str, build: Callable[[str, Path], list[dict[str, Any]]],
              owners: Iterable[str] | None = None, weight: Callable[[str], float] | None = None) -> str:
        """Register a suite: ``build(tree, work)`` gives its phases for one tree. It runs when a
        selected real-Megatron test is in one of ``owners`` (test modules; default: the caller).
        ``weight(tree)``, where a suite's work differs from tree to tree, is a cheap estimate of
        it: the heaviest trees start first, so no big one is left running alone at the end."""
        self.suites[name] = _Suite(build, self._owners(owners), weight)
        return name

    def _heaviest_first(self, names: list[str]) -> list[str]:
        def weight(tree: str) -> float:
            return sum(s.weight(tree) for s in self.suites.values() if s.weight is not None)

        return sorted(names, key=weight, reverse=True)  # stable: equal weights keep their order

    def background(self, name: str, job: Callable[[], Any], real: bool = True, owners: Iterable[str] | None = None
                   ) -> str:
        """Register a job of another kind (a process of its own: the Megatron-Bridge suite's
        interpreter, an entry point run as users run it) that starts with the workers when a test
        of ``owners`` is selected (a real-Megatron one where ``real``); ``outcome(name)`` waits for
        it and returns (or raises) what it did."""
        self.jobs[name] = (job, self._owners(owners), real)
        return name

    def start(self, real: set[str] | None = None, every: set[str] | None = None) -> None:
        """Start what the selected tests need (everything where None): the suites of the modules in
        ``real`` (those with a selected real-Megatron test), each tree's worker at most one per CPU
        at a time, and the jobs of ``real`` or ``every`` module, one after another beside them."""
        with self.lock:
            if self.begun:
                return
            self.begun = True
            self.environ = dict(os.environ)  # before any test changes it
            if real is not None:
                self.jobs = {k: v for k, v in self.jobs.items() if v[1] & (real if v[2] else real | (every or set()))}
                self.suites = {k: v for k, v in self.suites.items() if v.owners & real}
            if self.jobs:
                self.side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="side")
                self.started = {name: self.side.submit(job) for name, (job, *_) in self.jobs.items()}
            names = trees()
            if not names or real == set():  # no real-Megatron test selected: no worker
                return
            self.base = Path(tempfile.mkdtemp(prefix="ptt-trees-"))
            self.pool = ThreadPoolExecutor(max_workers=workers(len(names)), thread_name_prefix="tree")
            for i, tree in enumerate(self._heaviest_first(names)):
                self.workers[_key(tree)] = Worker(tree, self.base / f"{i}-{tree_id(tree)}")
                self.bulk[_key(tree)] = self.pool.submit(self._run_suites, tree)

    def tempdir(self, prefix: str) -> Path:
        """A directory for a job's files, removed when the session ends."""
        made = Path(tempfile.mkdtemp(prefix=prefix))
        self.scratch.append(made)
        return made

    def outcome(self, name: str) -> Any:
        self.start()
        future = self.started.get(name)
        assert future is not None, f"the job {name!r} was not started for this selection of tests"
        return future.result()

    def worker(self, tree: str | os.PathLike[str]) -> Worker:
        self.start()
        found = self.workers.get(_key(tree))
        assert found is not None, f"{tree} is not one of {TREES_ENV} ({', '.join(trees())}), or no real-Megatron test was selected"
        return found

    def work(self, tree: str | os.PathLike[str]) -> Path:
        """The tree's working directory (lives until the session ends)."""
        return self.worker(tree).work

    def _run_suites(self, tree: str) -> dict[str, Any]:
        """Build every suite's phases (a suite whose build fails fails only its own tests) and run
        them: phases on other paths first, the tree's own cases last, corpus batches last of all."""
        worker = self.worker(tree)
        by_tree: dict[str, list[dict[str, Any]]] = {}
        found: dict[str, Any] = {}
        for name, suite in list(self.suites.items()):
            (worker.work / name).mkdir(parents=True, exist_ok=True)
            try:
                phases = suite.build(tree, worker.work / name)
            except BaseException as error:  # pytest.skip and pytest.fail too: reported by that suite's tests
                if isinstance(error, KeyboardInterrupt):
                    raise
                found[name] = {"__error__": f"building the suite {name!r} failed:\n{traceback.format_exc()[-3000:]}"}
                continue
            found[name] = {}
            for phase in phases:
                by_tree.setdefault(str(Path(phase["tree"]).resolve()), []).extend(
                    {**case, "suite": name} for case in phase["cases"])
        own = by_tree.pop(str(Path(tree).resolve()), [])
        own.sort(key=lambda case: kind_of(case) in LAST_KINDS)
        phases = [{"tree": path, "cases": cases} for path, cases in by_tree.items()]
        phases.append({"tree": str(Path(tree).resolve()), "cases": own})
        for result in worker.request(phases):
            found[result.pop("suite")][result["name"]] = result
        return found

    def results(self, suite: str, tree: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
        """Every case of ``suite`` on ``tree``, by name (waits for the tree's worker)."""
        self.worker(tree)
        done = self.bulk[_key(tree)].result()
        assert suite in done, f"the suite {suite!r} was not started for this selection of tests"
        found = done[suite]
        assert "__error__" not in found, found["__error__"]
        return found

    def run(self, tree: str | os.PathLike[str], cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """``cases`` on the tree's worker, by name (the worker runs one request at a time: before or
        after the registered suites' cases, each in its own ``PROCESS_CHANGES.scope()``)."""
        worker = self.worker(tree)
        found = worker.request([{"tree": str(Path(tree).resolve()), "cases": cases}])
        return {r["name"]: r for r in found}

    def close(self) -> None:
        for worker in self.workers.values():  # every worker is told first: they end side by side
            worker.stop()
        for worker in self.workers.values():
            worker.close()
        for pool in (self.side, self.pool):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        for made in [self.base, *self.scratch]:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)


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


def assert_megatron_unwrapped(arguments: Any) -> None:
    """Stock Megatron is the baseline: no earlier case may have left one of the plugin's wrappers
    on Megatron's parse path, or the safety net, in this worker (each case undoes its own)."""
    from megatron_perf_toggles.runtime import safety_net
    from megatron_perf_toggles.runtime.rebinding import ORIGINAL_ATTR

    wrapped = [name for name in ("parse_args", "validate_args", "core_transformer_config_from_args")
               if hasattr(getattr(arguments, name, None), ORIGINAL_ATTR)]
    assert not wrapped and not safety_net.NET.installed, (
        f"an earlier case left the plugin installed (wrapped: {wrapped}, safety net: {safety_net.NET.installed}): "
        "stock Megatron cannot be the baseline")


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
            from megatron_perf_toggles.runtime.rebinding import forget_holders

            forget_holders()  # the dropped modules go with it
        sys.path.insert(0, tree)
        cls.current = tree


def kind_of(case: dict[str, Any]) -> str:
    """A case's kind; a launcher-family case may name it as its ``mode`` alone."""
    return case.get("kind") or case["mode"]


def run_one(case: dict[str, Any]) -> dict[str, Any]:
    from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES

    cache_parser_help_text()
    started = time.perf_counter()
    try:
        runner = importlib.import_module(KINDS[kind_of(case)]).run_case
        with PROCESS_CHANGES.scope():
            found = runner(case)
    except BaseException as exc:  # noqa: BLE001 - one broken case must not hide the others
        text = "".join(traceback.format_exception(exc))[-3000:]
        found = {"driver_error": text, "error": text}
    return {**found, "suite": case.get("suite"), "name": case["name"],
            "driver_seconds": round(time.perf_counter() - started, 3)}


def serve() -> int:
    """Read ``PLAN<TAB>RESULTS`` lines from the request pipe until ``quit``; answer ``done``."""
    request_fd, reply_fd = (int(fd) for fd in os.environ.pop(FDS_ENV).split(","))
    reply = os.fdopen(reply_fd, "w")
    for line in os.fdopen(request_fd):
        if line.strip() == "quit" or not line.strip():
            break
        plan_file, results_file = line.rstrip("\n").split("\t")
        plan = json.loads(Path(plan_file).read_text())
        found = []
        for phase in plan["phases"]:
            _Trees.enter(phase["tree"])
            for case in phase["cases"]:
                print(f"--- case {case.get('suite')}/{case['name']} ({kind_of(case)}) on {phase['tree']}", flush=True)
                found.append(run_one(case))
        Path(results_file).write_text(json.dumps(found, default=repr))
        reply.write("done\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    import tree_driver  # the case modules import it by that name: one module, one tree on the path

    code = tree_driver.serve()
    # Everything is written (results files, the flushed log). Tearing down an interpreter that has
    # imported torch and several Megatron trees takes a second or more and leaves nothing behind.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
