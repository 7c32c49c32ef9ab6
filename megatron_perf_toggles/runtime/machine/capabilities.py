"""What this machine and this Megatron can honour. The one module that probes packages.

Nothing here raises because a package is missing: an absent package is a capability that is
``False`` (or a version that is ``None``), with a note saying why. Probes use import specs and
package metadata where they can, so asking is cheap; kernels are only imported where the package
itself is already there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from ...core import stock_off
from ...core.facts import Capabilities, MegatronFacts, describe_stack, planned_stack, version_tuple, with_assumptions
from ...core.registry import BY_CAPABILITY, Capability
from .assume import assumed, assumed_device  # noqa: F401 - asked of this module by its callers
from .probe import dist_version as _dist_version
from .probe import gpu_question_without_torch, torch_build, torch_module
from .probe import installed as _installed

if TYPE_CHECKING:  # types only
    from ...core.env import EnvSettings
    from .target import Target


TE_BROKEN = "is installed but does not import"  # doctor's word for such a Transformer Engine


def _te_import_failure(version: str) -> str | None:
    """Where the installed Transformer Engine does not import (the empty ``transformer-engine``
    meta package that ``pip install transformer-engine`` alone leaves raises at import; so does a
    build for another CUDA), why, in one line; None where it imports."""
    from .probe import import_failure

    error = import_failure("transformer_engine")
    if error is None:
        return None
    first = str(error).strip().split(". ")[0].splitlines()[0] if str(error).strip() else "no message"
    return f"Transformer Engine {version} {TE_BROKEN} ({type(error).__name__}: {first})"


def _te_version() -> str | None:
    module = sys.modules.get("transformer_engine")
    version = getattr(module, "__version__", None) if module is not None else None
    return version or _dist_version("transformer_engine", "transformer-engine", "transformer_engine_torch") or (
        "unknown" if module is not None else None)


def _stand_in(module: str) -> bool:
    """Whether ``module`` is this package's torch stand-in, installed under APEX's name."""
    from ..wgrad_fallback import is_fallback

    return is_fallback(sys.modules.get(module))


def _try_import(path: str, attr: str) -> bool:
    try:
        return hasattr(importlib.import_module(path), attr)
    except Exception:  # noqa: BLE001 - a broken optional package counts as absent
        return False


def megatron_facts() -> MegatronFacts:
    """Facts about the Megatron whose ``megatron.training.arguments`` is imported (or importable)."""
    if "megatron.training.arguments" not in sys.modules and not _installed("megatron.training"):
        return MegatronFacts()
    try:
        from megatron.core import package_info
        from megatron.training import arguments
    except Exception:  # noqa: BLE001 - report "unknown" rather than fail the caller
        return MegatronFacts()
    facts: dict[str, Any] = {
        "version": getattr(package_info, "__version__", None),
        "path": str(getattr(arguments, "__file__", "") or "").rsplit("/megatron/training/", 1)[0] or None,
        "has_parse_and_validate_args": hasattr(arguments, "parse_and_validate_args"),
    }
    facts["rules"] = detect_rules(facts["path"])  # each rule by its phrase; the rules' facts follow
    return MegatronFacts(**facts)


def detect_rules(root: str | os.PathLike[str] | None) -> tuple[str, ...] | None:
    """The ids of the rules present in the Megatron-LM checkout at ``root`` (None: unknown).
    Read once per checkout and process: every parse in a launch asks again."""
    return _detect(os.fspath(root) if root else None)


@functools.cache
def _detect(root: str | None) -> tuple[str, ...] | None:
    if not root or not os.path.isfile(os.path.join(root, "megatron", "training", "arguments.py")):
        return None
    from ...core.rules.megatron_rules import RULES  # only where a checkout is read: ~1 ms of import otherwise

    texts: dict[str, str] = {}
    found: list[str] = []
    for rule in RULES:
        if not rule.phrase:
            continue
        for rel in rule.where:
            if rel not in texts:
                try:
                    with open(os.path.join(root, rel), encoding="utf-8") as fh:
                        texts[rel] = fh.read()
                except OSError:
                    texts[rel] = ""
            if rule.phrase in texts[rel]:
                found.append(rule.id)
                break
    return tuple(found)


def _build_kind(hip: str | None, cuda: str | None) -> str:
    """What a torch build targets, from its ``version.hip`` and ``version.cuda``."""
    return "rocm" if hip else ("cuda" if cuda else "cpu")


def _detect_torch(deep: bool, planned: Target | None = None) -> dict[str, Any]:
    build = torch_build() if deep and gpu_question_without_torch() else None
    # where no GPU can be visible, the installed build says all an import would (no 2 s import)
    torch = None if build is not None else torch_module(import_it=deep)
    out: dict[str, Any]
    if build is not None:
        out = {"torch_version": build["__version__"], "device": _build_kind(build.get("hip"), build.get("cuda"))}
    elif torch is None:
        out = {"torch_version": _dist_version("torch") if deep else None}
    else:
        version = getattr(torch, "version", None)
        out = {"torch_version": getattr(torch, "__version__", None),
               "device": _build_kind(getattr(version, "hip", None), getattr(version, "cuda", None))}
    if planned is not None and planned.gpu is not None:  # the planned GPU's facts come from the table
        out.update(device=planned.gpu.vendor, gpu_arch=planned.gpu.arch, gpu_name=planned.gpu.product,
                   gpu_source=planned.gpu_source, gpu_memory_mb=float(planned.gpu.memory_gib * 1024))
        return out
    if torch is None:
        return out
    out["gpu_memory_mb"] = gpu_memory_here(torch)  # the memory guard's denominator (core/memory/memory_guard.py)
    if deep:
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                arch = getattr(props, "gcnArchName", None)
                out["gpu_arch"] = arch or f"sm_{props.major}{props.minor}"
                out["gpu_name"] = getattr(props, "name", None)
                out["gpu_source"] = "detected"
        except Exception:  # noqa: BLE001
            pass
    return out


def gpu_memory_here(torch: Any) -> float | None:
    """The first visible GPU's total memory in MB, from the device itself; None without one. Like
    gpu_name_here it initialises CUDA without creating a context."""
    try:
        if not torch.cuda.is_available():
            return None
        return float(torch.cuda.get_device_properties(0).total_memory) / 2**20
    except Exception:  # noqa: BLE001 - no answer is "unknown", not an error
        return None


def gpu_name_here() -> str | None:
    """The first visible GPU's product name, asked of a torch that is already imported; None where
    there is none. It initialises CUDA (no context), so it is asked only when a profile needs it
    and in dry runs, never on a plain run's start-up path."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no answer is "unknown", not an error
        return None


def detect(deep: bool = False, target: Target | None = None, megatron: MegatronFacts | None = None) -> Capabilities:
    """Probe this machine. ``deep`` also imports torch/TE kernels when they are installed (torch
    only where a GPU can be visible: elsewhere its build file gives its version and kind). A
    ``target`` with a GPU (a plan for another machine) answers the GPU's facts from its table;
    ``megatron`` given answers Megatron's (none is imported)."""
    te_version = _te_version() if "transformer_engine" in sys.modules or _installed("transformer_engine") else None
    notes: dict[str, str] = {} if te_version is not None else {"te": "Transformer Engine is not installed"}
    broken = _te_import_failure(te_version) if deep and te_version and "transformer_engine" not in sys.modules else None
    if broken:  # its kernels answer no, and the note says why once
        te_version, notes["te"] = None, broken
    have: dict[str, bool] = {}
    for cap in list(BY_CAPABILITY.values()):
        if cap.stored:
            have[cap.name], why = _detect_one(cap, deep, te_version)
            if not have[cap.name] and why:
                notes[cap.name] = why
    aiter_version = None
    if _installed("aiter"):  # AMD's amd-aiter and PyPI's unrelated async 'aiter' share the module name
        aiter_version = _dist_version("amd-aiter", "amd_aiter")
        if aiter_version is None and _dist_version("aiter") is not None:
            notes["aiter"] = "the installed 'aiter' is the PyPI async library, not AMD's amd-aiter"
    return Capabilities(
        megatron=megatron_facts() if megatron is None else megatron,
        te_version=te_version,
        have=have,
        aiter_version=aiter_version,
        notes=notes,
        **_detect_torch(deep, target),
    )


def _wgrad_fallback(deep: bool) -> tuple[bool, str]:
    """The torch stand-in for APEX's fused wgrad, where APEX is missing and torch can run it."""
    if _detect_one(BY_CAPABILITY["apex_fused_wgrad"], deep, None)[0]:
        return False, ""  # APEX itself: no stand-in wanted, and nothing missing to explain
    if not (deep or "torch" in sys.modules):
        return False, "torch is not imported"
    from ..wgrad_fallback import usable

    return usable()


# Capabilities detected by a probe of their own (registry ``detected="probe:NAME"``).
PROBES = {"wgrad_fallback": _wgrad_fallback}


def _detect_one(cap: Capability, deep: bool, te_version: str | None) -> tuple[bool, str]:
    """One stored capability as its registry record says it is detected; (present, why not)."""
    kind, _, what = cap.detected.partition(":")
    note = cap.note.format(te_version=te_version)
    if kind == "installed":  # and not our own stand-in under its name (runtime/wgrad_fallback.py)
        return (_installed(what) and not _stand_in(what)), note
    if kind == "probe":
        return PROBES[what](deep)
    module, _, attr = what.partition(":")
    package = module.split(".")[0]
    if package == "transformer_engine" and te_version is None:
        return False, ""  # "te" says why once, for every kernel of it
    if deep or package in sys.modules:
        return _try_import(module, attr), note
    # Installed but not imported yet: judge by version rather than pay for the import here.
    return version_tuple(te_version or "0") >= (cap.te_minimum or ()), note


def resolve(spec: str | None, deep: bool = False) -> Capabilities:
    return with_assumptions(detect(deep=deep), spec)


def effective_assume(spec: str | None, target: Target | None = None) -> str | None:
    """The ASSUME spec that holds for ``target`` (None: this machine): for a plan for another
    machine (``target.elsewhere``), that GPU family's planned stack with ``spec`` on top; for
    this machine, ``spec`` alone."""
    from .target import elsewhere

    if not elsewhere(target):
        return spec
    assert target is not None and target.gpu is not None
    return planned_stack(target.gpu.vendor, spec)


def for_plan(spec: str | None, deep: bool = False, target: Target | None = None,
             megatron: MegatronFacts | None = None, env: EnvSettings | None = None) -> Capabilities:
    """The capabilities a plan rests on, one rule for ``explain`` and the dry run: detected here for
    a plan for this machine; for another machine (a named GPU or world, or no GPU here), the planned
    stack of its GPU family, named in ``Capabilities.stack``, with ``MEGATRON_PERF_TOGGLES_ASSUME``
    on top. Facts of this machine's packages never describe another machine. ``megatron``: the
    Megatron the plan is for where it is known already (a recorded surface), so that a Megatron on
    this machine's path is not imported (seconds) for facts that would be replaced. ``env``: the
    settings the plan runs under, so that the stack names the wgrad fallback only where the plugin
    would install it (not with MEGATRON_PERF_TOGGLES=0)."""
    effective = effective_assume(spec, target)
    caps = with_assumptions(detect(deep=deep, target=target, megatron=megatron), effective)
    if effective == spec:
        return caps
    fallback = None if env is None else stock_off.fallback_installed(caps, env)
    return dataclasses.replace(caps, stack=describe_stack(caps, hint=False, fallback=fallback))
