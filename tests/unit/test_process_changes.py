"""Every process-wide change has one owner, and after ``PROCESS_CHANGES.uninstall()`` the process is as it was.

The Megatron and torch modules here are small fakes put into ``sys.modules``: the point is what
the plugin changes around them, not what they do.
"""

from __future__ import annotations

import argparse
import operator
import os
import sys
import types
import typing

import pytest

from megatron_perf_toggles.launcher import parse_hooks
from megatron_perf_toggles.launcher.import_shims import megatron_importable
from megatron_perf_toggles.runtime import context as run_context
from megatron_perf_toggles.runtime import rank_check, safety_net, wgrad_fallback
from megatron_perf_toggles.runtime.controller import Controller
from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES, ProcessChanges


def test_set_attr_and_set_item_are_undone_newest_first() -> None:
    owner = types.SimpleNamespace(kept=1)
    table: dict[str, int] = {"a": 1}
    patches = ProcessChanges()
    patches.set_attr(owner, "kept", 2)
    patches.set_attr(owner, "kept", 3)
    patches.set_attr(owner, "added", 4)
    patches.set_item(table, "a", 5)
    patches.set_item(table, "b", 6)
    undone: list[str] = []
    patches.on_uninstall("custom", lambda: undone.append("custom"))
    assert (owner.kept, owner.added, table) == (3, 4, {"a": 5, "b": 6})
    patches.uninstall()
    assert vars(owner) == {"kept": 1} and table == {"a": 1} and undone == ["custom"]
    patches.uninstall()  # idempotent
    assert patches.labels == []


def test_a_scope_undoes_only_what_was_changed_inside_it() -> None:
    owner = types.SimpleNamespace(before=1)
    patches = ProcessChanges()
    patches.set_attr(owner, "before", 2, "older")
    with pytest.raises(RuntimeError), patches.scope():
        patches.set_attr(owner, "inside", 3, "inner")
        patches.set_attr(owner, "before", 4, "inner again")
        raise RuntimeError("the block failed: its changes are undone all the same")
    assert vars(owner) == {"before": 2} and patches.labels == ["older"]
    patches.uninstall()
    assert vars(owner) == {"before": 1}


def test_a_scope_undoes_a_callback_change_and_keeps_older_ones() -> None:
    """A change made by a callback (install) has the log as its owner: a scope's end undoes what
    was recorded inside it, uninstall the rest."""
    patches = ProcessChanges()
    log: list[str] = []
    patches.install("older", lambda: log.append("older"), lambda: log.append("older undone"))
    with patches.scope():
        patches.install("a callback change", lambda: log.append("applied"), lambda: log.append("undone"))
        assert log == ["older", "applied"] and patches.labels == ["older", "a callback change"]
    assert log == ["older", "applied", "undone"] and patches.labels == ["older"]
    patches.uninstall()
    assert log[-1] == "older undone" and patches.labels == []


def _fake_megatron(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    """megatron.training.{arguments,initialize,training}, the tensor-parallel layers, torch.distributed."""

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        parser.add_argument("--bf16", action="store_true")
        if extra_args_provider is not None:
            parser = extra_args_provider(parser) or parser
        return parser.parse_args([])

    def validate_args(args, defaults=None):
        return args

    def initialize_megatron(extra_args_provider=None, args_defaults=None):
        return parse_args(extra_args_provider)

    modules = {name: types.ModuleType(name) for name in (
        "megatron", "megatron.training", "megatron.training.arguments", "megatron.training.initialize",
        "megatron.training.training", "megatron.core.tensor_parallel.layers", "torch", "torch.distributed")}
    modules["megatron.training.arguments"].parse_args = parse_args  # type: ignore[attr-defined]
    modules["megatron.training.arguments"].validate_args = validate_args  # type: ignore[attr-defined]
    modules["megatron.training.initialize"].initialize_megatron = initialize_megatron  # type: ignore[attr-defined]
    modules["megatron.training.initialize"].parse_args = parse_args  # imported by name, as Megatron does
    dist = modules["torch.distributed"]
    dist.init_process_group = lambda *a, **k: None  # type: ignore[attr-defined]
    dist.is_available = lambda: True  # type: ignore[attr-defined]
    dist.is_initialized = lambda: False  # type: ignore[attr-defined]
    modules["torch"].distributed = dist  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, wgrad_fallback.MODULE_NAME, raising=False)
    return modules


def _snapshot(modules: dict[str, types.ModuleType]) -> dict[str, object]:
    """Everything the plugin may change in a process, as it is now."""
    arguments, initialize = modules["megatron.training.arguments"], modules["megatron.training.initialize"]
    return {
        "modules": set(sys.modules), "stdout": sys.stdout, "path": list(sys.path),
        "override": hasattr(typing, "override"), "parse_args": arguments.parse_args,
        "parse_args_by_name": initialize.parse_args, "initialize_megatron": initialize.initialize_megatron,
        "validate_args": arguments.validate_args, "init_process_group": modules["torch.distributed"].init_process_group,
        "layers": dict(vars(modules["megatron.core.tensor_parallel.layers"])),
    }


def test_after_uninstall_the_process_is_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    PROCESS_CHANGES.uninstall()  # start from a process that carries nothing of an earlier test
    modules = _fake_megatron(monkeypatch)
    monkeypatch.delattr(typing, "override", raising=False)  # as on Python < 3.12
    arguments, initialize = modules["megatron.training.arguments"], modules["megatron.training.initialize"]
    layers, dist = modules["megatron.core.tensor_parallel.layers"], modules["torch.distributed"]
    before = _snapshot(modules)

    with megatron_importable(os.getcwd()):  # typing.override, and the tree on sys.path
        pass
    parse_hooks.hook_parse_path([], dry_run=False)  # parse_args rebound everywhere
    parse_hooks.install_from_argv([], environ={"MEGATRON_PERF_TOGGLES_DRY_RUN": "1"})  # stdout -> stderr
    safety_net.NET.install(arguments)  # validate_args wrapped
    wgrad_fallback.activate()  # sys.modules entry and the layers' attributes
    rank_check.arm({"toggles": {}})  # torch.distributed.init_process_group wrapped
    assert sys.stdout is sys.stderr and hasattr(typing, "override")
    assert arguments.parse_args is not before["parse_args"] and initialize.parse_args is arguments.parse_args
    assert arguments.validate_args is not before["validate_args"]
    assert dist.init_process_group is not before["init_process_group"]
    assert wgrad_fallback.MODULE_NAME in sys.modules and layers._grad_accum_fusion_available is True
    assert len(PROCESS_CHANGES.labels) >= 7, PROCESS_CHANGES.labels

    PROCESS_CHANGES.uninstall()

    after = _snapshot(modules)
    assert after == before
    assert parse_hooks.active() is None and not safety_net.NET.installed and run_context.current() is None


def test_a_dry_run_controller_plans_without_touching_the_process() -> None:
    """plan() writes the decisions onto the namespace and nothing else; a dry run applies nothing."""
    from megatron_perf_toggles.runtime import provenance, provider

    PROCESS_CHANGES.uninstall()
    controller = Controller({"MEGATRON_PERF_TOGGLES_ASSUME": "cuda,te=2.8"}, mode="dry-run")
    parser = provider.attach(argparse.ArgumentParser(), controller=controller)
    args = parser.parse_args([])
    assert controller.last is not None and controller.last.plan.wgrad_path == "fallback"
    assert args.perf_toggles == provenance.decision_records(controller.last.plan)
    assert {dest: {k: v for k, v in r.items() if k != "peak_memory_delta_mb"} for dest, r in args.perf_toggles.items()} \
        == {dest: d.to_record() for dest, d in controller.last.plan.decisions.items()}
    assert PROCESS_CHANGES.labels == [] and run_context.current() is None and wgrad_fallback.MODULE_NAME not in sys.modules


def test_a_plan_inside_a_scope_hands_a_launch_its_hooks_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """explain --megatron inside a launch's process: the scoped plan re-points the hooks (dry run,
    capture, providers, a dry-run controller), and the scope's end gives the launch its own back."""
    from megatron_perf_toggles.runtime.controller import process_controller
    from megatron_perf_toggles.runtime.provider import extra_args_provider

    PROCESS_CHANGES.uninstall()
    modules = _fake_megatron(monkeypatch)
    arguments = modules["megatron.training.arguments"]
    own_parse_args = arguments.parse_args

    def mine(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return parser

    hooks = parse_hooks.hook_parse_path([mine, extra_args_provider], dry_run=False)
    run_controller = hooks.controller_for_parse()

    def state() -> tuple[object, ...]:
        return (list(hooks.providers), hooks.dry_run, hooks.capture, hooks.out, hooks.controller, process_controller(),
                dict(hooks.wrappers), arguments.parse_args, parse_hooks.active())

    before = state()
    with PROCESS_CHANGES.scope():
        parse_hooks.hook_parse_path([extra_args_provider], dry_run=True, capture=True)
        planning = parse_hooks.active().controller_for_parse()
        assert planning is not run_controller and process_controller() is planning and hooks.dry_run
    assert state() == before and hooks.controller is run_controller
    PROCESS_CHANGES.uninstall()
    assert parse_hooks.active() is None and arguments.parse_args is own_parse_args and process_controller() is None


def test_the_safety_net_moved_to_another_megatron_moves_back(monkeypatch: pytest.MonkeyPatch) -> None:
    PROCESS_CHANGES.uninstall()
    first = _fake_megatron(monkeypatch)["megatron.training.arguments"]
    second = types.ModuleType("megatron.second_checkout.arguments")  # another tree's, as far as rebinding goes
    second.validate_args = lambda args, defaults=None: args  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, second.__name__, second)
    own_first, own_second = first.validate_args, second.validate_args
    safety_net.NET.install(first)
    with PROCESS_CHANGES.scope():
        safety_net.NET.install(second)
        assert safety_net.NET.module is second and first.validate_args is own_first
        assert second.validate_args is not own_second
    assert safety_net.NET.module is first and first.validate_args is not own_first
    assert second.validate_args is own_second
    PROCESS_CHANGES.uninstall()
    assert not safety_net.NET.installed and first.validate_args is own_first


def test_stand_in_imports_last_only_as_long_as_their_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The import stand-ins replace ``builtins.__import__`` for the block only, even when the block
    ends in an exception (a dry run ends in SystemExit)."""
    import builtins

    from megatron_perf_toggles.launcher import import_shims

    monkeypatch.setattr(import_shims, "installed", lambda name: False)  # as on a box without triton
    real = builtins.__import__
    with pytest.raises(SystemExit), megatron_importable(None):
        assert builtins.__import__ is not real
        raise SystemExit(0)
    assert builtins.__import__ is real
    with megatron_importable(None, stand_ins=False):
        assert builtins.__import__ is real


def test_a_plan_that_ends_the_process_leaves_compile_decorators_uncompiled() -> None:
    """A dry run runs nothing compiled; the first torch.compile would import TorchDynamo (seconds).
    Only a block that ends the process asks for it (``uncompiled``): a plan in a process that may
    train afterwards, and a real run, keep torch.compile. It lasts as long as the block."""
    torch = pytest.importorskip("torch")
    from megatron_perf_toggles.launcher import import_shims

    real_compile, real_disable = torch.compile, torch.compiler.disable

    def fn(x):
        return x

    with pytest.raises(SystemExit), megatron_importable(None, uncompiled=True):
        assert torch.compile(fn) is fn and torch.compile(mode="max-autotune")(fn) is fn
        assert torch.compiler.disable(fn) is fn and torch.compiler.disable(recursive=False)(fn) is fn
        raise SystemExit(0)
    assert (torch.compile, torch.compiler.disable) == (real_compile, real_disable)
    for kwargs in ({}, {"stand_ins": False}):  # a plan in a longer process; the launcher's real run
        with megatron_importable(None, **kwargs):
            assert (torch.compile, torch.compiler.disable) == (real_compile, real_disable)
    with PROCESS_CHANGES.scope():  # a patched checkout's dry run: for the rest of the process
        import_shims.install_stand_ins()
        assert torch.compile(fn) is fn
    assert torch.compile is real_compile


def test_nested_stand_ins_are_undone_by_whoever_put_them_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A patched checkout's dry run inside the launcher's block (as the tests' workers run one) puts
    nothing in place twice, so neither undo log restores the other's stand-in."""
    import builtins

    torch = pytest.importorskip("torch")
    from megatron_perf_toggles.launcher import import_shims

    monkeypatch.setattr(import_shims, "installed", lambda name: name == "torch")  # no triton here
    real = (builtins.__import__, torch.compile, torch.compiler.disable)

    def now():
        return builtins.__import__, torch.compile, torch.compiler.disable

    with PROCESS_CHANGES.scope():
        with megatron_importable(None, uncompiled=True):
            import_shims.install_stand_ins()
            assert not any(map(operator.is_, now(), real))
    assert all(map(operator.is_, now(), real))
    with PROCESS_CHANGES.scope():  # the other order
        import_shims.install_stand_ins()
        with megatron_importable(None, uncompiled=True):
            assert not any(map(operator.is_, now(), real))
        assert not any(map(operator.is_, now(), real))
    assert all(map(operator.is_, now(), real))


@pytest.fixture
def fresh_holders():
    from megatron_perf_toggles.runtime import rebinding

    rebinding.forget_holders()
    yield
    rebinding.forget_holders()


def _original():
    return "megatron's"


def _wrapper():
    return "wrapped"


def test_rebinding_sees_modules_added_or_replaced_since_its_last_walk(monkeypatch, fresh_holders):
    """The holders of stale references are kept between rebinds only while sys.modules holds the
    same modules under the same names: a module imported, re-imported or renamed since is walked."""
    from megatron_perf_toggles.runtime.rebinding import rebind

    first = types.ModuleType("megatron.ptt_rebind_first")
    first.fn = _original
    monkeypatch.setitem(sys.modules, first.__name__, first)
    assert rebind(_original, _wrapper, None) == 1 and first.fn is _wrapper
    later = types.ModuleType("megatron.ptt_rebind_later")  # imported after the first walk
    later.fn = _wrapper
    monkeypatch.setitem(sys.modules, later.__name__, later)
    assert rebind(_wrapper, _original, None) == 2 and first.fn is _original and later.fn is _original
    replaced = types.ModuleType(first.__name__)  # the same name, a new module object (a re-import)
    replaced.fn = _original
    monkeypatch.setitem(sys.modules, first.__name__, replaced)
    assert rebind(_original, _wrapper, None) == 2 and replaced.fn is _wrapper and later.fn is _wrapper
    outside = types.ModuleType("ptt_rebind_outside")  # not Megatron's: not walked ...
    outside.fn = _wrapper
    monkeypatch.setitem(sys.modules, outside.__name__, outside)
    assert rebind(_wrapper, _original, None) == 2 and outside.fn is _wrapper
    monkeypatch.delitem(sys.modules, outside.__name__)  # ... until the same object is Megatron's
    monkeypatch.setitem(sys.modules, "megatron.ptt_rebind_moved", outside)
    assert rebind(_wrapper, _original, None) == 1 and outside.fn is _original


def test_rebinding_never_takes_a_new_module_for_a_freed_one(monkeypatch, fresh_holders):
    """A module dropped and freed, and a new one made in its place (often at the same address),
    is a different module: its references are found."""
    import gc

    from megatron_perf_toggles.runtime.rebinding import rebind

    name = "megatron.ptt_rebind_reused"
    for _ in range(3):  # CPython nearly always hands the freed module's memory to the next one
        module = types.ModuleType(name)
        module.fn = _original
        monkeypatch.setitem(sys.modules, name, module)
        assert rebind(_original, _wrapper, None) == 1
        del sys.modules[name], module
        gc.collect(0)
        module = types.ModuleType(name)
        module.fn = _original
        sys.modules[name] = module
        assert rebind(_original, _wrapper, None) == 1 and module.fn is _wrapper
        del sys.modules[name], module


def test_rebinding_walks_again_for_another_checkout(monkeypatch, tmp_path, fresh_holders):
    from megatron_perf_toggles.runtime.rebinding import rebind

    for tree in ("a", "b"):
        module = types.ModuleType(f"ptt_rebind_tree_{tree}")
        module.__file__ = str(tmp_path / tree / "pretrain_gpt.py")
        module.fn = _original
        monkeypatch.setitem(sys.modules, module.__name__, module)
    assert rebind(_original, _wrapper, str(tmp_path / "a")) == 1
    assert rebind(_original, _wrapper, str(tmp_path / "b")) == 1
    assert sys.modules["ptt_rebind_tree_a"].fn is sys.modules["ptt_rebind_tree_b"].fn is _wrapper
