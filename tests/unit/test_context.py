"""The run context: one per entry point, the one process slot, and a dry run that is a mode of it.

Megatron here is the small fake of ``test_process_changes`` (put into ``sys.modules``): the point
is where the plugin keeps its state, not what Megatron does.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from pathlib import Path

import pytest
from test_process_changes import _fake_megatron

import megatron_perf_toggles
from megatron_perf_toggles.errors import PerfTogglesError
from megatron_perf_toggles.launcher import dry_run, launch, parse_hooks
from megatron_perf_toggles.runtime import context as run_context
from megatron_perf_toggles.runtime import rank_check, wgrad_fallback
from megatron_perf_toggles.runtime.context import RunContext
from megatron_perf_toggles.runtime.controller import process_controller
from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES, ProcessChanges
from megatron_perf_toggles.runtime.provider import extra_args_provider


def _fake(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_megatron(monkeypatch)
    monkeypatch.setattr(wgrad_fallback, "usable", lambda: (False, "the fake torch has no kernels"))


@pytest.fixture(autouse=True)
def _clean_process():
    PROCESS_CHANGES.uninstall()  # start from a process that carries nothing of an earlier test
    yield
    PROCESS_CHANGES.uninstall()


def test_install_and_uninstall_restore_the_process() -> None:
    assert run_context.current() is None
    with RunContext.create("planning", mode="plan") as outer:
        assert run_context.current() is outer and PROCESS_CHANGES.labels == ["run context (plan)"]
        inner = RunContext.create("launcher").install()
        assert run_context.current() is inner
        inner.rank_fingerprint = {"toggles": {"a": 1}}
        inner.uninstall()
        assert run_context.current() is outer and PROCESS_CHANGES.labels == ["run context (plan)"]
    assert run_context.current() is None and PROCESS_CHANGES.labels == []


def test_uninstall_undoes_what_was_recorded_after_install_and_nothing_older() -> None:
    owner = argparse.Namespace(value=1)
    PROCESS_CHANGES.set_attr(owner, "value", 2, "older")
    ctx = RunContext.create("launcher").install()
    PROCESS_CHANGES.set_attr(owner, "value", 3, "newer")
    ctx.uninstall()
    assert owner.value == 2 and PROCESS_CHANGES.labels == ["older"] and run_context.current() is None


def test_the_patch_log_is_an_undo_log_only() -> None:
    public = {name for name, _ in inspect.getmembers(ProcessChanges) if not name.startswith("_")}
    assert not {"hold", "held", "drop"} & public
    assert public == {"install", "set_attr", "set_item", "on_uninstall", "uninstall", "scope", "mark", "undo_to",
                      "labels"}
    assert not [name for name in vars(PROCESS_CHANGES) if name != "_changes"]  # nothing kept beside the log


def test_the_bare_provider_is_an_entry_point_with_its_own_context() -> None:
    parser = megatron_perf_toggles.extra_args_provider(argparse.ArgumentParser())
    first = run_context.current()
    assert first is not None and first.entry == "provider" and first.mode == "run"
    assert first.controller is not None and first.env is first.controller.env
    assert parser._perf_toggles_registration.controller is first.controller  # type: ignore[attr-defined]
    extra_args_provider(argparse.ArgumentParser())  # a fresh parser of its own: a fresh context, as before
    second = run_context.current()
    assert second is not first and second is not None and second.controller is not first.controller
    PROCESS_CHANGES.uninstall()
    assert run_context.current() is None


def test_the_rank_check_fingerprint_lives_on_the_context() -> None:
    ctx = RunContext.create("launcher").install()
    rank_check.arm({"toggles": {"x": 1}}, enabled=False, context=ctx)
    assert ctx.rank_fingerprint == {"toggles": {"x": 1}}
    ctx.uninstall()
    assert run_context.current() is None


def test_the_patched_script_hook_makes_and_installs_a_script_context(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch)
    rest = parse_hooks.install_from_argv(["--extra-args-provider", "megatron_perf_toggles", "--bf16"], environ={})
    ctx = run_context.current()
    assert rest == ["--bf16"] and ctx is not None and ctx.entry == "script" and ctx.mode == "run"
    assert parse_hooks.active() is ctx.hooks and ctx.hooks.context is ctx
    args = sys.modules["megatron.training.arguments"].parse_args()  # type: ignore[attr-defined]
    assert ctx.controller is not None and process_controller() is ctx.controller and "perf_toggles" in vars(args)
    PROCESS_CHANGES.uninstall()
    assert run_context.current() is None and parse_hooks.active() is None


def test_the_launcher_runs_the_script_inside_a_launcher_context(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    _fake(monkeypatch)
    seen = tmp_path / "seen.txt"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from megatron.training import arguments
        from megatron_perf_toggles.runtime.context import current
        args = arguments.parse_args()
        ctx = current()
        with open({str(seen)!r}, "w") as fh:
            fh.write(f"{{ctx.entry}} {{ctx.mode}} {{ctx.controller is not None}} {{'perf_toggles' in vars(args)}}")
    """))
    monkeypatch.setattr(sys, "argv", ["run"])
    assert launch.main([str(script)]) == 0
    assert seen.read_text() == "launcher run True True"


def test_planning_makes_its_own_context_and_leaves_none_behind(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    from megatron_perf_toggles.tools.planning import plan_command_line

    _fake(monkeypatch)
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "arguments.py").write_text("")
    seen = tmp_path / "seen.txt"
    (tmp_path / "pretrain_gpt.py").write_text(textwrap.dedent(f"""
        from megatron_perf_toggles.runtime.context import current
        ctx = current()
        with open({str(seen)!r}, "w") as fh:
            fh.write(f"{{ctx.entry}} {{ctx.mode}} {{ctx.hooks.capture}}")
    """))
    launcher = RunContext.create("launcher").install()  # explain inside a launch: the launch's comes back
    with pytest.raises(PerfTogglesError, match="ended before Megatron parsed"):
        plan_command_line([], tree=str(tmp_path))
    assert seen.read_text() == "planning plan True"
    assert run_context.current() is launcher


def test_a_capturing_dry_run_stops_through_its_context_only() -> None:
    ctx = RunContext.create("planning", mode="plan")
    with ctx.until_stopped():
        ctx.stop({"effective_args": {}}, "the plan")
        raise AssertionError("stop() returns nowhere")
    assert ctx.record == {"effective_args": {}} and ctx.plan == "the plan"
    other = RunContext.create("planning", mode="plan")
    with pytest.raises(Exception) as raised, other.until_stopped():  # its type is private
        ctx.stop({}, None)
    assert type(raised.value).__module__ == run_context.__name__ and type(raised.value).__name__.startswith("_")


def test_the_dry_run_leaves_no_exception_type_for_callers() -> None:
    assert not hasattr(dry_run, "DryRunDone")
    public_errors = [name for name, value in vars(run_context).items()
                     if isinstance(value, type) and issubclass(value, BaseException) and not name.startswith("_")]
    assert public_errors == []
    for module in (dry_run, parse_hooks):
        done = [name for name, value in vars(module).items()
                if isinstance(value, type) and issubclass(value, BaseException) and "Done" in name]
        assert done == [], module.__name__


def test_a_launcher_dry_run_is_a_mode_of_its_context(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import types

    _fake(monkeypatch)
    torch = sys.modules["torch"]  # the fake's: the planned GPU's stand-ins answer its device questions
    monkeypatch.setattr(torch, "cuda", types.SimpleNamespace(is_available=lambda: False), raising=False)
    monkeypatch.setattr(torch, "version", types.SimpleNamespace(cuda=None, hip=None), raising=False)
    script = tmp_path / "train.py"
    script.write_text("from megatron.training import initialize\n"
                      "initialize.initialize_megatron(extra_args_provider=None, args_defaults={})\n"
                      "raise AssertionError('a dry run ends before the script goes on')\n")
    monkeypatch.setattr(sys, "argv", ["run"])
    with pytest.raises(SystemExit) as done:
        launch.main(["--dry-run", "--json", "--world-size", "8", "--gpu", "h100", str(script)])
    ctx = run_context.current()
    assert done.value.code == 0 and ctx is not None and (ctx.entry, ctx.mode) == ("launcher", "dry-run")
    assert ctx.target is not None and ctx.target.world_size == 8 and ctx.controller is not None
    assert ctx.controller.target is ctx.target and ctx.capabilities is not None and ctx.capabilities.device == "cuda"
    record = json.loads(capsys.readouterr().out)
    assert record["dry_run"] and record["target"]["world_size"] == 8 and ctx.record is None  # printed, not kept


def test_the_walk_from_the_provider_to_the_decision_record_stays_in_two_wings() -> None:
    """A toggle's value, from the bare provider to ``args.perf_toggles``: every function of the
    package that runs is in ``runtime`` or ``core`` (or the modules below them), and the plan goes
    down into ``core`` once (``decide``) and comes back up once, to write the records."""
    from megatron_perf_toggles.runtime.controller import Controller

    wings: set[str] = set()
    descents: list[str] = []

    def profile(frame, event, arg):  # sys.setprofile's signature
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("megatron_perf_toggles."):
            return
        wings.add(module.split(".")[1])
        caller = frame.f_back
        if caller is not None and caller.f_code is Controller.plan.__code__ and ".core." in f"{module}.":
            descents.append(f"{module}:{frame.f_code.co_name}")

    parser = extra_args_provider(argparse.ArgumentParser())
    sys.setprofile(profile)
    try:
        args = parser.parse_args([])
    finally:
        sys.setprofile(None)
    assert args.perf_toggles  # the records are there
    assert {"runtime", "core"} <= wings <= {"runtime", "core", "errors", "_version"}, wings
    assert descents == ["megatron_perf_toggles.core.decision.decide:decide"], descents


def test_the_run_context_and_its_controller_are_made_in_one_factory():
    """Every entry point gets its run context (and controller) from ``controller.new_context``:
    the package constructs a RunContext or a Controller in two places only, the factory module and
    the context's own module (the process's context for a bare ``check_ranks``)."""
    import ast

    from conftest import REPO

    package = REPO / "megatron_perf_toggles"
    makers = {"RunContext.create", "RunContext", "Controller", "cls"}
    places = {}
    for path in sorted(package.rglob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and ast.unparse(n.func) in makers and (ast.unparse(n.func) != "cls" or path.name == "context.py")]
        if calls:
            places[str(path.relative_to(package))] = [ast.unparse(c.func) for c in calls]
    assert set(places) <= {"runtime/controller.py", "runtime/context.py"}, places
    assert places["runtime/controller.py"] == ["Controller", "RunContext.create"]  # new_controller, new_context


def test_only_the_controller_calls_the_decision():
    """Every entry point plans through its context's controller (``doctor`` included): outside the
    core, the package calls ``decide`` in one place, ``Controller.plan``."""
    import ast

    from conftest import REPO

    package = REPO / "megatron_perf_toggles"
    callers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if path.parts[-3:-1] != ("core", "decision") and any(
                         isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "decide"
                         for n in ast.walk(ast.parse(path.read_text()))))
    assert callers == ["runtime/controller.py"], callers
