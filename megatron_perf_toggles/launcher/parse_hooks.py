"""Put extra_args_providers into Megatron's own parse path, on every version, without editing Megatron.

Megatron parses in ``megatron.training.arguments.parse_args(extra_args_provider, ...)``. Up to core
0.17 it is reached through ``pretrain() -> initialize_megatron()``, whose module imported
``parse_args`` by name; from 0.18 the script calls ``parse_and_validate_args()`` itself, which looks
``parse_args`` up in its own module. So we replace ``parse_args`` in its module *and* every stale
reference to the original that an already-imported module holds, with a wrapper that chains the
caller's provider (ModelOpt's, a fork's combined one) with ours. The caller's provider always runs
first and is never replaced; a provider named twice runs once.

Dry run: ``initialize_megatron`` (up to 0.17) and ``parse_and_validate_args`` (0.18+) are wrapped
too, only to learn the ``args_defaults`` the script passed. In a dry run they hand over to
``dry_run.py``, which parses and validates exactly as Megatron would, reports the plan
on stdout (Megatron's own chatter goes to stderr) and exits 0, before anything touches CUDA.

Nothing here imports Megatron or torch at module import time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import io
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..core.env import EnvSettings, read_bool_setting, read_env
from ..core.facts import parse_assume
from ..errors import PerfTogglesError, fail
from ..runtime import context as run_context
from ..runtime import provider as plugin
from ..runtime.context import Mode, RunContext
from ..runtime.controller import Controller, Outcome, new_context
from ..runtime.machine import target as planned
from ..runtime.provider import flatten
from ..runtime.rebinding import ORIGINAL_ATTR, megatron_root, rebind
from .import_shims import import_failure
from .provider_specs import DEFAULT_PROVIDER_ATTR as DEFAULT_PROVIDER_ATTR  # the launcher's help names it
from .provider_specs import PROVIDER_FLAG, check_provider_spec, provider_name, pull_provider_specs, resolve_provider
from .provider_specs import ProviderSpecError as ProviderSpecError  # what resolve_provider raises

Provider = plugin.Provider

DRY_RUN_ENV = "MEGATRON_PERF_TOGGLES_DRY_RUN"  # registered in core.registry.SETTINGS
MEGATRON_HINT = "put the Megatron-LM checkout on PYTHONPATH, e.g. PYTHONPATH=/path/to/Megatron-LM"


class MegatronImportError(PerfTogglesError):
    """Megatron-LM's ``megatron.training`` cannot be imported."""


class HookError(PerfTogglesError):
    """This Megatron's parse path does not have the shape the hooks rely on."""


def dry_run_requested(environ: Mapping[str, str] | None = None) -> bool:
    """``MEGATRON_PERF_TOGGLES_DRY_RUN`` as a boolean (EnvValueError on a bad spelling)."""
    environ = os.environ if environ is None else environ
    return bool(read_bool_setting(DRY_RUN_ENV, environ))


# --- the chain that runs inside Megatron's parse_args ---------------------------------------------


@dataclass(slots=True)
class ProviderRun:
    """One provider as it ran on one parser: the argument dests it added."""

    name: str
    added: list[str]


class Chain:
    """The provider Megatron receives: the caller's, then ours; remembers what each one added."""

    def __init__(self, providers: Sequence[Provider], hooks: Hooks) -> None:
        self.providers = tuple(providers)
        self.hooks = hooks
        self.runs: list[ProviderRun] = []
        self.parser: argparse.ArgumentParser | None = None  # the parser Megatron built, once it has

    def __call__(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        self.runs = []
        self.parser = parser
        if self.includes_plugin:
            self.hooks.controller_for_parse()
        for p in self.providers:
            before = {id(a) for a in parser._actions}
            if p is plugin.extra_args_provider:
                # One controller for every parse of the process: the table is announced once, not
                # once per parse; a dry run's controller applies nothing and the dry run prints.
                result = plugin.attach(parser, controller=self.hooks.controller_for_parse())
            else:
                result = p(parser)
            parser = parser if result is None else result
            added = [a.dest for a in parser._actions if id(a) not in before and a.dest != argparse.SUPPRESS]
            self.runs.append(ProviderRun(provider_name(p), list(dict.fromkeys(added))))
        self.parser = parser
        return parser

    def options(self) -> list[str]:
        """Every flag of the parser Megatron built (none before it has): what a refusal's
        "did you mean" picks from."""
        parser = self.parser
        return [] if parser is None else [o for action in parser._actions for o in action.option_strings]

    @property
    def includes_plugin(self) -> bool:
        return plugin.extra_args_provider in self.providers


# --- installing into Megatron ---------------------------------------------------------------------


@dataclass(slots=True)
class Hooks:
    """What is installed: our providers, dry-run or not, and the Megatron functions we replaced."""

    providers: list[Provider]
    context: RunContext  # the run context these hooks belong to: it holds the controller and the target
    dry_run: bool = False
    root: str | None = None
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)
    wrappers: dict[str, Callable[..., Any]] = field(default_factory=dict)
    last_chain: Chain | None = None
    out: TextIO | None = None  # where a dry run prints its report: stdout as it was at install time
    capture: bool = False  # a dry run hands its record to the caller (explain) instead of printing it
    err: TextIO | None = None  # where a dry run's one-line error goes: stderr as it was at install time
    chatter: io.StringIO | None = None  # the script's and Megatron's own output, held for a summary's log
    output: str = "summary"  # what a dry run prints: summary | json | verbose (MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT)
    fail_if_no_fit: bool = False  # a dry run whose plan does not fit exits 3 (--fail-if-no-fit)

    @property
    def controller(self) -> Controller | None:
        """The context's controller: made at the first parse that includes the plugin."""
        return self.context.controller

    @property
    def target(self) -> planned.Target | None:
        """The world and GPU a dry run plans for (runtime/machine/target.py): the context's."""
        return self.context.target

    def controller_for_parse(self) -> Controller:
        """The context's controller (made on first use, so a bad variable is reported at the parse);
        a provider that calls extra_args_provider itself joins it through the context."""
        ctx = self.context
        if ctx.controller is None:
            plugin.new_controller(mode="dry-run" if self.dry_run else "run", target=ctx.target, context=ctx)
        assert ctx.controller is not None
        ctx.controller.target = ctx.target  # a later hook_parse_path may have named another job
        return ctx.controller

    def outcome(self) -> Outcome | None:
        """The plan of the last parse, if the plugin was in its provider chain."""
        chain = self.last_chain
        if chain is None or not chain.includes_plugin or self.controller is None:
            return None
        return self.controller.last

    def chain(self, caller: Provider | None) -> Chain:
        own: list[Provider | None] = list(caller.providers) if isinstance(caller, Chain) else [caller]  # never nest our chain
        return Chain(flatten([*own, *self.providers]), self)


def active() -> Hooks | None:
    """The hooks of the installed run context, if any (the wrappers Megatron calls bare ask)."""
    ctx = run_context.current()
    return None if ctx is None else ctx.hooks


def import_megatron() -> tuple[types.ModuleType, ...]:
    """Import ``megatron.training.{arguments,initialize,training}``, or one clear error."""
    try:
        arguments = importlib.import_module("megatron.training.arguments")
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing in ("megatron", "megatron.training", "megatron.training.arguments"):
            found = "" if missing == "megatron" else " (a megatron package without megatron.training: " \
                "PyPI's megatron-core has only megatron.core)"
            raise MegatronImportError(f"cannot import Megatron-LM's megatron.training{found}",
                                      MEGATRON_HINT) from None
        raise MegatronImportError(f"importing megatron.training.arguments failed: {error}",
                                  "install Megatron-LM's requirements") from None
    except Exception as error:  # noqa: BLE001 - a broken checkout is one clear line
        what, hint = import_failure(error)
        raise MegatronImportError(f"importing megatron.training.arguments failed: {what}", hint) from None
    modules = [arguments]
    for name in ("megatron.training.initialize", "megatron.training.training"):
        try:
            modules.append(importlib.import_module(name))
        except Exception as error:  # noqa: BLE001
            what, hint = import_failure(error)
            raise MegatronImportError(f"importing {name} failed: {what}", hint) from None
    return tuple(modules)


def _signature(fn: Callable[..., Any], needs: tuple[str, ...]) -> inspect.Signature:
    sig = inspect.signature(fn)
    missing = [n for n in needs if n not in sig.parameters]
    if missing:
        raise HookError(f"{provider_name(fn)} takes no {', '.join(missing)}: this Megatron's parse path is "
                        "not one megatron-perf-toggles knows", "pass the plugin as extra_args_provider by hand")
    return sig


def _wrap_parse_args(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = _signature(original, ("extra_args_provider",))

    @functools.wraps(original)
    def parse_args(*args: Any, **kwargs: Any) -> Any:
        hooks = active()
        if hooks is None:
            return original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        caller = bound.arguments.get("extra_args_provider")
        if caller is None and bound.arguments.get("ignore_unknown_args"):
            # Megatron's own peeks (in-process restart, fault tolerance) parse without any provider;
            # in a dry run, a value one of them refuses is the dry run's one line too.
            if not hooks.dry_run:
                return original(*args, **kwargs)
            from . import parse_refusal
            from .dry_run import ReportedExit

            with parse_refusal.said_in_one_line(hooks, ReportedExit):
                return original(*args, **kwargs)
        chain = hooks.chain(caller)
        bound.arguments["extra_args_provider"] = chain
        hooks.last_chain = chain
        return original(*bound.args, **bound.kwargs)

    setattr(parse_args, ORIGINAL_ATTR, original)
    return parse_args


def _wrap_entry(original: Callable[..., Any], via: str) -> Callable[..., Any]:
    """``initialize_megatron`` (<= 0.17) / ``parse_and_validate_args`` (0.18+): pass through,
    except in a dry run, where they parse and validate, report, and exit."""
    sig = _signature(original, ("extra_args_provider", "args_defaults"))

    @functools.wraps(original)
    def entry(*args: Any, **kwargs: Any) -> Any:
        hooks = active()
        if hooks is None or not hooks.dry_run:
            return original(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        from .dry_run import dry_run  # the dry run's report lives beside the hooks

        dry_run(hooks, a.get("extra_args_provider"), bool(a.get("ignore_unknown_args")),
                dict(a.get("args_defaults") or {}), a.get("parsed_args"), via)

    setattr(entry, ORIGINAL_ATTR, original)
    return entry


def _targets(arguments: types.ModuleType, initialize: types.ModuleType) -> list[tuple[str, types.ModuleType, str]]:
    """(key, module, attribute) of each Megatron function to wrap on this version."""
    out = [("parse_args", arguments, "parse_args")]
    if hasattr(arguments, "parse_and_validate_args"):
        out.append(("parse_and_validate_args", arguments, "parse_and_validate_args"))
    init = getattr(initialize, "initialize_megatron", None)
    if init is not None and "args_defaults" in inspect.signature(getattr(init, ORIGINAL_ATTR, init)).parameters:
        out.append(("initialize_megatron", initialize, "initialize_megatron"))
    return out


def context_mode(dry_run: bool, capture: bool) -> Mode:
    """What a run context with these hooks is: a plan handed back, a dry run, or a run."""
    return "plan" if capture else ("dry-run" if dry_run else "run")


def hook_parse_path(providers: Sequence[Provider | None], *, dry_run: bool = False,
            target: planned.Target | None = None, capture: bool = False, output: str = "summary",
            out: TextIO | None = None, err: TextIO | None = None, chatter: io.StringIO | None = None,
            context: RunContext | None = None, fail_if_no_fit: bool = False) -> Hooks:
    """Chain ``providers`` into every parse Megatron makes from now on (importing Megatron).

    The hooks belong to ``context`` (default: the installed one; with none, one is made for the
    caller and installed). A second call updates the providers and the dry-run switch; it never
    wraps twice. ``target`` is the world and GPU a dry run's parse and validate see; ``capture``
    makes a dry run hand its record to the context (``RunContext.stop``) instead of printing it.
    """
    arguments, initialize, _training = import_megatron()
    root = megatron_root(arguments)
    ctx = context or run_context.current()
    if ctx is None:
        ctx = new_context("launcher", mode=context_mode(dry_run, capture), target=target, controller=False)
    ctx.install()
    undo = ctx.undo
    hooks = ctx.hooks
    if hooks is None:
        hooks = Hooks(providers=[], context=ctx)
        undo.set_attr(ctx, "hooks", hooks, "run context: parse hooks")
    # Every change to hooks already in place goes through the undo log, so that a scoped plan
    # hands a launch's hooks back exactly as they were.
    fields: dict[str, Any] = {"providers": flatten(providers), "dry_run": dry_run,
                              "out": (out or sys.stdout) if dry_run else None, "chatter": chatter,
                              "err": (err or sys.stderr) if dry_run else None, "root": root,
                              "capture": capture, "output": output, "fail_if_no_fit": fail_if_no_fit}
    for name, value in {"target": target, "mode": context_mode(dry_run, capture)}.items():
        if getattr(ctx, name) is not value and getattr(ctx, name) != value:
            undo.set_attr(ctx, name, value, f"run context: {name}")
    if hooks.dry_run != dry_run and ctx.controller is not None:
        # a controller's mode is fixed: the next parse makes the right one
        undo.set_attr(ctx, "controller", None, "run context: controller")
    for name, value in fields.items():
        if getattr(hooks, name) is not value:
            undo.set_attr(hooks, name, value, f"parse hooks: {name}")
    for key, module, attr in _targets(arguments, initialize):
        current = getattr(module, attr)
        original = getattr(current, ORIGINAL_ATTR, current)
        wrapper = current if current is not original else (
            _wrap_parse_args(original) if key == "parse_args" else _wrap_entry(original, key)
        )
        if hooks.wrappers.get(key) is not wrapper:
            undo.set_item(hooks.originals, key, original, f"parse hooks: original {key}")
            undo.set_item(hooks.wrappers, key, wrapper, f"parse hooks: wrapper {key}")
        rebind(original, wrapper, root)
        if current is original:  # newly wrapped: undone (newest first) before the records above
            undo.on_uninstall(f"Megatron's {attr}, rebound wherever it was imported",
                                 functools.partial(rebind, wrapper, original, root))
    return hooks


def install_from_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """For scripts (the in-tree pretrain_gpt.py patch): install every ``--extra-args-provider``
    named in ``argv`` and return ``argv`` without them. ``MEGATRON_PERF_TOGGLES_DRY_RUN=1`` makes
    it a dry run, in which the script's own output moves to stderr so that stdout carries the report
    alone. Errors end the process with one line and exit status 2."""
    environ = os.environ if environ is None else environ
    try:
        specs, rest = pull_provider_specs(argv)
        dry = dry_run_requested(environ)
        if not specs and not dry:
            return list(argv)
        # Everything the user set is checked before Megatron is imported, as the launcher does.
        settings = preflight(environ)
        for spec in specs:
            check_provider_spec(spec)
        target = planned.from_environment(environ) if dry else None
        if dry:
            from .import_shims import install_stand_ins

            # triton, which core 0.16+ import, on a machine without it; for another machine's plan, no
            # Transformer Engine of this machine's that does not import
            install_stand_ins(elsewhere=planned.elsewhere(target))
        # The patched script's entry point: its run context, installed for the process.
        ctx = new_context("script", environ, mode=context_mode(dry, False), target=target, controller=False).install()
        hook_parse_path([resolve_provider(spec) for spec in specs], dry_run=dry, target=target,
                        output=settings.dry_run_output or "summary", context=ctx,
                        fail_if_no_fit=settings.fail_if_no_fit)
    except PerfTogglesError as error:
        fail(error)
    if dry:
        # The process ends in the dry run; hooks.out keeps the real stdout for the report.
        ctx.undo.set_attr(sys, "stdout", sys.stderr, "sys.stdout -> sys.stderr (dry run)")
    return rest


def prepare_from_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """For the top of a patched script, above its imports: with ``--extra-args-provider`` in
    ``argv``, check every variable, the profile, each provider spec and the planned job (one line
    and exit status 2 on a bad one, in well under a second), and for a dry run put the import
    stand-ins (triton) in place, so a CPU machine plans as the launcher does. Changes nothing else."""
    environ = os.environ if environ is None else environ
    if not any(str(arg).split("=", 1)[0] == PROVIDER_FLAG for arg in argv):
        return
    try:
        preflight(environ)
        for spec in pull_provider_specs(argv)[0]:
            check_provider_spec(spec)
        if dry_run_requested(environ):
            target = planned.from_environment(environ)
            from .import_shims import install_stand_ins

            install_stand_ins(elsewhere=planned.elsewhere(target))
    except PerfTogglesError as error:
        fail(error)


def preflight(environ: Mapping[str, str]) -> EnvSettings:
    """Every variable, the profile and the planned job, checked in well under a second and before
    Megatron is imported: a bad value is one line on every path (launcher, patched script)."""
    settings = read_env(environ)
    if settings.assume:
        parse_assume(settings.assume)
    if settings.profile_path:
        from ..runtime import profile_file

        profile_file.load(settings.profile_path)
    if settings.plan:
        planned.parse_plan(settings.plan)
    return settings
