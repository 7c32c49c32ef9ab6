"""The argparse adapter: register missing flags in Megatron's groups, then decide right after parsing.

Megatron calls ``extra_args_provider(parser)`` before it parses. We add only the flag forms the
live parser lacks (so no "conflicting option string" on any version), give every toggle a
sentinel default so we can tell what the command line set, and wrap this parser's
``parse_known_args`` (which ``parse_args`` also goes through) so the decisions are on ``args``
by the time Megatron's ``parse_args`` returns, before ``validate_args``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ..core.ckpt_layout import checkpoint_facts
from ..core.decide import FP4_LAYER_DESTS, Decision, Message, Plan, decide
from ..core.env import EnvSettings, read_env
from ..core.registry import GROUPS, TOGGLES, Toggle
from ..errors import PerfTogglesError, fail
from . import provenance
from .capabilities import Capabilities, resolve
from .provenance import format_value

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
PLUGIN_GROUP_TITLE = "perf toggles (megatron-perf-toggles)"


class _Unset:
    def __repr__(self) -> str:
        return "<decided after parsing>"


UNSET: Any = _Unset()


class ProviderState:
    """What the provider learned at registration, and what the post-parse step decided."""

    def __init__(self, env: EnvSettings, environ: Mapping[str, str], stock: dict[str, Any],
                 watched: tuple[str, ...], added_flags: list[str], announce: bool = True,
                 capabilities: Capabilities | None = None, quiet: bool = False) -> None:
        self.env = env
        self.environ = environ
        self.stock = stock
        self.watched = watched
        self.added_flags = added_flags
        self.announce = announce
        self.quiet = quiet  # a dry run: its caller prints the decisions, nothing is written
        self.launch_id: str | None = None  # this launch's line in perf_toggles_history.jsonl
        self.capabilities = capabilities
        self.last_plan: Plan | None = None
        self.last_caps: Capabilities | None = None
        self.announced = False


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


def _default_words(toggle: Toggle, env: EnvSettings) -> str:
    if toggle.dest in env.toggles:
        return f"{format_value(env.toggles[toggle.dest])} (from {toggle.env})"
    if not env.plugin_enabled:
        return "Megatron's default (MEGATRON_PERF_TOGGLES=0)"
    return f"{format_value(toggle.default)} (plugin default; env {toggle.env})"


def _help(toggle: Toggle, env: EnvSettings) -> str:
    # argparse %-formats help text: escape literal percent signs.
    return f"{toggle.help} Default: {_default_words(toggle, env)}; guards may turn it off.".replace("%", "%%")


def register_flags(parser: argparse.ArgumentParser, env: EnvSettings) -> list[str]:
    """Add the forms the parser lacks; annotate the forms it has. Returns the flags added."""
    added: list[str] = []
    for toggle in TOGGLES:
        group = group_for(parser, toggle)
        forms: list[tuple[str, dict[str, Any]]] = []
        if toggle.kind == "bool":
            forms.append((toggle.flag, {"action": "store_true", "help": _help(toggle, env)}))
            forms.append((toggle.off_flag, {"action": "store_false", "help": f"Turn off {toggle.title}."}))
        else:
            forms.append((toggle.flag, {"choices": list(toggle.choices), "help": _help(toggle, env)}))
        for flag, kwargs in forms:
            existing = parser._option_string_actions.get(flag)
            if existing is None:
                group.add_argument(flag, dest=toggle.dest, **kwargs)
                added.append(flag)
            elif existing.dest == toggle.dest and existing.help is not argparse.SUPPRESS:
                note = f"[perf-toggles default: {_default_words(toggle, env)}]".replace("%", "%%")
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


def attach(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str] | None = None,
    announce: bool = True,
    capabilities: Capabilities | None = None,
    quiet: bool = False,
) -> argparse.ArgumentParser:
    """Make ``parser`` decide the toggles after parsing. Idempotent: a second call is a no-op.

    ``capabilities`` fixes what the machine can do (planning); by default it is detected when
    the arguments are parsed, honouring MEGATRON_PERF_TOGGLES_ASSUME.
    """
    if getattr(parser, "_perf_toggles_state", None) is not None:
        return parser
    environ = os.environ if environ is None else environ
    try:
        env = read_env(environ)
    except PerfTogglesError as error:
        fail(error)
    toggle_dests = [t.dest for t in TOGGLES]
    stock = _stock_defaults(parser, toggle_dests + list(FP4_LAYER_DESTS))
    for t in TOGGLES:
        stock.setdefault(t.dest, t.stock_default)
    added = register_flags(parser, env)
    present = {a.dest for a in parser._actions}
    watched = tuple(d for d in [*toggle_dests, *FP4_LAYER_DESTS] if d in present)
    parser.set_defaults(**{dest: UNSET for dest in watched})
    state = ProviderState(env=env, environ=dict(environ), stock=stock, watched=watched,
                          added_flags=added, announce=announce, capabilities=capabilities, quiet=quiet)
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):  # type: ignore[no-untyped-def]
        refuse_contradictions(sys.argv[1:] if args is None else args)
        ns, extras = original(args, namespace)
        post_parse(ns, state)
        return ns, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    arguments = sys.modules.get("megatron.training.arguments")
    if arguments is not None and hasattr(arguments, "validate_args"):
        from . import safety_net  # only where Megatron itself is parsing

        safety_net.NET.install(arguments)  # guard its validation too
    parser._perf_toggles_state = state  # type: ignore[attr-defined]
    return parser


def post_parse(ns: argparse.Namespace, state: ProviderState) -> Plan:
    explicit: dict[str, Any] = {}
    for dest in state.watched:
        value = getattr(ns, dest, UNSET)
        if value is UNSET:
            setattr(ns, dest, state.stock.get(dest))
        else:
            explicit[dest] = value
    from . import resume  # reading the resumed checkpoint's history is safe when planning too

    writer = resume.checkpoint_writer(vars(ns))
    try:
        caps = state.capabilities or resolve(state.env.assume)
        plan = decide(vars(ns), explicit, state.env, caps, state.stock, checkpoint=writer)
    except PerfTogglesError as error:
        fail(error)
    original_dirs = {dest: getattr(ns, dest) for dest in plan.log_dirs}
    for dest, decision in plan.decisions.items():
        setattr(ns, dest, decision.value)
    if caps.assumed and state.capabilities is None:
        plan.messages.append(Message("warning", "MEGATRON_PERF_TOGGLES_ASSUME is set: these decisions rest on "
                                     "planned capabilities, not on this machine's"))
    if plan.wgrad_path == "fallback" and state.capabilities is None:
        from . import wgrad_fallback

        # A real run on this machine, not a plan for another one; a fallback that is only assumed
        # (MEGATRON_PERF_TOGGLES_ASSUME) is installed only where it can really run.
        if not caps.is_assumed("wgrad_fallback") or wgrad_fallback.usable()[0]:
            wgrad_fallback.activate()
    for dest, path in plan.log_dirs.items():
        setattr(ns, dest, path)
    ns.perf_toggles_precision = plan.precision
    state.last_plan = plan
    state.last_caps = caps
    _publish(ns, state, plan, caps)
    if state.capabilities is None:  # a real run on this machine, not a plan for another one
        plan.messages.extend(resume.compare_with_checkpoint(writer, ns.perf_toggles))
    if state.announce and state.env.rank == 0 and not state.announced:
        state.announced = True
        for line in provenance.lines(plan, original_dirs):
            print(line, flush=True)
        _persist(ns, state, plan, caps)
    net = sys.modules.get(f"{__package__}.safety_net")
    if net is not None and net.NET.installed:
        net.NET.watch(ns, state.stock, functools.partial(_backed_off, state=state, plan=plan, caps=caps))
    return plan


def _publish(ns: argparse.Namespace, state: ProviderState, plan: Plan, caps: Capabilities) -> None:
    """The decisions onto ``args.perf_toggles``, and (a real run) into the cross-rank check."""
    ns.perf_toggles = {dest: d.to_record() for dest, d in plan.decisions.items()}
    if state.capabilities is None:  # a real run on this machine, not a plan for another one
        from . import rank_check

        rank_check.arm(rank_check.fingerprint(ns.perf_toggles, caps.to_record(), plan.wgrad_path),
                       enabled=state.env.rank_check)


def _persist(ns: argparse.Namespace, state: ProviderState, plan: Plan, caps: Capabilities) -> None:
    """Rank 0 of a real run: the JSON record beside the logs, and the launch history in --save."""
    payload = provenance.build_record(plan, caps, state.env.raw_for_record(state.environ), sys.argv)
    directory = provenance.record_dir(plan, vars(ns))
    try:
        if directory:
            provenance.write_atomic(directory, payload)
        if state.capabilities is None:
            from . import resume

            facts = checkpoint_facts(vars(ns), bool(ns.grad_reduce_in_bf16), caps.megatron.version,
                                     caps.torch_version)
            state.launch_id = state.launch_id or resume.new_launch_id()
            resume.record_launch(getattr(ns, "save", None), ns.perf_toggles, plan.precision, facts,
                                 launch_id=state.launch_id)
    except OSError as error:
        print(f"{provenance.PREFIX} warning: could not write the provenance record: {error}",
              file=sys.stderr, flush=True)


def _backed_off(ns: argparse.Namespace, dests: list[str], reason: str, *, state: ProviderState, plan: Plan,
                caps: Capabilities) -> None:
    """The safety net turned plugin defaults back to Megatron's values: record it everywhere the
    first decision went (the plan, ``args.perf_toggles``, the record, the history, the rank check)."""
    changed = {}
    for dest in dests:
        changed[dest] = plan.decisions[dest] = Decision(getattr(ns, dest), "guard", reason)
    _publish(ns, state, plan, caps)
    from .safety_net import FOUND_AT_RUN_TIME

    warning = Message("warning", f"Megatron rejected the plugin default of {', '.join(dests)}, {FOUND_AT_RUN_TIME}; "
                                 "it was turned back to Megatron's default for this run. Please report it to "
                                 "megatron-perf-toggles so a guard can cover it.")
    plan.messages.append(warning)
    if state.env.rank == 0 and not state.quiet:
        # The table went out at parse time (from this parse or an earlier one): print what changed,
        # once, and rewrite the record and this launch's history line. A dry run prints the plan itself.
        for line in provenance.lines(Plan(changed, plan.precision, {}, [warning], plan.wgrad_path)):
            print(line, flush=True)
        _persist(ns, state, plan, caps)


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's ``extra_args_provider`` hook: register the toggles on ``parser`` and return it."""
    return attach(parser)


def chain_providers(*providers: Provider | None) -> Provider:
    """One provider that runs each given provider in order (``None`` entries are skipped).

    Use it to combine this plugin with Megatron's ModelOpt provider or a fork's own provider::

        pretrain(..., extra_args_provider=chain_providers(add_modelopt_args, extra_args_provider))
    """
    chain: list[Provider] = []
    for p in providers:
        if p is not None and p not in chain:
            chain.append(p)

    def chained(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in chain:
            result = provider(parser)
            parser = parser if result is None else result
        return parser

    chained.providers = tuple(chain)  # type: ignore[attr-defined]
    return chained
