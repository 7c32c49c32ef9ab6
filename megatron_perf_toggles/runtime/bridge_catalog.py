"""The recorded catalog of Megatron-Bridge's recipes: plan a recipe where Bridge is not installed.

``pip install megatron-bridge`` does not install on a CPU machine (a dependency builds against
torch), and Bridge 0.4-0.6 need Python 3.12. What the plan reads of a recipe is small, though:
the :class:`~.frontend.Found` the Bridge adapter reads from the built ``ConfigContainer`` (the
arguments under Megatron's dests, the toggle values the recipe set, the stock values, the field
paths), and the version of the ``megatron-core`` Bridge pins. ``tools/bridge_catalog.py`` records
that for every recipe of one Bridge version, from the real Bridge (the tests run it and compare),
into package data; :func:`found` gives it back, so ``explain --bridge-recipe`` plans the same job
through the same pipeline with no Bridge, torch or Transformer Engine.

A catalog file holds ``common`` (each argument's most frequent value over the recipes, and each
field path) and, per recipe, what differs from it; a recipe that could not be built where it was
recorded keeps why (``needs``: the Hugging Face config it loads).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

from ..core.facts import version_tuple
from ..errors import PerfTogglesError
from .frontend import Found


def _folder() -> Any:
    return resources.files("megatron_perf_toggles") / "data" / "bridge_recipes"


def versions() -> list[str]:
    """The Bridge versions recorded, oldest first."""
    names = [e.name[: -len(".json")] for e in _folder().iterdir() if e.name.endswith(".json")]
    return sorted(names, key=version_tuple)


@cache
def load(version: str | None = None) -> dict[str, Any]:
    """A recorded catalog: ``version``'s, else the newest."""
    known = versions()
    if not known:
        raise PerfTogglesError("no recorded Megatron-Bridge catalog in this installation")
    name = version or known[-1]
    if name not in known:
        raise PerfTogglesError(f"no recorded catalog for Megatron-Bridge {name}", f"recorded: {', '.join(known)}")
    return json.loads((_folder() / f"{name}.json").read_text(encoding="utf-8"))


def key(recipe: str) -> str:
    """``MODULE:FUNCTION`` however it was written (``MODULE.FUNCTION`` too)."""
    if ":" in recipe:
        return recipe
    module, _, name = recipe.rpartition(".")
    return f"{module}:{name}"


def entry(recipe: str, catalog: dict[str, Any]) -> dict[str, Any]:
    """The recorded entry of ``recipe``: one line where the catalog has none, or where the recipe
    could not be built when it was recorded (with what it needs, and how to give it)."""
    name = key(recipe)
    name = catalog.get("aliases", {}).get(name, name)  # a package's re-export: the recipe it names
    recipes = catalog["recipes"]
    if name not in recipes:
        from ..errors import did_you_mean

        raise PerfTogglesError(f"--bridge-recipe {recipe}: Megatron-Bridge {catalog['bridge']} has no recipe "
                               "of that name", f"{did_you_mean(name, list(recipes))}or install Megatron-Bridge")
    found = recipes[name]
    if "needs" in found:
        raise PerfTogglesError(f"--bridge-recipe {recipe} builds its model from the Hugging Face config of "
                               f"{found['needs']}, which is not recorded",
                               "install Megatron-Bridge and plan it where huggingface.co is reachable once "
                               "(the config is cached under HF_HOME), or copy that cache and set HF_HOME")
    if "why" in found:
        raise PerfTogglesError(f"--bridge-recipe {recipe} cannot be planned without Megatron-Bridge: {found['why']}")
    return found


def found(recipe: str, catalog: dict[str, Any]) -> Found:
    """The :class:`Found` the Bridge adapter read from ``recipe`` when the catalog was recorded."""
    one = entry(recipe, catalog)
    parts = {}
    for part in ("args", "words"):
        merged = {**catalog["common"][part], **one.get(part, {})}
        parts[part] = {k: v for k, v in merged.items() if k not in set(one.get(f"{part}_absent", []))}
    return Found(args=parts["args"], configured={d: (v, w) for d, (v, w) in one.get("configured", {}).items()},
                 stock=dict(one.get("stock", {})), words=parts["words"], inverted=set(one.get("inverted", [])))
