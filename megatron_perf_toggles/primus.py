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
from .errors import PerfTogglesError
from .runtime import frontend
from .runtime.context import Mode, RunContext
from .runtime.controller import Registration
from .runtime.target import Target

PATCH_ID = "megatron_perf_toggles.decisions"
VALIDATE_ID = "megatron_perf_toggles.validate_args"
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
    """What the plugin reads of Primus's namespace: the arguments, and which toggles it set. Its
    keys are Megatron's dests, so each argument's name in the user's YAML is its dest."""
    args = dict(vars(ns))
    named = set(explicit)
    if named - set(PRIMUS_HOMES):
        from .errors import PerfTogglesError

        raise PerfTogglesError(f"primus: explicit names no toggle: {', '.join(sorted(named - set(PRIMUS_HOMES)))}")
    found = frontend.Found(args=args, words={dest: f"YAML key {dest}" for dest in args})
    for dest, homes in PRIMUS_HOMES.items():
        home = homes[0]
        value = getattr(ns, home.path, _MISSING)
        if value is _MISSING:  # this Megatron has no flag for it: the plugin adds the dest, stock is Megatron's default
            found.stock[dest] = megatron_default(dest)
            continue
        found.stock[dest] = value
        default = defaults[dest] if dest in defaults else megatron_default(dest)
        if dest in named:
            found.explicit[dest] = (value, f"YAML key {home.path}")
        elif value is not None and value != default:
            found.configured[dest] = (value, f"YAML key {home.path}")
    return found


def apply_to_namespace(ns: Any, defaults: Mapping[str, Any] | None = None, *, explicit: Iterable[str] = (),
                       environ: Mapping[str, str] | None = None, capabilities: Capabilities | None = None,
                       announce: bool = True, mode: Mode = "run", target: Target | None = None) -> Plan:
    """Decide every toggle for ``ns`` and write the decisions back onto it (and
    ``ns.perf_toggles``, as the argparse path does), through the one pipeline
    (``runtime.frontend``): resume check and history, cross-rank check, the start-up table and
    record. ``defaults``: Primus's (read from the imported package when omitted). A request that
    cannot be honoured raises a PerfTogglesError with one line."""
    found = read(ns, primus_defaults() if defaults is None else defaults, explicit)
    ctx = frontend.start("primus", environ, mode=mode, capabilities_=capabilities, target=target, announce=announce)
    plan, _, reg = frontend.plan(ctx, found, ns)
    ctx.plan = plan
    if mode == "run":
        ctx.install()  # the process's context: check_ranks() and the validation patch find it
        _PLANNED[id(ns)] = (ns, ctx, reg)
        assert ctx.controller is not None
        ctx.controller.apply(ns, reg)
    return plan


# The namespaces planned in this process, for the before_train patch (its context carries the same namespace).
_PLANNED: dict[int, tuple[Any, RunContext, Registration]] = {}
_REFUSED: dict[int, tuple[Any, PerfTogglesError]] = {}


def build_args_patch(ctx: Any) -> None:
    """Primus's ``build_args`` phase: the namespace is ``ctx.extra["backend_args"]``. A refusal is
    kept for the namespace, not raised here: Primus logs and swallows what a patch raises, so it
    stops the job where Primus's own checks do (:func:`before_train_patch`)."""
    ns = ctx.extra.get("backend_args")
    if ns is None:
        return
    try:
        apply_to_namespace(ns)
    except PerfTogglesError as error:
        _REFUSED[id(ns)] = (ns, error)  # its one line comes with the stop


def before_train_patch(ctx: Any) -> None:
    """Primus's ``before_train`` phase, after its own ``megatron.validate_args`` patch: Megatron's
    ``validate_args`` (as Primus wrapped it) raises a refusal kept at ``build_args``, with one line
    and exit status 2 on every rank, and otherwise runs inside the safety net."""
    from .runtime import primus_validate

    primus_validate.install(ctx.extra.get("backend_args"), _PLANNED, _REFUSED)


def register() -> bool:
    """Register the patches with Primus (its registry replaces a patch registered again under the
    same id); False where Primus is not importable. ``build_args`` at priority 90: after Primus's
    own argument patches (lower numbers run first), so the plugin decides on their result;
    ``before_train`` at 90: after Primus wrapped ``validate_args``."""
    try:
        from primus.core.patches import register_patch
    except ImportError:
        return False
    register_patch(PATCH_ID, backend="megatron", phase="build_args", priority=90,
                   description="megatron-perf-toggles: the plugin's toggle decisions")(build_args_patch)
    register_patch(VALIDATE_ID, backend="megatron", phase="before_train", priority=90,
                   description="megatron-perf-toggles: refusals and the safety net at validate_args")(before_train_patch)
    return True


register()
