"""Record Megatron-Bridge's recipe catalog: what the plan reads of every recipe, from the real Bridge.

Run with the Python that has Megatron-Bridge installed (``runtime/bridge_catalog.py`` says why)::

    python -m megatron_perf_toggles.tools.bridge_catalog --out megatron_perf_toggles/data/bridge_recipes/0.6.2.json

Every ``*_config`` function of ``megatron.bridge.recipes`` whose parameters all have defaults is
built as ``explain --bridge-recipe`` builds it (``bridge_recipe.build``, Transformer Engine and
triton stood in for), and the Bridge adapter's reading of it is kept. Hugging Face configs come
from ``HF_HOME`` offline: a recipe whose config is not there is recorded with the repository it
needs. Bridge's loader waits between its offline retries; those waits are skipped here.
"""

from __future__ import annotations

import argparse
import contextlib
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
from typing import Any

from ..errors import OneLineArgumentParser, PerfTogglesError, fail
from ..runtime.provenance import jsonable

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
    from ..runtime import bridge_adapter, bridge_recipe

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

    from ..launcher.import_shims import install_stand_ins
    from ..launcher.te_standin import transformer_engine

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
    from ..runtime.probe import installed

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
    parser = OneLineArgumentParser(prog="python -m megatron_perf_toggles.tools.bridge_catalog", description=DESCRIPTION)
    add_arguments(parser)
    try:
        return run(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except PerfTogglesError as error:
        fail(error)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
