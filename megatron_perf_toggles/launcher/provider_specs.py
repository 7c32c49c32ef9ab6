"""Naming the ``extra_args_provider`` functions to chain: ``--extra-args-provider MOD:FUNC``.

The launcher and a patched script accept the flag; this module splits it out of the script's
arguments and imports what it names, with one clear line for each way that can fail.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import OneLineArgumentParser, PerfTogglesError
from ..runtime.provider import Provider

PROVIDER_FLAG = "--extra-args-provider"
DEFAULT_PROVIDER_ATTR = "extra_args_provider"


class ProviderSpecError(PerfTogglesError):
    """A ``--extra-args-provider MOD:FUNC`` that cannot be imported or is not a provider."""

    def __init__(self, spec: str, problem: str, hint: str | None = None) -> None:
        super().__init__(f"{PROVIDER_FLAG} {spec}: {problem}", hint)
        self.spec = spec


def provider_name(p: Callable[..., Any]) -> str:
    """``module:qualname`` of a provider, as a user would name it on the command line."""
    module = getattr(p, "__module__", None) or "?"
    name = getattr(p, "__qualname__", None) or getattr(p, "__name__", None) or repr(p)
    return f"{module}:{name}"


def check_provider_spec(spec: str) -> tuple[str, str]:
    """``MOD:FUNC`` -> (module, function), or a ProviderSpecError, without importing anything: a
    malformed spec, or a module whose top-level package is nowhere on ``sys.path``, is refused
    before torch and Megatron are (seconds). Whether the function is there needs the import."""
    module_name, _, attr = spec.strip().partition(":")
    attr = attr.strip() or DEFAULT_PROVIDER_ATTR
    if not module_name or any(not part.isidentifier() for part in module_name.split(".")):
        raise ProviderSpecError(spec, "expected MODULE:FUNCTION", "e.g. megatron_perf_toggles:extra_args_provider")
    top = module_name.split(".")[0]
    try:
        missing = top not in sys.modules and importlib.util.find_spec(top) is None
    except Exception:  # noqa: BLE001 - a finder that fails: the import says what is wrong
        missing = False
    if missing:
        raise ProviderSpecError(spec, f"cannot import module {module_name!r} (no module named {top!r})",
                                NOT_FOUND_HINT)
    return module_name, attr


NOT_FOUND_HINT = "is it installed, or on PYTHONPATH?"


def resolve_provider(spec: str) -> Provider:
    """``MOD:FUNC`` (``MOD`` alone means ``MOD:extra_args_provider``) -> the callable, or a
    ProviderSpecError naming what could not be found."""
    module_name, attr = check_provider_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ProviderSpecError(spec, f"cannot import module {module_name!r} (no module named {missing!r})",
                                    NOT_FOUND_HINT) from None
        raise ProviderSpecError(spec, f"importing module {module_name!r} failed: {error}") from None
    except Exception as error:  # noqa: BLE001 - any failure of a user module is one clear line
        raise ProviderSpecError(spec, f"importing module {module_name!r} failed: "
                                      f"{type(error).__name__}: {error}") from None
    target: Any = module
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ProviderSpecError(spec, f"module {module_name!r} has no function {attr!r}") from None
    if not callable(target):
        raise ProviderSpecError(spec, f"{module_name}:{attr} is a {type(target).__name__}, not a function "
                                      "taking the parser")
    return target


def pull_provider_specs(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``--extra-args-provider X`` / ``--extra-args-provider=X`` out of ``argv``.

    Returns (specs in order, the other words in their order). argparse does the splitting, so
    the ``=`` form and a missing value behave as everywhere else.
    """
    parser = OneLineArgumentParser(prog="megatron-perf-toggles", add_help=False, allow_abbrev=False, message_prefix="",
                                   usage_hint=f"use {PROVIDER_FLAG} MOD:FUNC, e.g. megatron_perf_toggles:extra_args_provider")
    parser.add_argument(PROVIDER_FLAG, action="append", default=[], dest="providers", metavar="MOD:FUNC")
    ns, rest = parser.parse_known_args(list(argv))
    return list(ns.providers), rest
