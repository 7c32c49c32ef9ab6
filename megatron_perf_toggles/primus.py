"""Primus front end: the plugin's decisions on the Megatron namespace Primus builds from YAML.

Primus replaces Megatron's ``parse_args`` (with no ``extra_args_provider``), so the plugin's
argparse hooks never see its runs. It offers its own extension point instead: patches registered
with ``primus.core.patches.register_patch(backend="megatron", phase="build_args")`` run on the
namespace after Primus built it and before the trainer (and Megatron's ``validate_args``) sees it.
:func:`register` adds one such patch; importing this module registers it when Primus is there::

    import megatron_perf_toggles.primus  # e.g. from a .pth file: see docs/primus.md

What counts as set: Primus ships defaults for Megatron's arguments in its own YAML files
(``core.config_fields.PRIMUS_DEFAULT_FILES``; its base trainer turns cross-entropy fusion,
average-in-collective and bf16 gradient reduction off). A value equal to Primus's default (or,
for an argument Primus does not declare, to Megatron's) is the plugin's to decide; any other value
was set by the experiment or the model file, and is kept unless an environment variable asks
otherwise or a guard cannot honour it (then it changes, with a warning).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from .core.config_fields import PRIMUS_DEFAULT_FILES, PRIMUS_HOMES
from .core.decide import FP4_LAYER_DESTS, MEGATRON_FP4_LAYER_DEFAULTS, Plan
from .core.facts import Capabilities
from .core.registry import BY_DEST
from .runtime import frontend

PATCH_ID = "megatron_perf_toggles.decisions"
_MISSING = object()


def megatron_default(dest: str) -> Any:
    """Megatron's own default for a toggle or FP4 layer field (what Primus's arg builder fills in)."""
    if dest in BY_DEST:
        return BY_DEST[dest].stock_default
    return dict(zip(FP4_LAYER_DESTS, MEGATRON_FP4_LAYER_DEFAULTS, strict=True)).get(dest)


def primus_defaults(package_dir: str | None = None) -> dict[str, Any]:
    """The values Primus's own YAML files declare for the toggles (``package_dir``: the ``primus``
    package directory; the imported package's by default)."""
    try:
        if package_dir is None:
            import primus

            package_dir = os.path.dirname(os.path.abspath(primus.__file__))
        import yaml  # Primus's own dependency
    except ImportError as error:
        from .errors import PerfTogglesError

        raise PerfTogglesError(f"primus: Primus is not importable here ({error}); pass its defaults to "
                               "apply_to_namespace, or run inside Primus") from None

    out: dict[str, Any] = {}
    for rel in PRIMUS_DEFAULT_FILES:
        path = os.path.join(package_dir, rel)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        for dest in PRIMUS_HOMES:
            if dest in data and dest not in out:
                out[dest] = data[dest]
    return out


def read(ns: Any, defaults: Mapping[str, Any], explicit: Iterable[str] = ()) -> frontend.Found:
    """What the plugin reads of Primus's namespace: the arguments, and which toggles it set."""
    args = dict(vars(ns))
    named = set(explicit)
    if named - set(PRIMUS_HOMES):
        from .errors import PerfTogglesError

        raise PerfTogglesError(f"primus: explicit names no toggle: {', '.join(sorted(named - set(PRIMUS_HOMES)))}")
    found = frontend.Found(args=args)
    for dest, homes in PRIMUS_HOMES.items():
        home = homes[0]
        value = getattr(ns, home.path, _MISSING)
        if value is _MISSING:
            continue
        found.stock[dest] = value
        default = defaults[dest] if dest in defaults else megatron_default(dest)
        if dest in named:
            found.explicit[dest] = (value, home.path)
        elif value is not None and value != default:
            found.configured[dest] = (value, home.path)
    return found


def apply_to_namespace(ns: Any, defaults: Mapping[str, Any] | None = None, *, explicit: Iterable[str] = (),
                       environ: Mapping[str, str] | None = None, capabilities: Capabilities | None = None,
                       announce: bool = True) -> Plan:
    """Decide every toggle for ``ns`` and write the decisions back onto it (and
    ``ns.perf_toggles``, as the argparse path does). ``defaults``: Primus's (read from the imported
    package when omitted)."""
    environ = os.environ if environ is None else environ
    found = read(ns, primus_defaults() if defaults is None else defaults, explicit)
    plan, caps, env = frontend.decide_found(found, environ, capabilities)
    for dest, decision in plan.decisions.items():
        setattr(ns, dest, decision.value)
    for dest, path in plan.log_dirs.items():
        setattr(ns, dest, path)
    ns.perf_toggles_precision = plan.precision
    ns.perf_toggles = frontend.provenance.decision_records(plan)
    if plan.wgrad_path == "fallback" and capabilities is None:
        from .runtime import wgrad_fallback

        wgrad_fallback.activate()
    if announce:
        frontend.announce(plan, caps, env, environ, frontend.provenance.record_dir(plan, found.args))
    return plan


def build_args_patch(ctx: Any) -> None:
    """Primus's ``build_args`` phase: the namespace is ``ctx.extra["backend_args"]``."""
    ns = ctx.extra.get("backend_args")
    if ns is not None:
        apply_to_namespace(ns)


def register() -> bool:
    """Register :func:`build_args_patch` with Primus (its registry replaces a patch registered again
    under the same id); False where Primus is not importable. Priority 90: after Primus's own
    argument patches (lower numbers run first), so the plugin decides on their result."""
    try:
        from primus.core.patches import register_patch
    except ImportError:
        return False
    register_patch(PATCH_ID, backend="megatron", phase="build_args", priority=90,
                   description="megatron-perf-toggles: the plugin's toggle decisions")(build_args_patch)
    return True


register()
