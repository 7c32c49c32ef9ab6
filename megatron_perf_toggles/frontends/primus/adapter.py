"""The Primus adapter: read the Megatron namespace Primus builds from YAML, write a plan back.

The public face is ``megatron_perf_toggles.primus`` (the patches registered with Primus); this
module is the adapter behind it, so that ``explain --primus-config`` (``frontends/explain.py``) can
plan with it too. Primus's namespace is Megatron's, so reading is mostly knowing what counts as
set: Primus ships defaults for Megatron's arguments in its own YAML files
(``core.config_fields.PRIMUS_DEFAULT_FILES``; its base trainer turns cross-entropy fusion,
average-in-collective and bf16 gradient reduction off). A value equal to Primus's default (or, for
an argument Primus does not declare, to Megatron's) is the plugin's to decide; any other value
was set by the experiment or the model file (the ``config`` tier). Reasons name the YAML keys.
Writing is the Controller's: the decisions land on the namespace itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ...core.config_fields import PRIMUS_DEFAULT_FILES, PRIMUS_HOMES
from ...core.decision.decide import FP4_LAYER_DESTS, MEGATRON_FP4_LAYER_DEFAULTS, Plan
from ...core.facts import Capabilities
from ...core.registry import BY_DEST
from ...core.stock_off import MEGATRON_DEFAULT
from ...runtime.context import Mode, RunContext
from ...runtime.controller import Registration
from ...runtime.machine.target import Target
from .. import adapter as frontend

PATCH_ID = "megatron_perf_toggles.decisions"  # the build_args patch, as Primus's registry knows it
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
        from ...errors import PerfTogglesError

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
        from ...errors import PerfTogglesError

        raise PerfTogglesError(f"primus: explicit names no toggle: {', '.join(sorted(named - set(PRIMUS_HOMES)))}")
    found = frontend.Found(args=args, words={dest: f"YAML key {dest}" for dest in args})
    for dest, homes in PRIMUS_HOMES.items():
        home = homes[0]
        value = getattr(ns, home.path, _MISSING)
        if value is _MISSING:  # this Megatron has no flag for it: the plugin adds the dest, stock is Megatron's default
            found.stock[dest], found.stock_from[dest] = megatron_default(dest), MEGATRON_DEFAULT
            continue
        found.stock[dest] = value
        default = defaults[dest] if dest in defaults else megatron_default(dest)
        found.stock_from[dest] = (f"Primus's default (YAML key {home.path}: {_yaml(defaults[dest])})"
                                  if dest in defaults else MEGATRON_DEFAULT)
        if dest in named:
            found.explicit[dest] = (value, f"YAML key {home.path}")
        elif value is not None and value != default:
            found.configured[dest] = (value, f"YAML key {home.path}: {_yaml(value)}")
    return found


def _yaml(value: Any) -> str:
    """A value as the YAML file writes it."""
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def apply_to_namespace(ns: Any, defaults: Mapping[str, Any] | None = None, *, explicit: Iterable[str] = (),
                       environ: Mapping[str, str] | None = None, capabilities: Capabilities | None = None,
                       announce: bool = True) -> Plan:
    """Decide every toggle for ``ns`` and write the decisions back onto it (and
    ``ns.perf_toggles``, as the argparse path does), through the one pipeline
    (``frontends.adapter``): resume check and history, cross-rank check, the start-up table and
    record. ``defaults``: Primus's (read from the imported package when omitted). A request that
    cannot be honoured raises a PerfTogglesError with one line."""
    ctx, plan, reg = _plan(ns, defaults, explicit, environ, "run", capabilities, None, announce)
    frontend.take_over(ctx, ns, ns, reg)  # the process's context: check_ranks() and the validation patch find it
    return plan


def explain(ns: Any, defaults: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None,
            target: Target | None = None, capabilities: Capabilities | None = None,
            ) -> tuple[Plan, Capabilities, dict[str, Any]]:
    """What the patch decides for ``ns`` on the job ``target`` plans (``explain``): the same
    pipeline in ``plan`` mode (``capabilities``: given, e.g. with a recorded Megatron's facts).
    Returns the plan, its capabilities and the arguments it read."""
    ctx, plan, _ = _plan(ns, defaults, (), environ, "plan", capabilities, target, False)
    return frontend.explained(ctx, plan, dict(vars(ns)))


def _plan(ns: Any, defaults: Mapping[str, Any] | None, explicit: Iterable[str], environ: Mapping[str, str] | None,
          mode: Mode, capabilities: Capabilities | None, target: Target | None, announce: bool,
          ) -> tuple[RunContext, Plan, Registration]:
    found = read(ns, primus_defaults() if defaults is None else defaults, explicit)
    ctx, plan, _, reg = frontend.planned("primus", found, ns=ns, environ=environ, mode=mode, caps=capabilities,
                                         target=target, announce=announce)
    return ctx, plan, reg
