"""The Megatron-Bridge adapter: read a ``ConfigContainer``, write a plan back into its fields.

The public face is ``megatron_perf_toggles.bridge`` (``apply(cfg)`` before ``pretrain``); this
module is the adapter behind it, so that ``explain --bridge-recipe`` (``frontends/explain.py``) can
plan with it too. Its two jobs, as for every front end (``adapter.py``):

- read (:func:`read`): every field of the sections the guards read, under Megatron's dests, with
  its Bridge field path; each toggle's value and tier. A toggle field counts as set (the
  ``config`` tier) where the recipe function assigned it (``bridge_recipe.build`` watched it), or
  its value differs from the default its own dataclass declares (``dataclasses.fields``; a
  ``default_factory`` is called), or a model provider redeclares the field for its model (a class
  outside ``core.config_fields.BRIDGE_GENERIC_MODULES``). ``explicit`` names fields
  (``"model.cross_entropy_fusion_impl"``) or toggles to hold as command-line requests;
- write (:func:`write`): every field each decision lives in (``grad_reduce_in_fp32`` in both
  sections, the other way up).

Everything between is the one pipeline's: the Controller of a run context made per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ...core.config_fields import BRIDGE_DERIVED, BRIDGE_GENERIC_MODULES, BRIDGE_RUNTIME_FIELDS, BRIDGE_SECTIONS, Home, bridge_homes
from ...core.decision.decide import Plan
from ...core.facts import Capabilities
from ...runtime.context import Mode, RunContext
from ...runtime.controller import Controller, Registration
from ...runtime.machine.target import Target
from ...runtime.provenance import record_dir as record_dir_of
from .. import adapter as frontend
from . import comm_overlap as bridge_comm_overlap

_MISSING = object()


def _section(cfg: Any, path: str) -> tuple[Any, str]:
    """The object holding ``path``'s last name (``cfg.model`` for ``model.qk_layernorm``)."""
    *parents, name = path.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, part, None)
        if obj is None:
            return None, name
    return obj, name


def _read(cfg: Any, path: str) -> Any:
    obj, name = _section(cfg, path)
    return _MISSING if obj is None else getattr(obj, name, _MISSING)


def declared_default(obj: Any, name: str) -> Any:
    """The default ``obj``'s own dataclass declares for ``name`` (a factory is called), or a
    marker when it declares none (then any value counts as set)."""
    if not dataclasses.is_dataclass(obj):
        return _MISSING
    for f in dataclasses.fields(obj):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                try:
                    return f.default_factory()
                except Exception:  # noqa: BLE001 - a factory that cannot run here declares nothing usable
                    return _MISSING
    return _MISSING


def generic_declaration(obj: Any, name: str) -> bool:
    """Whether the class that declares ``name`` for ``obj`` is Megatron's or one of Bridge's generic
    configs (``BRIDGE_GENERIC_MODULES``): only then is its default the plugin's to decide. A model
    provider that redeclares the field chose that value for its model, as a recipe would."""
    field = getattr(type(obj), "__dataclass_fields__", {}).get(name)
    if field is None:
        return False
    declaring = [c for c in type(obj).__mro__ if getattr(c, "__dataclass_fields__", {}).get(name) is field][-1]
    return declaring.__module__.startswith(BRIDGE_GENERIC_MODULES)


def _resolve_mixed_precision(cfg: Any) -> None:
    """A recipe may name its precision (``"bf16_mixed"``); Bridge resolves the name first thing in
    ``runtime_config_update``. Resolving it here, the same way, lets the plugin set its fields."""
    if isinstance(getattr(cfg, "mixed_precision", None), str):
        from megatron.bridge.training.mixed_precision import get_mixed_precision_config

        cfg.mixed_precision = get_mixed_precision_config(cfg.mixed_precision)


def _args(cfg: Any) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
    """Every field of the sections the guards read, by name (earlier sections win), and where each came from."""
    args: dict[str, Any] = {}
    where: dict[str, tuple[Any, str]] = {}
    for section in BRIDGE_SECTIONS:
        obj = getattr(cfg, section, None)
        if obj is None or not dataclasses.is_dataclass(obj):
            continue
        for f in dataclasses.fields(obj):
            if f.name not in args and f.name not in BRIDGE_RUNTIME_FIELDS:
                args[f.name] = getattr(obj, f.name, None)
                where[f.name] = (obj, f.name)
    for dest, home in BRIDGE_DERIVED:
        value = _read(cfg, home.path)
        if value is _MISSING or value is None:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = value > 0
        if home.from_field(bool(value)) and not args.get(dest):
            args[dest] = True
    return args, where


def _named(explicit: Iterable[str], homes: Mapping[str, tuple[Home, ...]]) -> set[str]:
    names = set(explicit)
    unknown = names - set(homes) - {h.path for hs in homes.values() for h in hs}
    if unknown:
        from ...errors import PerfTogglesError

        raise PerfTogglesError(f"bridge.apply: explicit names no toggle or toggle field: {', '.join(sorted(unknown))}")
    return {dest for dest, hs in homes.items() if dest in names or any(h.path in names for h in hs)}


def read(cfg: Any, explicit: Iterable[str] = (), traced: Iterable[str] = ()) -> frontend.Found:
    """What the plugin reads of ``cfg``: arguments (with their field paths), configured and
    explicit toggle values. ``traced``: field paths the recipe function assigned (:func:`build`),
    configured whatever their value."""
    homes = bridge_homes()
    named = _named(explicit, homes)
    assigned = set(traced)
    args, where = _args(cfg)
    found = frontend.Found(args=args, words=_words(cfg, where))
    bridge_comm_overlap.overlay(cfg, args, found.words)  # what runtime_config_update will copy onto the model
    for dest, dest_homes in homes.items():
        home = next((h for h in dest_homes if _read(cfg, h.path) is not _MISSING), None)
        if home is None:
            continue  # this Bridge/Megatron has no field for it
        raw = _read(cfg, home.path)
        value = home.from_field(raw)
        args[dest] = value
        found.stock[dest] = value
        found.words[dest] = f"cfg.{home.path}"
        if home.inverted:
            found.inverted.add(dest)
        if dest in named:
            found.explicit[dest] = (value, f"cfg.{home.path}")
            continue
        obj, name = _section(cfg, home.path)
        default = declared_default(obj, name)
        if (default is _MISSING or default != raw or not generic_declaration(obj, name)
                or any(h.path in assigned for h in dest_homes)):
            found.configured[dest] = (value, f"cfg.{home.path} = {raw!r}")  # as the recipe wrote it
    return found


def _words(cfg: Any, where: Mapping[str, tuple[Any, str]]) -> dict[str, str]:
    """Each argument's Bridge field path (``cfg.model.qk_layernorm``), and for those Bridge spells
    otherwise, the field that sets it (packed sequences for Megatron's ``--sft``)."""
    sections = {id(getattr(cfg, s, None)): s for s in BRIDGE_SECTIONS}
    words = {dest: f"cfg.{sections.get(id(obj), '?')}.{name}" for dest, (obj, name) in where.items()}
    for dest, home in BRIDGE_DERIVED:
        value = _read(cfg, home.path)
        if value not in (_MISSING, None, False, 0) and not (isinstance(value, (int, float)) and value < 0):
            words[dest] = f"cfg.{home.path}"
    return words


def write(cfg: Any, plan: Plan) -> list[str]:
    """Every field each decision lives in; returns the paths written."""
    written = []
    for dest, decision in plan.decisions.items():
        for home in bridge_homes().get(dest, ()):
            obj, name = _section(cfg, home.path)
            if obj is None or not hasattr(obj, name):
                continue
            setattr(obj, name, home.to_field(decision.value))
            written.append(home.path)
    if plan.log_dirs:
        _, where = _args(cfg)
        for dest, path in plan.log_dirs.items():
            if dest in where:
                obj, name = where[dest]
                setattr(obj, name, path)
    return written


def apply(cfg: Any, *, explicit: Iterable[str] = (), environ: Mapping[str, str] | None = None,
          capabilities: Capabilities | None = None, record_dir: str | None = None,
          announce: bool = True) -> Plan:
    """Decide every toggle for ``cfg`` (a Bridge ``ConfigContainer``) and write the decisions into
    its fields, through the plugin's one pipeline (``frontends.adapter``): the resume check and
    history in ``cfg.checkpoint``, the cross-rank check, the start-up table and
    ``perf_toggles.json`` (rank 0; into ``record_dir``, else the tagged tensorboard or wandb
    directory, else ``cfg.checkpoint.save``), and the safety net around Bridge's
    ``ConfigContainer.validate``. ``capabilities`` plans for another machine instead of detecting
    this one's. Returns the plan; a request that cannot be honoured raises a PerfTogglesError with
    one line."""
    ctx, plan, view, reg = _plan(cfg, explicit, environ, "run", capabilities, None, announce)
    from .net import watch_validation

    def before_apply(controller: Controller) -> None:
        save = _read(cfg, "checkpoint.save")
        controller.record_dir = record_dir or record_dir_of(plan, vars(view)) or (save if isinstance(save, str) else None)
        watch_validation(cfg, ctx)

    frontend.take_over(ctx, cfg, view, reg, before_apply)
    return plan


def explain(cfg: Any, *, explicit: Iterable[str] = (), environ: Mapping[str, str] | None = None,
            target: Target | None = None) -> tuple[Plan, Capabilities, dict[str, Any]]:
    """What :func:`apply` decides for ``cfg`` on the job ``target`` plans (``explain``): the same
    pipeline in ``plan`` mode, so nothing of this machine is consulted or changed but the fields.
    Returns the plan, its capabilities and the arguments it read (Megatron's dests)."""
    ctx, plan, view, _ = _plan(cfg, explicit, environ, "plan", None, target, False)
    return frontend.explained(ctx, plan, vars(view))


def _plan(cfg: Any, explicit: Iterable[str], environ: Mapping[str, str] | None, mode: Mode,
          capabilities: Capabilities | None, target: Target | None, announce: bool,
          ) -> tuple[RunContext, Plan, Any, Registration]:
    from .recipe import traced_fields

    _resolve_mixed_precision(cfg)
    found = read(cfg, explicit, traced_fields(cfg))
    return frontend.planned("bridge", found, write=lambda plan: write(cfg, plan), environ=environ, mode=mode,
                            caps=capabilities, target=target, announce=announce)
