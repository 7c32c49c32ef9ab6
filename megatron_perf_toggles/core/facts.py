"""What a machine and a Megatron can honour, as plain data: the facts the guards decide on.

Probing lives in ``runtime.machine.capabilities``; this module only holds the records, the version
helpers and the ``MEGATRON_PERF_TOGGLES_ASSUME`` overrides, so the pure policy (``decide``,
``ckpt_layout``) and planning for another machine need no probing at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import AssumeError
from .registry import BY_CAPABILITY, Capability
from .rules.megatron_rules import BY_ID

ASSUME_NAMES = ("apex", "aiter", "grouped_gemm", "rocm", "cuda", "te=VERSION", "none")


@dataclass(frozen=True, slots=True)
class MegatronFacts:
    """Facts about the Megatron-LM in use. ``None`` means unknown (no Megatron imported)."""

    version: str | None = None
    path: str | None = None
    # A rule's fact (``MegatronRule.fact``): whether this Megatron carries that rule, as its rules say
    # where they were read (``__post_init__``), else as stated (a record made by hand); None: not known.
    fused_single_qkv_rope_field: bool | None = None
    moe_router_fusion_field: bool | None = None
    asserts_te_cross_entropy: bool | None = None
    asserts_ddp_average_with_gtp: bool | None = None
    has_parse_and_validate_args: bool | None = None
    rules: tuple[str, ...] | None = None  # ids from megatron_rules.RULES present in this Megatron

    def __post_init__(self) -> None:
        """Where the rules were read, each rule's fact is what they say (one truth, not two)."""
        if self.rules is not None:
            for rule in BY_ID.values():
                if rule.fact:
                    object.__setattr__(self, rule.fact, rule.id in self.rules)

    def has_rule(self, rule_id: str) -> bool:
        """Whether this Megatron enforces ``rule_id``: as its rules say where they were read, else
        as its ``fact`` states, else as the rule's ``if_unknown`` assumes (mostly: it does)."""
        if self.rules is not None:
            return rule_id in self.rules
        rule = BY_ID[rule_id]
        stated = getattr(self, rule.fact) if rule.fact else None
        return rule.if_unknown if stated is None else bool(stated)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What this machine (or the planned one) offers the toggles: Megatron, TE, APEX, aiter, device.

    The capabilities themselves are the registry's (``registry.CAPABILITY_RECORDS``): each is read
    as an attribute (``caps.te_cross_entropy``) or by :meth:`value_of`, and given as a keyword
    (``Capabilities(te_cross_entropy=True)``); a machine's own are kept in ``have`` (missing
    where not given), a Megatron fact's come from ``megatron``."""

    megatron: MegatronFacts = field(default_factory=MegatronFacts)
    te_version: str | None = None
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
    have: Mapping[str, bool] = field(default_factory=dict)  # the registry's stored capabilities present

    def value_of(self, name: str) -> bool | None:
        """The capability ``name`` (a registry name): False missing, None unknown."""
        cap = BY_CAPABILITY[name]
        if not cap.stored:
            return getattr(self.megatron, cap.detected.removeprefix("megatron:"))
        return bool(self.have.get(name, False))

    def __getattr__(self, name: str) -> Any:
        if name in BY_CAPABILITY:
            return self.value_of(name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def is_assumed(self, name: str) -> bool:
        return name in self.assumed

    def to_record(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("have")
        out.update({c.name: self.value_of(c.name) for c in _stored()})
        out["assumed"] = list(self.assumed)
        return out


_dataclass_init = Capabilities.__init__


def _init(self: Capabilities, have: Mapping[str, bool] | None = None, **given: Any) -> None:
    """The dataclass's own ``__init__``, with each stored capability given by its name (as
    ``dataclasses.replace`` passes them too) folded into ``have``."""
    named = {n: bool(given.pop(n)) for n in list(given) if n in BY_CAPABILITY and BY_CAPABILITY[n].stored}
    _dataclass_init(self, have={**(have or {}), **named}, **given)


Capabilities.__init__ = _init  # type: ignore[method-assign,assignment]


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



def _stored(assumed: str | None = None) -> list[Capability]:
    """The registry's capabilities of the machine's own (``assumed``: set by that entry)."""
    return [c for c in BY_CAPABILITY.values() if c.stored and assumed in (None, c.assumed)]


def _te_caps() -> list[Capability]:
    return [c for c in _stored() if c.te_minimum is not None]


def assume_none() -> dict[str, Any]:
    """What ``none`` plans for: none of the packages the guards ask about."""
    return {**{c.name: False for c in _stored()}, "te_version": None, "aiter_version": None}


def _notes_of(name: str) -> tuple[str, ...]:
    """The notes (reasons a capability is missing) that an assumed value of ``name`` makes stale."""
    if name == "te_version":
        return ("te", *(c.name for c in _te_caps()))
    return ("aiter",) if name == "aiter_version" else (name,)


def _assumed_te(item: str, value: str) -> dict[str, Any]:
    vt = version_tuple(value.strip())
    if not vt:
        raise AssumeError(f"MEGATRON_PERF_TOGGLES_ASSUME: {item!r} needs a Transformer Engine version, e.g. te=2.8")
    return {"te_version": value.strip(), **{c.name: vt >= (c.te_minimum or ()) for c in _te_caps()}}


def parse_assume(spec: str) -> dict[str, Any]:
    """``apex,te=2.8,rocm`` -> the capabilities it names, and only those (``none``: no packages).
    Which capability each entry sets is the registry's ``Capability.assumed``. Unknown names are
    an AssumeError."""
    out: dict[str, Any] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip().lower()
        if name in ("apex", "grouped_gemm") and not value:
            out.update({c.name: True for c in _stored(name)})
        elif name == "aiter" and not value:
            out["aiter_version"] = "assumed"
        elif name in ("rocm", "cuda") and not value:
            out["device"] = name
            out.update({c.name: True for c in _stored("gpu")})  # a GPU with a current torch
        elif name == "none" and not value:
            out.update(assume_none())
        elif name == "te":
            out.update(_assumed_te(item, value))
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
    stale = {note for name in overrides for note in _notes_of(name)}
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


STACK_HINT = f" (change with {STACK_VAR}, e.g. apex,te=2.10)"


def describe_stack(caps: Capabilities, hint: bool = True, fallback: bool | None = None) -> str:
    """The software a plan rests on, in words, with the variable that changes it (``hint``).
    ``fallback``: whether the plugin's torch stand-in for APEX's fused wgrad would be installed
    (``core.stock_off.fallback_installed``: never with the plugin off); default, whether it can run."""
    te = f"Transformer Engine {caps.te_version}" if caps.te_version else "no Transformer Engine"
    installed = caps.wgrad_fallback if fallback is None else fallback
    wgrad = ("APEX fused wgrad" if caps.apex_fused_wgrad else
             "no APEX (torch wgrad fallback)" if installed else "no APEX, no wgrad fallback")
    aiter = "aiter" if caps.aiter_version else "no aiter"
    family = {"cuda": "NVIDIA", "rocm": "AMD"}.get(caps.device or "", caps.device or "?")
    return f"{family}: {te}, {wgrad}, {aiter}" + (STACK_HINT if hint else "")


def megatron_facts_from_surface(surface: dict[str, Any]) -> MegatronFacts:
    """Megatron facts from a recorded surface (planning without a checkout). A rule's fact that the
    record states (a fork's delta states what differs from its base) decides that rule."""
    known = {f.name for f in fields(MegatronFacts)}
    facts = {k: v for k, v in surface.get("facts", {}).items() if k in known}
    if isinstance(facts.get("rules"), list | tuple):
        # The rules table says which releases carry each rule (found in real trees, documented
        # ones included): a rule the recorder could not detect by its phrase still binds there.
        from .rules.megatron_rules import rules_of

        table = rules_of(surface_release(surface))
        if surface.get("commit"):  # a commit between releases: what its tree showed stands; the table adds
            table = tuple(r for r in table if r in BY_ID and not BY_ID[r].phrase)  # only what no phrase detects
        recorded = sorted({*facts["rules"], *table})
        rules = [r for r in recorded if r not in BY_ID or facts.get(BY_ID[r].fact) is not False]
        rules += [r.id for r in BY_ID.values() if r.fact and facts.get(r.fact) is True and r.id not in rules]
        facts["rules"] = tuple(rules)
    return MegatronFacts(**facts)


def surface_release(surface: dict[str, Any]) -> str:
    """The release a recorded surface is of, as the rules table names it (``0.19.0``, ``main``; a
    fork recorded as a delta: its base's)."""
    name = str(surface.get("release") or surface.get("name") or "")
    return name.removeprefix("core_v") if name else str(surface.get("facts", {}).get("version") or "")
