"""The argparse adapter: register missing flags in Megatron's groups, then hand each parse to the controller.

Megatron calls ``extra_args_provider(parser)`` before it parses. We add only the flag forms the
live parser lacks (so no "conflicting option string" on any version), give every toggle a
sentinel default so we can tell what the command line set, and wrap this parser's
``parse_known_args`` (which ``parse_args`` also goes through) so that the controller
(``controller.py``) has planned and applied the decisions by the time Megatron's ``parse_args``
returns, before ``validate_args``. Nothing else happens here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core.decision.decide import FP4_LAYER_DESTS, requested
from ..core.env import EnvSettings
from ..core.facts import Capabilities
from ..core.registry import GROUPS, TOGGLES, Toggle, format_value
from ..errors import PerfTogglesError, fail
from .context import current
from .controller import UNSET, Controller, Registration, new_context
from .controller import new_controller as controller_factory

if TYPE_CHECKING:  # the profile modules load only when a profile is named (start-up time)
    from ..core.profile import Profile

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
PLUGIN_GROUP_TITLE = "perf toggles (megatron-perf-toggles)"
PARSER_ATTR = "_perf_toggles_registration"


def _group_of(parser: argparse.ArgumentParser, flag: str) -> argparse._ArgumentGroup | None:
    action = parser._option_string_actions.get(flag)
    if action is None:
        return None
    for group in parser._action_groups:
        if action in group._group_actions:
            return group
    return None


def group_for(parser: argparse.ArgumentParser, toggle: Toggle) -> argparse._ArgumentGroup:
    """The group of the toggle's nearest existing neighbour, else the group with Megatron's
    title for that kind of setting, else our own group."""
    for anchor in toggle.anchors:
        group = _group_of(parser, anchor)
        if group is not None:
            return group
    by_title = {g.title: g for g in parser._action_groups}
    for title in GROUPS[toggle.group].titles:
        if title in by_title:
            return by_title[title]
    return by_title.get(PLUGIN_GROUP_TITLE) or parser.add_argument_group(PLUGIN_GROUP_TITLE)


def _default_words(toggle: Toggle, env: EnvSettings, profile: Profile | None = None) -> str:
    """What the toggle is without its flag: the plan's own env > profile > default chain, in words."""
    asked = requested(toggle.dest, env, profile)
    if asked.source == "env":
        return f"{format_value(asked.value)} (from {toggle.env})"
    if asked.source == "profile" and profile is not None:
        return f"{format_value(asked.value)} (from the profile {profile.source})"
    if not env.plugin_enabled:
        return "Megatron's default (MEGATRON_PERF_TOGGLES=0)"
    return f"{format_value(toggle.default)} (plugin default; env {toggle.env})"


def _help(toggle: Toggle, env: EnvSettings, profile: Profile | None = None) -> str:
    # argparse %-formats help text: escape literal percent signs.
    words = _default_words(toggle, env, profile)
    return f"{toggle.help} Default: {words}; guards may turn it off.".replace("%", "%%")


def register_flags(parser: argparse.ArgumentParser, env: EnvSettings, profile: Profile | None = None) -> list[str]:
    """Add the forms the parser lacks; annotate the forms it has. Returns the flags added."""
    added: list[str] = []
    for toggle in TOGGLES:
        group = group_for(parser, toggle)
        forms: list[tuple[str, dict[str, Any]]] = []
        if toggle.kind == "bool":
            forms.append((toggle.flag, {"action": "store_true", "help": _help(toggle, env, profile)}))
            forms.append((toggle.off_flag, {"action": "store_false", "help": f"Turn off {toggle.title}."}))
        else:
            forms.append((toggle.flag, {"choices": list(toggle.choices), "help": _help(toggle, env, profile)}))
        for flag, kwargs in forms:
            existing = parser._option_string_actions.get(flag)
            if existing is None:
                group.add_argument(flag, dest=toggle.dest, **kwargs)
                added.append(flag)
            elif existing.dest == toggle.dest and existing.help is not argparse.SUPPRESS:
                note = f"[perf-toggles default: {_default_words(toggle, env, profile)}]".replace("%", "%%")
                if note not in (existing.help or ""):
                    existing.help = f"{existing.help or ''} {note}".strip()
    return added


def _stock_defaults(parser: argparse.ArgumentParser, dests: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dest in dests:
        if dest in parser._defaults:
            out[dest] = parser._defaults[dest]
            continue
        for action in parser._actions:
            if action.dest == dest:
                out[dest] = action.default
                break
    return out


def refuse_contradictions(words: Any) -> None:
    """``--x`` and ``--no-x`` of one toggle on one command line: argparse would let the last one
    win in silence; which one was meant is not ours to guess, so the run stops with one line."""
    given = {str(w).split("=", 1)[0] for w in words or () if str(w).startswith("--")}
    for toggle in TOGGLES:
        if toggle.kind == "bool" and toggle.flag in given and toggle.off_flag in given:
            fail(PerfTogglesError(f"{toggle.flag} and {toggle.off_flag} are both on the command line",
                                  f"keep one; {toggle.env}=0/1 sets it from the environment instead"))


def new_controller(environ: Mapping[str, str] | None = None, **kwargs: Any) -> Controller:
    """A controller for ``environ`` (``controller.new_controller``, the one place one is made); a bad
    environment variable ends the run with one line."""
    try:
        return controller_factory(environ, **kwargs)
    except PerfTogglesError as error:
        fail(error)


def attach(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str] | None = None,
    announce: bool = True,
    capabilities: Capabilities | None = None,
    controller: Controller | None = None,
) -> argparse.ArgumentParser:
    """Register the toggles on ``parser`` and hand each of its parses to a controller, which plans
    (and, in a real run, applies) the decisions before ``parse_args`` returns. Idempotent.

    ``controller`` is the process's controller (the launcher keeps one across parses); without
    one, a new one is made: a real run on this machine, or, given ``capabilities``, a plan for
    the machine they describe.
    """
    if getattr(parser, PARSER_ATTR, None) is not None:
        return parser
    if controller is None:
        controller = new_controller(environ, mode="plan" if capabilities is not None else "run",
                                    capabilities=capabilities, announce=announce)
    toggle_dests = [t.dest for t in TOGGLES]
    stock = _stock_defaults(parser, toggle_dests + list(FP4_LAYER_DESTS))
    for t in TOGGLES:
        stock.setdefault(t.dest, t.stock_default)
    added = register_flags(parser, controller.env, controller.profile)
    present = {a.dest for a in parser._actions}
    watched = tuple(d for d in [*toggle_dests, *FP4_LAYER_DESTS] if d in present)
    parser.set_defaults(**{dest: UNSET for dest in watched})
    reg = Registration(controller, stock, watched, added)
    original = parser.parse_known_args

    def parse_known_args(args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        refuse_contradictions(sys.argv[1:] if args is None else args)
        ns, extras = original(args, namespace)
        try:
            controller.plan(ns, reg)
        except PerfTogglesError as error:
            fail(error)
        controller.apply(ns, reg)
        return ns, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign, assignment]  # argparse's is overloaded
    arguments = sys.modules.get("megatron.training.arguments")
    if arguments is not None and hasattr(arguments, "validate_args"):
        from . import safety_net  # only where Megatron itself is parsing

        safety_net.NET.install(arguments)  # guard its validation too
    setattr(parser, PARSER_ATTR, reg)  # the one reference on the parser: to its registration
    return parser


def registration(parser: argparse.ArgumentParser) -> Registration | None:
    """What :func:`attach` registered on ``parser`` (its controller, flags added, defaults)."""
    return getattr(parser, PARSER_ATTR, None)


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider`` hook: register the toggles on ``parser`` and return it.

    Inside a launcher's (or a patched script's, or a planning run's) context, this parse joins its
    controller. Called bare, it is an entry point of its own: a fresh run context for this parser,
    installed for the process, where ``check_ranks()`` finds the fingerprint later."""
    ctx = current()
    if ctx is None or ctx.entry == "provider":
        ctx = new_context("provider", controller=False).install()
        new_controller(ctx.environ, context=ctx)
    return attach(parser, controller=ctx.controller)


def flatten(providers: Iterable[Provider | None]) -> list[Provider]:
    """Skip ``None``, expand ``chain_providers`` results, keep the first of any repeat."""
    out: list[Provider] = []

    def add(p: Provider | None) -> None:
        if p is None:
            return
        inner = getattr(p, "providers", None)
        if isinstance(inner, tuple):
            for q in inner:
                add(q)
        elif p not in out:
            out.append(p)

    for p in providers:
        add(p)
    return out


def chain_providers(*providers: Provider | None) -> Provider:
    """One provider that runs each given provider in order (``None`` entries are skipped).

    Use it to combine this plugin with Megatron's ModelOpt provider or a fork's own provider::

        pretrain(..., extra_args_provider=chain_providers(add_modelopt_args, extra_args_provider))
    """
    chain = flatten(providers)

    def chained(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in chain:
            result = provider(parser)
            parser = parser if result is None else result
        return parser

    chained.providers = tuple(chain)  # type: ignore[attr-defined]
    return chained


# Records and messages name the provider as users write it (``megatron_perf_toggles:extra_args_provider``),
# not by the module that happens to define it.
extra_args_provider.__module__ = chain_providers.__module__ = "megatron_perf_toggles"
