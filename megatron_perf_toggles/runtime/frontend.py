"""What the config front ends (Megatron-Bridge, Primus) share: read the settings, decide, announce.

A front end without a command line reads three things from its configuration object and hands
them here: the arguments the guards look at (under Megatron's dests), the toggle values that the
configuration set itself (a recipe's, an experiment file's), and those the caller named
explicitly. The decision is ``core.decide.decide``, unchanged: the environment, the profile, the
registry, the precedence and every guard are the argparse path's. Values the configuration set
become ``config`` decisions (below the environment, above the profile and the plugin default, and
a guard may change them with a warning); values named explicitly are command-line requests (a
guard that cannot honour one refuses with one line).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from ..core.decide import Decision, Plan, decide
from ..core.env import EnvSettings, read_env
from ..core.facts import Capabilities, MegatronFacts, megatron_facts_from_surface, version_tuple
from ..core.registry import BY_DEST, format_value
from . import provenance
from .capabilities import resolve


@dataclass(slots=True)
class Found:
    """What a front end read from its configuration object.

    ``args``: everything the guards may read, under Megatron's dests; ``configured``: dest ->
    (value, where) for toggle values the configuration set (not its class's default);
    ``explicit``: dest -> (value, where) for those the caller named; ``stock``: dest -> the value
    that stands when the plugin is switched off (the configuration's own)."""

    args: dict[str, Any]
    configured: dict[str, tuple[Any, str]] = field(default_factory=dict)
    explicit: dict[str, tuple[Any, str]] = field(default_factory=dict)
    stock: dict[str, Any] = field(default_factory=dict)


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
        recorded = str(surface.get("facts", {}).get("version") or "")
        vt = version_tuple(recorded)
        if vt and vt <= wanted and (best is None or vt > best[0]):
            best = (vt, surface)
    if best is None:
        return MegatronFacts(version=version)
    facts = {**best[1].get("facts", {}), "version": version, "path": None}
    return megatron_facts_from_surface({"facts": facts})


def capabilities(env: EnvSettings) -> Capabilities:
    """This machine's capabilities, as the argparse path detects them; where Megatron's training
    package is missing (megatron-core alone), its facts come from the recorded release."""
    caps = resolve(env.assume)
    if caps.megatron.version is None:
        try:
            from megatron.core import package_info
        except Exception:  # noqa: BLE001 - no Megatron: the facts stay unknown
            return caps
        version = getattr(package_info, "__version__", None)
        if version:
            caps = dataclasses.replace(caps, megatron=facts_for_version(str(version)))
    return caps


def decide_found(found: Found, environ: Mapping[str, str] | None = None,
                 caps: Capabilities | None = None) -> tuple[Plan, Capabilities, EnvSettings]:
    """The plan for what a front end found: ``core.decide.decide`` with its values sorted into
    explicit (``cli``), configured (``config``) and defaults. A PerfTogglesError propagates."""
    environ = os.environ if environ is None else environ
    env = read_env(environ)
    profile = None
    if env.profile_path:
        from . import profile_file

        profile = profile_file.load(env.profile_path)
    caps = caps or capabilities(env)
    observed = None
    if profile is not None:
        from . import profile_file

        observed = profile_file.observed_for(profile, caps, environ, "run")
    explicit = {dest: value for dest, (value, _) in found.explicit.items()}
    preset: dict[str, Decision] = {}
    stock = dict(found.stock)
    if env.plugin_enabled:
        preset = {dest: Decision(value, "config", f"set in the configuration ({where} = {format_value(value)})")
                  for dest, (value, where) in found.configured.items() if dest not in explicit}
    plan = decide(found.args, explicit, env, caps, stock, profile=profile, observed=observed, preset=preset)
    for dest, (value, where) in found.explicit.items():  # "set on the command line" would mislead here
        d = plan.decisions.get(dest)
        if d is not None and d.source == "cli":
            plan.decisions[dest] = Decision(d.value, d.source, d.reason.replace(
                f"set on the command line ({_flag_words(dest, value)})", f"named explicitly ({where})"))
    return plan, caps, env


def _flag_words(dest: str, value: Any) -> str:
    toggle = BY_DEST.get(dest)
    if toggle is not None:
        return " ".join(toggle.flag_for(value))
    return "--" + dest.replace("_", "-")


def announce(plan: Plan, caps: Capabilities, env: EnvSettings, environ: Mapping[str, str] | None,
             directory: str | None, command: list[str] | None = None) -> str | None:
    """Rank 0: the start-up table on stdout and the decision record (``perf_toggles.json``) in
    ``directory``, as the argparse path writes them. Returns the record's path, if written."""
    if env.rank != 0:
        return None
    for line in provenance.lines(plan):
        print(line, flush=True)
    if not directory:
        return None
    environ = os.environ if environ is None else environ
    payload = provenance.build_record(plan, caps, env.raw_for_record(environ), command or list(sys.argv))
    try:
        return provenance.write_atomic(directory, payload)
    except OSError as error:
        print(f"{provenance.PREFIX} warning: could not write the provenance record: {error}",
              file=sys.stderr, flush=True)
        return None
