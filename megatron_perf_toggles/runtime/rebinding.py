"""Swap one Megatron function for a wrapper everywhere it is referenced, and back.

Megatron modules import functions by name (``from megatron.training.arguments import
validate_args``), so replacing the module attribute alone leaves stale references. These helpers
walk Megatron's modules, the running script and the checkout's other files, and replace every
reference to one object by identity. Nothing here imports Megatron.
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
from collections.abc import Callable
from typing import Any

# What a wrapper of a Megatron function carries: the function it wraps, so that wrapping twice
# finds the original and undoing puts it back.
ORIGINAL_ATTR = "__perf_toggles_original__"


def megatron_root(module: Any) -> str | None:
    """The checkout a ``megatron.training.*`` module was imported from."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path))))


def _under(path: str, root: str) -> bool:
    # Module paths are nearly always absolute already: normalise only the others (with torch and
    # Megatron loaded there are thousands of modules, and a walk runs once per rebound function).
    return (path if os.path.isabs(path) else os.path.abspath(path)).startswith(root + os.sep)


def holders(root: str | None) -> list[dict[str, Any]]:
    """Namespaces that may hold a stale reference: Megatron's modules, the script, the tree's files.

    With torch and Megatron loaded there are thousands of modules, and the plugin rebinds several
    functions in a row (its hooks, the safety net, and both again to undo): the list is kept while
    ``sys.modules`` holds the same names bound to the same module objects, and made again when any
    is added, dropped, renamed or replaced. The cache holds the module objects themselves, so a
    freed module's address cannot come back as a "same" module.
    """
    if root:
        root = os.path.abspath(root)
    names, modules = tuple(sys.modules), tuple(sys.modules.values())
    cached = _HOLDERS[0]  # read once: (root, names, modules, holders), swapped whole
    if (cached is not None and cached[0] == root and cached[1] == names and len(cached[2]) == len(modules)
            and all(map(operator.is_, cached[2], modules))):
        return cached[3]
    found = []
    for name, module in zip(names, modules, strict=True):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        path = namespace.get("__file__")
        if (
            name == "megatron" or name.startswith("megatron.") or name == "__main__"
            or (root and isinstance(path, str) and _under(path, root))
        ):
            found.append(namespace)
    _HOLDERS[0] = (root, names, modules, found)
    return found


# The last walk: its root, sys.modules' names and module objects then, and the holders it found.
_HOLDERS: list[tuple[str | None, tuple[str, ...], tuple[Any, ...], list[dict[str, Any]]] | None] = [None]


def forget_holders() -> None:
    """Drop the kept walk (and the modules it holds), e.g. after a tree's modules were dropped."""
    _HOLDERS[0] = None


def rebind(old: Callable[..., Any], new: Callable[..., Any], root: str | None) -> int:
    """Replace every reference to ``old`` with ``new``; returns how many were replaced."""
    count = 0
    for namespace in holders(root):
        # Most namespaces hold no reference: look by identity at C speed first (``in`` would
        # compare with ==, which a tensor or an array answers elementwise).
        if not any(map(operator.is_, namespace.values(), itertools.repeat(old))):
            continue
        for key, value in list(namespace.items()):
            if value is old:
                namespace[key] = new
                count += 1
    return count
