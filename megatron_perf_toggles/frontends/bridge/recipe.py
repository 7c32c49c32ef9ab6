"""Build a Megatron-Bridge recipe and remember which toggle fields the recipe itself set.

A field still equal to its dataclass default cannot be told, on the finished ``ConfigContainer``,
from one the recipe assigned that same value on purpose (``cfg.ddp.grad_reduce_in_fp32 = True``).
:func:`build` calls the recipe function while watching Megatron's and Bridge's configuration
classes: a keyword given to their constructors, and any assignment after construction, marks
the field as set. :func:`~megatron_perf_toggles.bridge.apply` then treats every such toggle
field as the recipe's choice (the ``config`` tier), whatever its value::

    cfg = bridge_recipe.build("megatron.bridge.recipes.llama:llama3_8b_pretrain_config")
    bridge.apply(cfg)

The watch lasts only as long as the recipe call (the classes are put back through a scoped undo
log) and records ids only; nothing of the recipe's behaviour changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ...core.config_fields import BRIDGE_SECTIONS
from ...errors import PerfTogglesError
from ...runtime.process_changes import ProcessChanges

# The configuration classes a recipe fills in, each with every subclass (model providers included).
ROOTS = ("megatron.core.model_parallel_config:ModelParallelConfig",
         "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig",
         "megatron.bridge.training.mixed_precision:MixedPrecisionConfig")
_TRACED: dict[int, tuple[weakref.ref[Any], frozenset[str]]] = {}


def split(spec: str) -> tuple[str, str]:
    """``MODULE:FUNCTION`` (or ``MODULE.FUNCTION``) into its two names; one line where it is neither
    (checked before anything is imported)."""
    module, sep, name = spec.partition(":")
    if not sep:
        module, _, name = spec.rpartition(".")
    if not module or not name or not all(part.isidentifier() for part in (*module.split("."), name)):
        raise PerfTogglesError(f"--bridge-recipe {spec!r}: name it MODULE:FUNCTION",
                               "e.g. megatron.bridge.recipes.llama:llama3_8b_pretrain_config")
    return module, name


def nearest(spec: str, candidates: Iterable[str]) -> str | None:
    """The recipe among ``candidates`` (``MODULE:FUNCTION``) that ``spec`` most likely meant: the
    nearest function name wins, and among recipes of that name (a package re-exports one under
    several modules) the nearest whole name; None where no function name is near (difflib's
    ratio under 0.6, as ``errors.did_you_mean`` takes it)."""
    import difflib

    module, name = split(spec)
    whole = f"{module}:{name}"
    best: tuple[float, float, str] | None = None
    for candidate in candidates:
        function = candidate.rpartition(":")[2]
        score = (difflib.SequenceMatcher(None, name, function).ratio(),
                 difflib.SequenceMatcher(None, whole, candidate).ratio(), candidate)
        if best is None or score[:2] > best[:2]:
            best = score
    return best[2] if best is not None and best[0] >= 0.6 else None


def suggestion(spec: str, candidates: Iterable[str]) -> str:
    """``"did you mean 'M:F'? "`` for :func:`nearest`, else ``""``: the start of a hint."""
    close = nearest(spec, candidates)
    return f"did you mean {close!r}? " if close else ""


RECIPES = "megatron.bridge.recipes"  # Bridge's recipe package, which re-exports every recipe


def _known(module: str) -> list[str]:
    """What a misspelt recipe is matched against with Bridge installed: the recipe functions
    ``module`` has, and those Bridge's recipe package exports (for a module that does not import)."""
    names: list[str] = []
    for where in dict.fromkeys((module, RECIPES)):
        with contextlib.suppress(Exception):  # a module that does not import offers nothing
            names += [f"{where}:{n}" for n, fn in vars(importlib.import_module(where)).items()
                      if n.endswith("_config") and callable(fn)]
    return names


def resolve(spec: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION`` (or ``MODULE.FUNCTION``) to the function; one line where it is none,
    naming the recipe it most likely meant (:func:`nearest`)."""
    module, name = split(spec)
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as error:
        raise PerfTogglesError(f"--bridge-recipe {spec}: cannot import {module}: {error}",
                               suggestion(spec, _known(module)).strip() or None) from None
    except AttributeError:
        raise PerfTogglesError(f"--bridge-recipe {spec}: {module} has no {name!r}",
                               suggestion(spec, _known(module)).strip() or None) from None
    if not callable(fn):
        raise PerfTogglesError(f"--bridge-recipe {spec}: {name} is not a function")
    return fn


def _classes() -> Iterator[tuple[type, bool]]:
    """Each watched class, and whether it is a root (its subclasses inherit its ``__setattr__``)."""
    for spec in ROOTS:
        module, _, name = spec.partition(":")
        try:
            root = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        todo, seen = [root], set()
        while todo:
            cls = todo.pop()
            if cls not in seen:
                seen.add(cls)
                todo.extend(cls.__subclasses__())
                yield cls, cls is root


class _Watch:
    """Records (object id, field name) for constructor keywords and later assignments."""

    def __init__(self) -> None:
        self.set: dict[int, set[str]] = {}
        self.building: set[int] = set()

    def init(self, original: Callable[..., None]) -> Callable[..., None]:
        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            key = id(obj)
            fresh = key not in self.building
            self.building.add(key)
            try:
                original(obj, *args, **kwargs)
            finally:
                if fresh:
                    self.building.discard(key)
            if fresh:
                positional = [f.name for f in dataclasses.fields(obj) if f.init and not f.kw_only][:len(args)]
                self.set.setdefault(key, set()).update(positional, kwargs)

        return __init__

    def setattr(self, original: Callable[[Any, str, Any], None]) -> Callable[[Any, str, Any], None]:
        def __setattr__(obj: Any, name: str, value: Any) -> None:
            if id(obj) not in self.building:
                self.set.setdefault(id(obj), set()).add(name)
            original(obj, name, value)

        return __setattr__


def build(recipe: str | Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Call the recipe (a function, or ``MODULE:FUNCTION``) and return its configuration, with the
    fields it set remembered for :func:`traced_fields`."""
    fn = resolve(recipe) if isinstance(recipe, str) else recipe
    watch, scope = _Watch(), ProcessChanges()
    try:
        for cls, root in _classes():
            if "__init__" in vars(cls):
                scope.set_attr(cls, "__init__", watch.init(vars(cls)["__init__"]))
            if "__setattr__" in vars(cls) or root:
                scope.set_attr(cls, "__setattr__", watch.setattr(vars(cls).get("__setattr__", object.__setattr__)))
        cfg = fn(*args, **kwargs)
    finally:
        scope.uninstall()
    paths: set[str] = set()
    for section in BRIDGE_SECTIONS:
        obj = getattr(cfg, section, None)
        paths.update(f"{section}.{name}" for name in watch.set.get(id(obj), ()))
    for key in [k for k, (ref, _) in _TRACED.items() if ref() is None]:
        del _TRACED[key]
    _TRACED[id(cfg)] = (weakref.ref(cfg), frozenset(paths))
    return cfg


def traced_fields(cfg: Any) -> frozenset[str]:
    """The field paths (``ddp.grad_reduce_in_fp32``) the recipe that built ``cfg`` set; empty for a
    configuration :func:`build` did not make."""
    entry = _TRACED.get(id(cfg))
    return entry[1] if entry is not None and entry[0]() is cfg else frozenset()
