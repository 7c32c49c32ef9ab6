"""Rebuild a Megatron argument parser from recorded surface facts.

This lets the plugin be exercised against the exact flag set of every supported Megatron
version (and the ROCm fork's recorded delta) on a machine with no Megatron at all: the
contract tests, and ``explain`` without a checkout, run on these parsers.
"""

from __future__ import annotations

import argparse
import copy
import json
from functools import cache
from importlib import resources
from typing import Any

DEFAULT_SURFACE = "main"  # the newest recorded surface: what planning without a checkout uses
_TYPES = {"int": int, "float": float, "str": str}
_SKIP = {"help", "version"}
# argparse actions replayed by name, as recorded (the others are stores or BooleanOptionalAction).
_ACTIONS = frozenset({"store_true", "store_false", "store_const", "append", "append_const", "count", "extend"})


def _surfaces_dir() -> Any:
    return resources.files("megatron_perf_toggles") / "data" / "surfaces"


def available() -> list[str]:
    names = []
    for entry in _surfaces_dir().iterdir():
        if entry.name.endswith(".delta.json"):
            names.append(entry.name[: -len(".delta.json")])
        elif entry.name.endswith(".json"):
            names.append(entry.name[: -len(".json")])
    return sorted(names)


@cache
def _load(name: str) -> dict[str, Any]:
    directory = _surfaces_dir()
    plain = directory / f"{name}.json"
    if plain.is_file():
        return json.loads(plain.read_text())
    delta_file = directory / f"{name}.delta.json"
    if not delta_file.is_file():
        raise KeyError(f"no recorded Megatron surface {name!r}; recorded: {', '.join(available())}")
    delta = json.loads(delta_file.read_text())
    base = copy.deepcopy(_load(delta["base"]))
    base["facts"] = {**base["facts"], **delta.get("facts", {})}
    base["release"] = base.get("release") or base["name"]  # a fork carries its base release's rules
    base["name"], base["source"] = delta["name"], delta["source"]
    removed = set(delta.get("remove_dests", []))
    actions = [a for a in base["actions"] if a["dest"] not in removed]
    for a in actions:
        a.update(delta.get("change", {}).get(a["dest"], {}))
    base["actions"] = actions + delta.get("add", [])
    return base


def commits() -> dict[str, str]:
    """The surfaces recorded of a commit between releases (one a framework pins), by that commit."""
    return {commit: name for name in available() if (commit := _load(name).get("commit"))}


def load_surface(name: str) -> dict[str, Any]:
    """A recorded surface by name (``main``, ``core_v0.13.0``, ..., ``rocm_fork``); a fresh copy."""
    return copy.deepcopy(_load(name))


def parser_from_surface(surface: dict[str, Any], parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser
                        ) -> argparse.ArgumentParser:
    parser = parser_class(description=f"Megatron-LM arguments (recorded: {surface['name']})",
                                     allow_abbrev=False)
    groups: dict[str, argparse._ArgumentGroup] = {g.title: g for g in parser._action_groups if g.title}
    for a in surface["actions"]:
        if a["action"] in _SKIP:
            continue
        title = a["group"] or "options"
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        default = a["default"] if not isinstance(a["default"], dict) else None
        kwargs: dict[str, Any] = {"dest": a["dest"], "default": default}
        flags = list(a["flags"])
        kind = a["action"]
        if kind == "boolean_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
            flags = [f for f in flags if not f.startswith("--no-")] or flags
        elif kind in _ACTIONS:
            kwargs["action"] = kind
            if kind in ("store_const", "append_const"):
                kwargs["const"] = a.get("const")
        else:  # store, and custom actions replayed as plain stores
            if a.get("nargs") not in (None, "==SUPPRESS=="):
                kwargs["nargs"] = a["nargs"]
            kwargs["type"] = _TYPES.get(a.get("type") or "", str) if a.get("type") else None
            if a.get("choices"):
                kwargs["choices"] = a["choices"]
        if kwargs.get("type") is None:
            kwargs.pop("type", None)
        group.add_argument(*flags, **kwargs)
    return parser


def surface_facts(surface: dict[str, Any]) -> dict[str, Any]:
    return dict(surface["facts"])
