"""One sandbox for what a test runs: the environment without any variable the plugin reads.

The variables are the registry's (every toggle's and every plugin setting's) and PyTorch's allocator
setting, which the memory plan reads (core.memory.allocator), so a variable added
there is kept out of every test's processes and of the trees' workers with no change here. Every
test, driver and case that needs a clean environment asks this module; none keeps a list of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from megatron_perf_toggles.core.memory.allocator import ALLOC_CONF_VARS
from megatron_perf_toggles.core.registry import SETTINGS, TOGGLES


def plugin_vars() -> frozenset[str]:
    """Every environment variable the plugin reads, from the registry."""
    return frozenset({t.env for t in TOGGLES} | {s.env for s in SETTINGS})


def clean_environ(base: Mapping[str, str] | None = None, drop: Iterable[str] = (), **extra: str) -> dict[str, str]:
    """``base`` (this process's environment by default) without the plugin's variables and the
    names in ``drop``, then ``extra`` on top."""
    gone = plugin_vars() | set(ALLOC_CONF_VARS) | set(drop)  # torch's allocator setting changes the memory plan
    source = os.environ if base is None else base
    return {**{k: v for k, v in source.items() if k not in gone}, **extra}


def plugin_part(environ: Mapping[str, str], *prefixes: str) -> dict[str, str]:
    """What of ``environ`` the plugin reads (and the names starting with one of ``prefixes``): what a
    case passes on to a process that must decide as this one would."""
    ours = plugin_vars()
    return {k: v for k, v in environ.items() if k in ours or (prefixes and k.startswith(prefixes))}


def sandbox_os_environ(base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None,
                       drop: Iterable[str] = ()) -> None:
    """This process's own environment made :func:`clean_environ`'s: in a tree's worker, where each
    case runs in the worker itself, before each case."""
    clean = clean_environ(dict(os.environ) if base is None else base, drop, **(extra or {}))
    os.environ.clear()
    os.environ.update(clean)
