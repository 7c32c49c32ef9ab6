"""What a configuration front end (Megatron-Bridge, Primus) hands the one pipeline, and how.

A front end is an adapter with two jobs: read what its configuration says, and write a plan back.
It reads into a :class:`Found`: the arguments the guards and the memory model look at (under
Megatron's dests, layout facts included), each toggle value with its tier (``explicit``: named by
the caller, held as a command-line flag is; ``configured``: set by the configuration itself, the
``config`` tier; otherwise the environment, a profile or the plugin default decide), the value
that stands with the plugin switched off, and the front end's own name for every argument
(``words``: a Bridge field path, a Primus YAML key).

Everything else happens once, for argparse and the front ends alike, behind the
:class:`~.controller.Controller` of a :class:`~.context.RunContext` made here per entry point
(:func:`start`): the decision (``core.decision.decide.decide``: environment, profile, precedence, guards,
memory guard), the records on the namespace, the resume comparison and history, the start-up
table and ``perf_toggles.json``, the wgrad fallback, the cross-rank check and the safety net.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ..core.decision.decide import Decision, Plan
from ..core.env import EnvSettings, read_env
from ..core.facts import Capabilities, MegatronFacts, megatron_facts_from_surface, version_tuple
from ..core.registry import BY_DEST
from ..runtime.context import FrontEnd, Mode, RunContext
from ..runtime.controller import Controller, Registration, new_context
from ..runtime.machine.capabilities import for_plan

__all__ = ["Found", "capabilities", "explained", "facts_for_version", "plan", "planned", "read_env", "speaker", "start",
           "take_over"]


@dataclass(slots=True)
class Found:
    """What a front end read from its configuration object.

    ``args``: everything the guards may read, under Megatron's dests; ``configured``: dest ->
    (value, where) for toggle values the configuration set; ``explicit``: dest -> (value, where)
    for those the caller named; ``stock``: dest -> the value that stands when the plugin is
    switched off (the configuration's own); ``stock_from``: dest -> where that value comes from, in
    words, where the front end knows better than "the configuration's default" (Primus: its own YAML
    defaults, or Megatron's); ``words``: dest -> the front end's name for it."""

    args: dict[str, Any]
    configured: dict[str, tuple[Any, str]] = field(default_factory=dict)
    explicit: dict[str, tuple[Any, str]] = field(default_factory=dict)
    stock: dict[str, Any] = field(default_factory=dict)
    stock_from: dict[str, str] = field(default_factory=dict)
    words: dict[str, str] = field(default_factory=dict)
    inverted: set[str] = field(default_factory=set)  # dests whose word names the opposite (grad_reduce_in_fp32)


def _surfaces() -> list[dict[str, Any]]:
    folder = resources.files("megatron_perf_toggles") / "data" / "surfaces"
    out = []
    for entry in folder.iterdir():
        if entry.name.endswith(".json") and not entry.name.endswith(".delta.json"):
            out.append(json.loads(entry.read_text(encoding="utf-8")))
    return out


def facts_for_version(version: str) -> MegatronFacts:
    """Megatron's facts for an installed megatron.core that comes without ``megatron.training``
    (PyPI's megatron-core, as Bridge installs it): those of the newest recorded release at or
    below ``version``, with the installed version. Without a recorded release that old, unknown
    facts (every rule is then assumed present)."""
    wanted = version_tuple(version)
    best: tuple[tuple[int, ...], dict[str, Any]] | None = None
    for surface in _surfaces():
        if surface.get("commit"):  # a commit between releases (a framework's pin) stands for no release
            continue
        recorded = str(surface.get("facts", {}).get("version") or "")
        vt = version_tuple(recorded)
        if vt and vt <= wanted and (best is None or vt > best[0]):
            best = (vt, surface)
    if best is None:
        return MegatronFacts(version=version)
    facts = {**best[1].get("facts", {}), "version": version, "path": None}
    return megatron_facts_from_surface({"name": best[1].get("name"), "facts": facts})


def capabilities(env: EnvSettings, target: Any = None) -> Capabilities:
    """The capabilities a front end's plan rests on, by the argparse path's rule
    (``capabilities.for_plan``: this machine, or the planned stack of ``target``'s GPU); where
    Megatron's training package is missing (megatron-core alone), its facts come from the recorded
    release at or below the installed core."""
    caps = for_plan(env.assume, target=target, env=env)
    if caps.megatron.version is None:
        try:
            from megatron.core import package_info
        except Exception:  # noqa: BLE001 - no Megatron: the facts stay unknown
            return caps
        version = getattr(package_info, "__version__", None)
        if version:
            caps = dataclasses.replace(caps, megatron=facts_for_version(str(version)))
    return caps


def start(entry: str, environ: Mapping[str, str] | None = None, *, mode: Mode = "run",
          caps: Capabilities | None = None, target: Any = None, announce: bool = True) -> RunContext:
    """The run context of one front-end entry point, with its controller: the environment and
    profile are read (a bad value is one line here), and the capabilities fixed for its plans."""
    ctx = new_context(entry, environ, mode=mode, target=target, capabilities=caps, announce=announce)
    controller = ctx.controller
    assert controller is not None, "new_context makes the controller"
    if controller.capabilities is None:
        controller.capabilities = capabilities(controller.env, target)
    return ctx


def stock_from(found: Found) -> dict[str, str]:
    """Where each stock value comes from, as a plan with the plugin off labels it: what the front
    end says, else the configuration's default under the front end's name for the field (a value
    the configuration set is labelled by its own tier, ``config``)."""
    return {dest: found.stock_from.get(dest) or f"the configuration's default ({found.words[dest]})"
            for dest in found.stock if dest in found.stock_from or dest in found.words}


def registration(controller: Controller, found: Found) -> Registration:
    """What the controller plans from: the front end's values sorted into the tiers."""
    preset = {dest: Decision(value, "config", f"set in the configuration ({where})")
              for dest, (value, where) in found.configured.items() if dest not in found.explicit}
    return Registration(controller, dict(found.stock), (), explicit={d: v for d, (v, _) in found.explicit.items()},
                        preset=preset, stock_from=stock_from(found), speak=speaker(found))


def plan(ctx: RunContext, found: Found, ns: argparse.Namespace | None = None) -> tuple[Plan, argparse.Namespace,
                                                                                       Registration]:
    """Plan for what a front end found, through its context's controller: the decisions land on
    ``ns`` (Primus's own namespace; a view of the configuration otherwise) with ``perf_toggles``,
    as on the argparse path. A PerfTogglesError (a request that cannot be honoured) propagates."""
    controller = ctx.controller
    assert controller is not None, "frontend.start() makes the controller"
    view = ns if ns is not None else argparse.Namespace(**found.args)
    reg = registration(controller, found)
    return controller.plan(view, reg), view, reg


def planned(entry: str, found: Found, *, ns: argparse.Namespace | None = None,
            write: Callable[[Plan], object] | None = None, environ: Mapping[str, str] | None = None,
            mode: Mode = "run", caps: Capabilities | None = None, target: Any = None, announce: bool = True,
            ) -> tuple[RunContext, Plan, argparse.Namespace, Registration]:
    """The step every front end's ``apply`` and ``explain`` share: its context (:func:`start`), the
    plan of what it found (:func:`plan`), written back into its configuration by ``write`` (where the
    plan's namespace is not the configuration itself) and kept on the context."""
    ctx = start(entry, environ, mode=mode, caps=caps, target=target, announce=announce)
    decided, view, reg = plan(ctx, found, ns)
    if write is not None:
        write(decided)
    ctx.plan = decided
    return ctx, decided, view, reg


def take_over(ctx: RunContext, config: Any, view: argparse.Namespace, reg: Registration,
              before_apply: Callable[[Controller], object] | None = None) -> None:
    """A run's step after planning: the context becomes the process's (``check_ranks()``, the
    safety net and the front end's validation find it), keeps what the front end planned, and its
    controller applies the plan (``before_apply`` first: where the record goes, a validation to watch)."""
    ctx.install()
    ctx.front = FrontEnd(config, view, reg)
    controller = ctx.controller
    assert controller is not None, "start() makes the controller"
    if before_apply is not None:
        before_apply(controller)
    controller.apply(view, reg)


def explained(ctx: RunContext, decided: Plan, args: dict[str, Any]) -> tuple[Plan, Capabilities, dict[str, Any]]:
    """What ``explain`` returns for a front end: the plan, the capabilities it rests on, the arguments read."""
    assert ctx.capabilities is not None
    return decided, ctx.capabilities, args


_FLAG = re.compile(r"(?<![\w-])--(no-)?([a-z0-9][a-z0-9-]*)")


def _flag_words(dest: str, value: Any) -> str:
    toggle = BY_DEST.get(dest)
    if toggle is not None:
        return " ".join(toggle.flag_for(value))
    return "--" + dest.replace("_", "-")


def speaker(found: Found) -> Callable[[str], str]:
    """Megatron's words into the front end's: a value named explicitly says where it was named, and
    each Megatron flag (``--qk-layernorm``, ``--no-grad-reduce-in-bf16``) becomes the field or key
    the user wrote (``cfg.model.qk_layernorm``, ``cfg.ddp.grad_reduce_in_fp32 = True``) wherever
    the front end has one. For reasons, messages and a refusal's line alike."""
    named = {f"set on the command line ({_flag_words(dest, value)})": f"named explicitly ({where})"
             for dest, (value, where) in found.explicit.items()}

    def word(match: re.Match[str]) -> str:
        dest = match.group(2).replace("-", "_")
        name = found.words.get(dest)
        if name is None:
            return match.group(0)
        on = not match.group(1)
        if dest in found.inverted:
            return f"{name} = {not on}"
        return name if on else f"{name} = False"

    def speak(text: str) -> str:
        for megatron, ours in named.items():
            text = text.replace(megatron, ours)
        return _FLAG.sub(word, text)

    return speak
