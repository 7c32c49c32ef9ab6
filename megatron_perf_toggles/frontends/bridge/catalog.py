"""Megatron-Bridge's recipe catalog: recorded once from the real Bridge, read to plan without it.

``explain --bridge-recipe`` on a machine without Bridge (a laptop: ``pip install
'megatron-perf-toggles[bridge]'``) plans from this catalog: package data holding, per recorded
Bridge version, what the Bridge adapter read from each recipe and the ``megatron-core`` that
Bridge pins. The plan goes through the same pipeline as with Bridge installed, for the planned
world, GPU and stack, with that core's Megatron facts from the recorded surfaces; nothing of
Bridge, torch or Transformer Engine is imported. A recipe's keyword arguments change what it
builds, which only Bridge can say: they need Bridge installed.

Recording (with the Python that has Megatron-Bridge installed)::

    python -m megatron_perf_toggles.frontends.bridge_catalog --out megatron_perf_toggles/data/bridge_recipes/0.6.2.json

builds every ``*_config`` function of ``megatron.bridge.recipes`` whose parameters all have
defaults as ``explain --bridge-recipe`` builds it (Transformer Engine and triton stood in for) and
keeps the adapter's reading. Hugging Face configs come from ``HF_HOME`` offline: a recipe whose
config is not there is recorded with the repository it needs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import Any

from ...core.decision.decide import Plan
from ...core.facts import Capabilities, version_tuple
from ...errors import OneLineArgumentParser, PerfTogglesError, fail
from ...runtime.machine import target as planned
from ...runtime.provenance import jsonable
from .. import adapter as frontend
from ..adapter import Found


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


def chosen(asked: str | None = None) -> tuple[dict[str, Any], str]:
    """The catalog to plan from, and why that one: ``asked`` (``--bridge-version``), else the
    installed Megatron-Bridge's (its distribution's version, where it is recorded), else the newest."""
    if asked:
        return load(asked), "as --bridge-version asks"
    from ...runtime.machine.probe import dist_version

    installed = dist_version("megatron-bridge")
    if installed in versions():
        return load(installed), "the installed Megatron-Bridge's version"
    newest = load()
    why = f"Megatron-Bridge {installed} has none" if installed else "Megatron-Bridge is not installed here"
    return newest, f"{why}: the newest recorded catalog"


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
        from .recipe import suggestion

        known = [*recipes, *catalog.get("aliases", {})]  # a re-export's name is as good as the recipe's
        raise PerfTogglesError(f"--bridge-recipe {recipe}: Megatron-Bridge {catalog['bridge']} has no recipe "
                               "of that name", suggestion(name, known) + "name one of its recipes (the catalog's keys, "
                               "megatron_perf_toggles/data/bridge_recipes/), or install Megatron-Bridge for its own")
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


def plan(ns: argparse.Namespace, target: planned.Target) -> tuple[Plan, Capabilities, str, dict[str, Any]]:
    """The plan of ``ns.bridge_recipe`` from a recorded catalog (:func:`chosen`), as ``explain_frontends`` returns it."""
    if ns.megatron_args:
        raise PerfTogglesError("--bridge-recipe keyword arguments (KEY=VALUE after --) need Megatron-Bridge "
                               "installed: the recorded catalog holds each recipe as its defaults build it",
                               "install Megatron-Bridge, or plan the recipe without them")
    catalog, why = chosen(getattr(ns, "bridge_version", None))
    recipe = found(ns.bridge_recipe, catalog)
    env = frontend.read_env(os.environ)
    caps = dataclasses.replace(frontend.capabilities(env, target),
                               megatron=frontend.facts_for_version(catalog["megatron_core"]))
    with planned.stand_ins(target, megatron=False):
        ctx = frontend.start("bridge", mode="plan", caps=caps, target=target, announce=False)
        result, view, _ = frontend.plan(ctx, recipe)
    name = key(ns.bridge_recipe).rpartition(":")[2]
    label = (f"Megatron-Bridge {catalog['bridge']} as recorded ({why}; megatron-core "
             f"{catalog['megatron_core']}), recipe {name}")
    return result, ctx.capabilities or caps, label, vars(view)


DESCRIPTION = "Record what the plan reads of every Megatron-Bridge recipe, for planning without Bridge."
HF_REPO = re.compile(r"(?:from|for|of) '?([\w.-]+/[\w.-]+)'?")


def _is_recipe(name: str, fn: Any) -> bool:
    return (name.endswith("_config") and not name.startswith("_") and inspect.isfunction(fn)
            and all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                    for p in inspect.signature(fn).parameters.values()))


def recipes() -> tuple[list[tuple[str, Callable[..., Any]]], dict[str, str]]:
    """Every recipe function of the installed Bridge, as ``MODULE:FUNCTION`` where it is defined,
    and the other names a package re-exports it under (``megatron.bridge.recipes.llama:...``)."""
    import megatron.bridge.recipes as package

    out: dict[str, Callable[..., Any]] = {}
    exported: dict[str, Callable[..., Any]] = {}
    modules = [package.__name__, *(info.name for info in pkgutil.walk_packages(package.__path__,
                                                                                package.__name__ + "."))]
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - a module that does not import here has no recipe to record
            continue
        for name, fn in vars(module).items():
            if _is_recipe(name, fn):
                (out if fn.__module__ == module.__name__ else exported)[f"{module.__name__}:{name}"] = fn
    canonical = {id(fn): name for name, fn in out.items()}
    aliases = {alias: canonical[id(fn)] for alias, fn in exported.items() if id(fn) in canonical}
    return sorted(out.items()), dict(sorted(aliases.items()))


def read_one(fn: Callable[..., Any]) -> dict[str, Any] | None:
    """What the Bridge adapter reads of the recipe ``fn`` builds (None: not a whole configuration);
    where it cannot be built, why (``needs``: the Hugging Face repository it loads)."""
    from . import adapter as bridge_adapter
    from . import recipe as bridge_recipe

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cfg = bridge_recipe.build(fn)
            if not all(hasattr(cfg, s) for s in ("model", "ddp", "mixed_precision", "checkpoint")):
                return None
            bridge_adapter._resolve_mixed_precision(cfg)
            found = bridge_adapter.read(cfg, (), bridge_recipe.traced_fields(cfg))
    except Exception as error:  # noqa: BLE001 - cannot be built here: recorded with why
        text = " ".join(str(error).split())
        match = HF_REPO.search(text) if "huggingface" in text.lower() or "hugging face" in text.lower() else None
        return {"needs": match.group(1)} if match else {"why": f"{type(error).__name__}: {text[:200]}"}
    return relative({"args": jsonable(found.args, other=stable), "words": dict(found.words),
                     "stock": jsonable(found.stock, other=stable),
                     "configured": {d: [jsonable(v, other=stable), w] for d, (v, w) in found.configured.items()},
                     "inverted": sorted(found.inverted)}, os.getcwd())


def stable(value: Any) -> str:
    """A value JSON cannot hold, as words that are the same in every process: a function or class by
    its qualified name, anything else without the memory address its repr may carry."""
    name = getattr(value, "__qualname__", None)
    if name is not None and callable(value):
        return f"{getattr(value, '__module__', '?')}.{name}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", str(value))


def relative(value: Any, here: str) -> Any:
    """Paths a recipe made under the directory it was built in (``nemo_experiments/...``), as
    relative ones: the catalog names nothing of the machine it was recorded on."""
    if isinstance(value, str):
        return "." + value[len(here):] if value == here or value.startswith(here + os.sep) else value
    if isinstance(value, list):
        return [relative(v, here) for v in value]
    if isinstance(value, dict):
        return {k: relative(v, here) for k, v in value.items()}
    return value


def _common(entries: list[dict[str, Any]], part: str) -> dict[str, Any]:
    """Each key's most frequent value among the recipes, for keys more than half of them have."""
    counts: dict[str, Counter[str]] = {}
    for one in entries:
        for k, v in one[part].items():
            counts.setdefault(k, Counter())[json.dumps(v, sort_keys=True)] += 1
    half = len(entries) / 2
    return {k: json.loads(c.most_common(1)[0][0]) for k, c in sorted(counts.items()) if sum(c.values()) > half}


def compress(read: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The catalog: the common values once, each recipe as what differs from them."""
    built = [one for one in read.values() if "args" in one]
    common = {part: _common(built, part) for part in ("args", "words")}
    recipes: dict[str, Any] = {}
    for name, one in sorted(read.items()):
        if "args" not in one:
            recipes[name] = one
            continue
        entry: dict[str, Any] = {k: one[k] for k in ("stock", "configured", "inverted") if one[k]}
        for part in ("args", "words"):
            delta = {k: v for k, v in one[part].items() if common[part].get(k, entry) != v}
            absent = sorted(k for k in common[part] if k not in one[part])
            if delta:
                entry[part] = delta
            if absent:
                entry[f"{part}_absent"] = absent
        recipes[name] = entry
    return {"common": common, "recipes": recipes}


def record() -> dict[str, Any]:
    """The catalog of the installed Bridge."""
    import tempfile

    from ...launcher.import_shims import install_stand_ins
    from ..te_standin import transformer_engine

    install_stand_ins()
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="bridge-catalog-") as scratch, transformer_engine():
        os.chdir(scratch)  # recipes make their output paths under the working directory
        from megatron.bridge import package_info
        from megatron.bridge.models.hf_pretrained import safe_config_loader
        from megatron.core import package_info as core_info

        safe_config_loader.time = types.SimpleNamespace(sleep=lambda seconds: None, time=time.time)
        found, aliases = recipes()
        try:
            read = {name: one for name, fn in found if (one := read_one(fn)) is not None}
        finally:
            os.chdir(here)
    return {"bridge": package_info.__version__, "megatron_core": core_info.__version__, **compress(read),
            "aliases": {alias: name for alias, name in aliases.items() if name in read}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="FILE", required=True, help="where to write the catalog (JSON)")


def run(ns: argparse.Namespace) -> int:
    from ...runtime.machine.probe import installed

    if not installed("megatron.bridge"):
        raise PerfTogglesError("Megatron-Bridge is not importable here", "run this with Bridge's Python")
    catalog = record()
    with open(ns.out, "w", encoding="utf-8") as fh:
        json.dump(catalog, fh, indent=0, sort_keys=True)
        fh.write("\n")
    built = sum("needs" not in r and "why" not in r for r in catalog["recipes"].values())
    print(f"Megatron-Bridge {catalog['bridge']}: {built} of {len(catalog['recipes'])} recipes recorded in {ns.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineArgumentParser(prog="python -m megatron_perf_toggles.frontends.bridge_catalog", description=DESCRIPTION)
    add_arguments(parser)
    try:
        return run(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except PerfTogglesError as error:
        fail(error)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
