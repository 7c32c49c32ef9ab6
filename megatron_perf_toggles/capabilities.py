"""What this machine and this Megatron can honour. The one module that probes packages.

Nothing here raises because a package is missing: an absent package is a capability that is
``False`` (or a version that is ``None``), with a note saying why. Probes use import specs and
package metadata where they can, so asking is cheap; kernels are only imported where the package
itself is already there.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .errors import AssumeError

# Earliest Transformer Engine releases with the kernels the toggles use. Only consulted when a
# run is planned with MEGATRON_PERF_TOGGLES_ASSUME=te=VERSION; real runs import the kernels.
TE_MIN_FUSED_QKV_ROPE = (2, 8)
TE_MIN_CROSS_ENTROPY = (2, 0)

ASSUME_NAMES = ("apex", "aiter", "rocm", "cuda", "te=VERSION", "none")


@dataclass(frozen=True)
class MegatronFacts:
    """Facts about the Megatron-LM in use. ``None`` means unknown (no Megatron imported)."""

    version: str | None = None
    path: str | None = None
    fused_single_qkv_rope_field: bool | None = None
    asserts_te_cross_entropy: bool | None = None
    asserts_ddp_average_with_gtp: bool | None = None
    has_parse_and_validate_args: bool | None = None
    pretrain_takes_extra_args_provider: bool | None = None
    rules: tuple[str, ...] | None = None  # ids from megatron_rules.RULES present in this Megatron

    def has_rule(self, rule_id: str) -> bool:
        """Whether this Megatron enforces ``rule_id``; an unknown Megatron is assumed to."""
        return self.rules is None or rule_id in self.rules


@dataclass(frozen=True)
class Capabilities:
    megatron: MegatronFacts = field(default_factory=MegatronFacts)
    te_version: str | None = None
    te_fused_qkv_rope: bool = False
    te_cross_entropy: bool = False
    apex_fused_wgrad: bool = False
    wgrad_fallback: bool = False  # our torch stand-in for APEX's fused wgrad can run here
    aiter_version: str | None = None
    torch_version: str | None = None
    device: str | None = None  # "cuda", "rocm" or "cpu"; None when torch is absent
    gpu_arch: str | None = None
    gpu_source: str | None = None  # "detected", or what a dry run planned for ("--gpu h100", ...)
    assumed: tuple[str, ...] = ()  # capability names that came from MEGATRON_PERF_TOGGLES_ASSUME
    notes: dict[str, str] = field(default_factory=dict)  # capability -> why it is missing

    @property
    def megatron_fused_single_qkv_rope_field(self) -> bool | None:
        return self.megatron.fused_single_qkv_rope_field

    def has(self, name: str) -> bool | None:
        return getattr(self, name)

    def is_assumed(self, name: str) -> bool:
        return name in self.assumed

    def to_record(self) -> dict[str, Any]:
        out = asdict(self)
        out["assumed"] = list(self.assumed)
        return out


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _dist_version(*names: str) -> str | None:
    import importlib.metadata  # lazy: ~50 ms, and only needed when a package is actually there

    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_tuple(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)


def _te_version() -> str | None:
    module = sys.modules.get("transformer_engine")
    version = getattr(module, "__version__", None) if module is not None else None
    return version or _dist_version("transformer_engine", "transformer-engine", "transformer_engine_torch") or (
        "unknown" if module is not None else None)


def _fallback_installed() -> bool:
    from .wgrad_fallback import MODULE_NAME, is_fallback

    return is_fallback(sys.modules.get(MODULE_NAME))


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
    import inspect

    try:
        source = inspect.getsource(arguments.validate_args)
        facts["asserts_te_cross_entropy"] = "cross_entropy_fusion_impl == 'te'" in source
        facts["asserts_ddp_average_with_gtp"] = (
            "ddp_average_in_collective" in source and "gtp" in source.lower()
        )
    except (OSError, TypeError):
        pass
    try:
        import dataclasses

        from megatron.core.transformer.transformer_config import TransformerConfig

        names = {f.name for f in dataclasses.fields(TransformerConfig)}
        facts["fused_single_qkv_rope_field"] = "fused_single_qkv_rope" in names
    except Exception:  # noqa: BLE001
        pass
    from . import megatron_rules

    facts["rules"] = megatron_rules.detect(facts["path"])
    training = sys.modules.get("megatron.training.training")
    if training is not None and hasattr(training, "pretrain"):
        params = inspect.signature(training.pretrain).parameters
        facts["pretrain_takes_extra_args_provider"] = "extra_args_provider" in params
    return MegatronFacts(**facts)


def _detect_torch(deep: bool) -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None and deep and _installed("torch"):
        try:
            import torch
        except Exception:  # noqa: BLE001
            torch = None
    if torch is None:
        return {"torch_version": _dist_version("torch") if deep else None}
    version = getattr(torch, "version", None)
    device = "rocm" if getattr(version, "hip", None) else ("cuda" if getattr(version, "cuda", None) else "cpu")
    out: dict[str, Any] = {"torch_version": getattr(torch, "__version__", None), "device": device}
    from .target import active

    planned = active()
    if planned is not None and planned.gpu is not None:  # a dry run's planned GPU (target.py)
        out.update(device=planned.gpu.vendor, gpu_arch=planned.gpu.arch, gpu_source=planned.gpu_source)
        return out
    if deep:
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                arch = getattr(props, "gcnArchName", None)
                out["gpu_arch"] = arch or f"sm_{props.major}{props.minor}"
                out["gpu_source"] = "detected"
        except Exception:  # noqa: BLE001
            pass
    return out


def detect(deep: bool = False) -> Capabilities:
    """Probe this machine. ``deep`` also imports torch/TE kernels when they are installed."""
    notes: dict[str, str] = {}
    te_imported = "transformer_engine" in sys.modules
    te_version = _te_version() if te_imported or _installed("transformer_engine") else None
    te_rope = te_ce = False
    if te_version is None:
        notes["te"] = "Transformer Engine is not installed"
    elif deep or te_imported:
        te_rope = _try_import("transformer_engine.pytorch.attention.rope", "apply_fused_qkv_rotary_pos_emb")
        te_ce = _try_import("transformer_engine.pytorch.cross_entropy", "parallel_cross_entropy")
    else:
        # Installed but not imported yet: judge by version rather than pay for the import here.
        vt = version_tuple(te_version or "0")
        te_rope, te_ce = vt >= TE_MIN_FUSED_QKV_ROPE, vt >= TE_MIN_CROSS_ENTROPY
    if te_version is not None and not te_rope:
        notes["te_fused_qkv_rope"] = f"TE {te_version} has no fused QKV RoPE kernel"
    if te_version is not None and not te_ce:
        notes["te_cross_entropy"] = f"TE {te_version} has no parallel cross-entropy kernel"
    apex = _installed("fused_weight_gradient_mlp_cuda") and not _fallback_installed()
    fallback = False
    if not apex:
        notes["apex_fused_wgrad"] = "APEX's fused_weight_gradient_mlp_cuda is not importable"
        if deep or "torch" in sys.modules:
            from .wgrad_fallback import usable

            fallback, why = usable()
        else:
            why = "torch is not imported"
        if not fallback:
            notes["wgrad_fallback"] = why
    aiter_version = None
    if _installed("aiter"):  # AMD's amd-aiter and PyPI's unrelated async 'aiter' share the module name
        aiter_version = _dist_version("amd-aiter", "amd_aiter")
        if aiter_version is None and _dist_version("aiter") is not None:
            notes["aiter"] = "the installed 'aiter' is the PyPI async library, not AMD's amd-aiter"
    return Capabilities(
        megatron=megatron_facts(),
        te_version=te_version,
        te_fused_qkv_rope=te_rope,
        te_cross_entropy=te_ce,
        apex_fused_wgrad=apex,
        wgrad_fallback=fallback,
        aiter_version=aiter_version,
        notes=notes,
        **_detect_torch(deep),
    )


# What ``none`` plans for: none of the packages the guards ask about.
ASSUME_NONE: dict[str, Any] = {
    "apex_fused_wgrad": False,
    "wgrad_fallback": False,
    "te_version": None,
    "te_fused_qkv_rope": False,
    "te_cross_entropy": False,
    "aiter_version": None,
}
# The notes (reasons a capability is missing) that an assumed value makes stale.
_NOTES_OF = {
    "apex_fused_wgrad": ("apex_fused_wgrad",), "wgrad_fallback": ("wgrad_fallback",),
    "te_version": ("te", "te_fused_qkv_rope", "te_cross_entropy"), "te_fused_qkv_rope": ("te_fused_qkv_rope",),
    "te_cross_entropy": ("te_cross_entropy",), "aiter_version": ("aiter",),
}


def parse_assume(spec: str) -> dict[str, Any]:
    """``apex,te=2.8,rocm`` -> the capabilities it names, and only those (``none``: no packages).
    Unknown names are an AssumeError."""
    out: dict[str, Any] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip().lower()
        if name == "apex" and not value:
            out["apex_fused_wgrad"] = True
        elif name == "aiter" and not value:
            out["aiter_version"] = "assumed"
        elif name in ("rocm", "cuda") and not value:
            out["device"] = name
            out["wgrad_fallback"] = True  # a GPU with a current torch: the stand-in can run
        elif name == "none" and not value:
            out.update(ASSUME_NONE)
        elif name == "te":
            vt = version_tuple(value.strip())
            if not vt:
                raise AssumeError(
                    f"MEGATRON_PERF_TOGGLES_ASSUME: {item!r} needs a Transformer Engine version, e.g. te=2.8"
                )
            out["te_version"] = value.strip()
            out["te_fused_qkv_rope"] = vt >= TE_MIN_FUSED_QKV_ROPE
            out["te_cross_entropy"] = vt >= TE_MIN_CROSS_ENTROPY
        else:
            raise AssumeError(
                f"MEGATRON_PERF_TOGGLES_ASSUME: unknown entry {item!r}; accepted: {', '.join(ASSUME_NAMES)}"
            )
    return out


def assumed_device(spec: str | None = None) -> str | None:
    """``cuda`` or ``rocm`` where MEGATRON_PERF_TOGGLES_ASSUME names one (a bad spelling: None;
    the provider reports it)."""
    import os

    spec = os.environ.get("MEGATRON_PERF_TOGGLES_ASSUME") if spec is None else spec
    try:
        return parse_assume(spec).get("device") if spec else None
    except AssumeError:
        return None


def with_assumptions(caps: Capabilities, spec: str | None) -> Capabilities:
    """Replace what ``spec`` names, and only that; the rest (Megatron facts included) stays as detected."""
    if not spec:
        return caps
    overrides = parse_assume(spec)
    stale = {note for name in overrides for note in _NOTES_OF.get(name, ())}
    notes = {k: v for k, v in caps.notes.items() if k not in stale}
    return replace(caps, **overrides, assumed=tuple(sorted({*caps.assumed, *overrides})), notes=notes)


def resolve(spec: str | None, deep: bool = False) -> Capabilities:
    return with_assumptions(detect(deep=deep), spec)


def megatron_facts_from_surface(surface: dict[str, Any]) -> MegatronFacts:
    """Megatron facts from a recorded surface (planning without a checkout)."""
    known = {f for f in MegatronFacts.__dataclass_fields__}
    facts = {k: v for k, v in surface.get("facts", {}).items() if k in known}
    if isinstance(facts.get("rules"), list):
        facts["rules"] = tuple(facts["rules"])
    return MegatronFacts(**facts)
