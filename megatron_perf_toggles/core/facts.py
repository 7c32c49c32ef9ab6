"""What a machine and a Megatron can honour, as plain data: the facts the guards decide on.

Probing lives in ``runtime.capabilities``; this module only holds the records, the version
helpers and the ``MEGATRON_PERF_TOGGLES_ASSUME`` overrides, so the pure policy (``decide``,
``ckpt_layout``) and planning for another machine need no probing at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import AssumeError

# Earliest Transformer Engine releases with the kernels the toggles use. Only consulted when a
# run is planned with MEGATRON_PERF_TOGGLES_ASSUME=te=VERSION; real runs import the kernels.
TE_MIN_FUSED_QKV_ROPE = (2, 8)
TE_MIN_CROSS_ENTROPY = (2, 0)

ASSUME_NAMES = ("apex", "aiter", "rocm", "cuda", "te=VERSION", "none")


@dataclass(frozen=True, slots=True)
class MegatronFacts:
    """Facts about the Megatron-LM in use. ``None`` means unknown (no Megatron imported)."""

    version: str | None = None
    path: str | None = None
    fused_single_qkv_rope_field: bool | None = None
    asserts_te_cross_entropy: bool | None = None
    asserts_ddp_average_with_gtp: bool | None = None
    has_parse_and_validate_args: bool | None = None
    rules: tuple[str, ...] | None = None  # ids from megatron_rules.RULES present in this Megatron

    def has_rule(self, rule_id: str) -> bool:
        """Whether this Megatron enforces ``rule_id``; an unknown Megatron is assumed to."""
        return self.rules is None or rule_id in self.rules


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What this machine (or the planned one) offers the toggles: Megatron, TE, APEX, aiter, device."""

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
    gpu_name: str | None = None  # the product, where gpu_arch is known: "NVIDIA H200"
    gpu_source: str | None = None  # "detected", or what a dry run planned for ("--gpu h100", ...)
    gpu_memory_mb: float | None = None  # the GPU's total memory (MB of 2**20 B): the device's, or the planned GPU's
    assumed: tuple[str, ...] = ()  # capability names that came from MEGATRON_PERF_TOGGLES_ASSUME
    stack: str = ""  # the planned software stack a plan for another machine rests on ("" for this machine)
    notes: dict[str, str] = field(default_factory=dict)  # capability -> why it is missing

    @property
    def megatron_fused_single_qkv_rope_field(self) -> bool | None:
        return self.megatron.fused_single_qkv_rope_field

    def is_assumed(self, name: str) -> bool:
        return name in self.assumed

    def to_record(self) -> dict[str, Any]:
        out = asdict(self)
        out["assumed"] = list(self.assumed)
        return out


def version_tuple(text: str) -> tuple[int, ...]:
    """The release numbers at the start of a version: ``0.17.0rc0`` -> (0, 17, 0), and a local part
    is not a number of the release (``0.19.2+e810d78``, as Megatron stamps a checkout's commit,
    -> (0, 19, 2))."""
    parts: list[int] = []
    for piece in text.split("+", 1)[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():
            break
    return tuple(parts)



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


def with_assumptions(caps: Capabilities, spec: str | None) -> Capabilities:
    """Replace what ``spec`` names, and only that; the rest (Megatron facts included) stays as detected."""
    if not spec:
        return caps
    overrides = parse_assume(spec)
    stale = {note for name in overrides for note in _NOTES_OF.get(name, ())}
    notes = {k: v for k, v in caps.notes.items() if k not in stale}
    return replace(caps, **overrides, assumed=tuple(sorted({*caps.assumed, *overrides})), notes=notes)


# The software a plan for another machine assumes, per GPU family, as MEGATRON_PERF_TOGGLES_ASSUME
# entries: a recent Transformer Engine and no APEX, so gradient accumulation fusion runs on the
# package's torch fallback (CUDA); on AMD, ROCm's Transformer Engine and AMD's aiter. The variable
# replaces what it names on top of this (``apex`` adds APEX, ``te=2.1`` an older TE, ``none`` clears).
PLANNED_STACKS: dict[str, str] = {
    "cuda": "none,cuda,te=2.20",
    "rocm": "none,rocm,aiter,te=2.8",
}
STACK_VAR = "MEGATRON_PERF_TOGGLES_ASSUME"


def planned_stack(vendor: str | None, spec: str | None) -> str:
    """The ASSUME spec a plan for another ``vendor`` GPU rests on: the family's stack, then the
    user's own entries (which replace what they name)."""
    base = PLANNED_STACKS.get(vendor or "cuda", PLANNED_STACKS["cuda"])
    return f"{base},{spec}" if spec else base


def describe_stack(caps: Capabilities) -> str:
    """The software a plan rests on, in words, with the variable that changes it."""
    te = f"Transformer Engine {caps.te_version}" if caps.te_version else "no Transformer Engine"
    wgrad = ("APEX fused wgrad" if caps.apex_fused_wgrad else
             "no APEX (torch wgrad fallback)" if caps.wgrad_fallback else "no APEX, no wgrad fallback")
    aiter = "aiter" if caps.aiter_version else "no aiter"
    family = {"cuda": "NVIDIA", "rocm": "AMD"}.get(caps.device or "", caps.device or "?")
    return f"{family}: {te}, {wgrad}, {aiter} (change with {STACK_VAR}, e.g. apex,te=2.10)"


def megatron_facts_from_surface(surface: dict[str, Any]) -> MegatronFacts:
    """Megatron facts from a recorded surface (planning without a checkout)."""
    known = {f.name for f in fields(MegatronFacts)}
    facts = {k: v for k, v in surface.get("facts", {}).items() if k in known}
    if isinstance(facts.get("rules"), list):
        # The rules table says which releases carry each rule (found in real trees, documented
        # ones included): a rule the recorder could not detect by its phrase still binds there.
        from .megatron_rules import rules_of

        facts["rules"] = tuple(sorted({*facts["rules"], *rules_of(surface_release(surface))}))
    return MegatronFacts(**facts)


def surface_release(surface: dict[str, Any]) -> str:
    """The release a recorded surface is of, as the rules table names it (``0.19.0``, ``main``; a
    fork recorded as a delta: its base's)."""
    name = str(surface.get("release") or surface.get("name") or "")
    return name.removeprefix("core_v") if name else str(surface.get("facts", {}).get("version") or "")
