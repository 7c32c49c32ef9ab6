"""Precedence and resolution: each toggle's base value (command line > environment > profile >
plugin default), then the guards' changes applied with what each must respect.

A guard may not override an explicit command-line value unless it says so (then the user is
warned), may not take back room another guard made for an explicit request without saying so,
and may not take a toggle away from a feature that needs it (``guards.NEEDS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...errors import CannotHonourError, DependencyError
from .. import stock_off
from ..env import EnvSettings
from ..facts import Capabilities
from ..registry import BY_DEST, flag_words
from ..rules.guards import NEEDS
from .plan import Change, Context, Decision, Message

if TYPE_CHECKING:  # the profile module loads only when a profile is set (import time)
    from ..profile import Profile


def _check_needs(ctx: Context, dest: str, base: Decision, change: Change) -> None:
    """A guard is about to move ``dest`` away from ``base``: refuse with one line if something the
    user asked for needs ``base``'s value (Megatron would reject the command line otherwise)."""
    for need in NEEDS:
        if need.dest != dest or need.value != base.value or need.value == change.value \
                or not ctx.caps.megatron.has_rule(need.rule.id):
            continue
        words = need.feature(ctx)
        if words:
            raise DependencyError(dest, words, change.reason, change.hint)



def base_decision(dest: str, explicit: Mapping[str, Any], env: EnvSettings, stock: Mapping[str, Any],
          profile: Profile | None = None, preset: Mapping[str, Decision] | None = None,
          stock_from: Mapping[str, str] | None = None) -> Decision:
    """cli > env > config > profile > default. A profile applies with MEGATRON_PERF_TOGGLES=0 too, as set
    variables do: naming a profile is a request, not a default. With the plugin off the default is
    stock's value, labelled by ``stock_from`` (dest -> where stock takes it from, where that is not
    Megatron's own default: a front end's)."""
    toggle = BY_DEST[dest]
    if dest in explicit:
        value = explicit[dest]
        return Decision(value, "cli", f"set on the command line ({flag_words(dest, value)})")
    if dest in env.toggles:
        value = env.toggles[dest]
        raw = value if toggle.kind == "choice" else int(bool(value))
        return Decision(value, "env", f"{toggle.env}={raw}")
    if preset and dest in preset:
        return preset[dest]
    if profile is not None and dest in profile.toggles:
        return Decision(profile.toggles[dest].value, "profile", profile.reason(dest))
    if not env.plugin_enabled:
        return stock_off.stock_default(stock.get(dest, toggle.stock_default), (stock_from or {}).get(dest))
    return Decision(toggle.default, "default", f"plugin default; {toggle.env}=0 turns it off"
                    if toggle.kind == "bool" else f"plugin default; set {toggle.env} to change it")


def requested(dest: str, env: EnvSettings, profile: Profile | None = None) -> Decision:
    """What the environment and the profile ask for ``dest`` before any command line or guard
    (the same precedence as a launch): what ``megatron-perf-toggles flags`` turns into flags."""
    return base_decision(dest, {}, env, {}, profile)


class Resolution:
    """The decisions as the guards change them, with what each change must respect: the base
    decisions (cli, env, default), the explicit values a guard overrode (warned about), and the
    room one guard made for an explicit request that a later guard may not silently take back."""

    def __init__(self, decisions: dict[str, Decision], env: EnvSettings, caps: Capabilities) -> None:
        self.decisions = decisions
        self.base = dict(decisions)
        self.env, self.caps = env, caps
        self.messages: list[Message] = []
        self.overridden: dict[str, Message] = {}  # dest -> the warning that a cli/env value was overridden
        self.made_room: dict[str, Change] = {}  # dest -> the change that moved it for another explicit request

    def context(self, args: Mapping[str, Any], checkpoint: Mapping[str, Any] | None) -> Context:
        return Context(args=args, values={k: d.value for k, d in self.decisions.items()}, caps=self.caps,
                       env=self.env, checkpoint=checkpoint or {},
                       sources={k: d.source for k, d in self.decisions.items()})

    def apply(self, ctx: Context, change: Change) -> None:
        """One guard's change, or the CannotHonourError an explicit request gets instead."""
        current = self.decisions[change.dest]
        if current.value == change.value:
            # A guard that keeps the value still says how (e.g. which wgrad path runs).
            self.decisions[change.dest] = Decision(current.value, current.source, f"{current.reason}; {change.reason}")
            return
        if current.source == "cli" and change.yields_to_cli:
            return
        # MEGATRON_PERF_TOGGLES=0 means stock: what the command line or the configuration gave is
        # for Megatron's own checks to judge, stock's defaults stand; guards act only on what the
        # environment or a profile asked for.
        left = stock_off.left_alone(self.env, current.source)
        if left:
            self.decisions[change.dest] = Decision(current.value, current.source,
                                                   f"{current.reason}; {left} although {change.reason}")
            return
        if current.source == "cli" and not change.over_cli:
            raise CannotHonourError(change.dest, flag_words(change.dest, current.value), change.reason, change.hint)
        _check_needs(ctx, change.dest, self.base[change.dest], change)
        self._respect_room(change)
        assumed = bool(change.capability) and self.caps.is_assumed(change.capability)
        source = "assumed" if assumed else "guard"
        planned = "the planned stack" if self.caps.stack else "MEGATRON_PERF_TOGGLES_ASSUME"
        reason = change.reason + (f" (per {planned})" if assumed else "")
        first = self.base[change.dest]
        if change.value == first.value:  # a later guard gave back what the user or default asked for
            self.overridden.pop(change.dest, None)
            self.decisions[change.dest] = Decision(first.value, first.source, f"{first.reason}; {reason}")
            return
        if first.source in ("cli", "env", "config", "profile"):
            self.overridden[change.dest] = Message(
                "warning", f"{change.dest}: {first.value} ({first.reason}) overridden to {change.value}: {reason}")
        self.decisions[change.dest] = Decision(change.value, source, reason)

    def _respect_room(self, change: Change) -> None:
        room = self.made_room.get(change.dest)
        if room is not None and change.value != room.value:
            if not change.over_cli:
                raise CannotHonourError(change.dest, room.requested_by, change.reason, change.hint)
            self.messages.append(Message("warning", f"{room.requested_by} was requested, but {change.reason}; "
                                                    f"{change.dest} goes back to {change.value}"))
        if change.requested_by:
            self.made_room[change.dest] = change
