"""The records a decision is made of: each toggle's Decision, the Plan for one command line,
and what guards read (Context) and propose (Change).

Kept apart from the engine (``resolve``), the FP4 selection (``fp4``) and the guards, so every
one of those imports these records and none imports another to reach them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import RegistryError
from ..env import EnvSettings
from ..facts import Capabilities
from ..registry import BY_CAPABILITY


@dataclass(frozen=True, slots=True)
class Decision:
    """One toggle's value, where it came from, and why: a line of the start-up table and of the record."""

    value: Any
    source: str  # cli | env | config | profile | default | guard | assumed
    reason: str

    def to_record(self) -> dict[str, Any]:
        return {"value": self.value, "source": self.source, "reason": self.reason}


@dataclass(slots=True)
class Message:
    """A warning or advice line for the start-up table."""

    level: str  # warning | advice | profile (a warning about the profile in use)
    text: str


@dataclass(slots=True)
class Plan:
    """Everything decided for one command line."""

    decisions: dict[str, Decision]
    precision: str
    log_dirs: dict[str, str]  # dest -> tagged path (only those that are set and tagged)
    messages: list[Message] = field(default_factory=list)
    wgrad_path: str = "off"  # apex | fallback | off: who computes fused weight gradients
    profile: dict[str, Any] | None = None  # the profile in use and how its environment compares (the record)
    memory: dict[str, Any] | None = None  # each decision's peak-memory change and stock's peak (memory_guard)
    # Toggles that mean nothing for this model (the MoE ones on a dense model): Megatron's own value
    # stands, the records keep it, and the tables people read leave it out.
    not_applicable: tuple[str, ...] = ()

    def values(self) -> dict[str, Any]:
        return {dest: d.value for dest, d in self.decisions.items()}

    def shown(self) -> dict[str, Decision]:
        """The decisions a table shows: those that apply to this model."""
        return {dest: d for dest, d in self.decisions.items() if dest not in self.not_applicable}


@dataclass(slots=True)
class Change:
    """What a guard wants: ``dest`` becomes ``value`` because ``reason``."""

    dest: str
    value: Any
    reason: str
    hint: str = ""
    capability: str = ""  # the capability the change rests on, if any (a name in registry.BY_CAPABILITY)
    over_cli: bool = False  # applies even over an explicit command-line value (with a warning)
    # Only moves a value nobody asked for: an explicit command-line value is kept as it is
    # (the guard resolves a conflict between two requests in favour of the one on the command line).
    yields_to_cli: bool = False
    # The explicit request (another setting's flag) this change makes room for: a later guard that
    # takes the room back must say so, or refuse.
    requested_by: str = ""

    def __post_init__(self) -> None:
        if self.capability and self.capability not in BY_CAPABILITY:
            raise RegistryError(f"a guard of {self.dest!r} rests on {self.capability!r}, "
                                "which the registry does not declare (registry.CAPABILITY_RECORDS)")


@dataclass(slots=True)
class Context:
    """What a guard may look at: parsed args, the decisions so far, capabilities, environment,
    and what is known of the checkpoint ``--load`` will resume from."""

    args: Mapping[str, Any]
    values: Mapping[str, Any]
    caps: Capabilities
    env: EnvSettings
    checkpoint: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)  # dest -> where its current value came from



Check = Callable[[Context], Iterator[Change]]  # a guard's test: the changes it wants, given a Context
