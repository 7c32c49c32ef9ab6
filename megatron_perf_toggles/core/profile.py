"""Profiles: a reviewed, shareable file of toggle values with the measurements behind them, pure.

A profile (``MEGATRON_PERF_TOGGLES_PROFILE=path``) is indented JSON that people read in review and
commit next to their launch scripts: for each toggle it lists, the chosen value and the evidence
(the speedup of that value over the other one, with its interval and verdict, and the loss check),
and once for the file, what it was measured on (Megatron, Transformer Engine, torch, GPU, world
size), when, and the command measured. ``tune`` writes them through :func:`render_profile`; the
plugin reads them through :func:`parse_profile`. This module takes the file's *text* (reading it is
the runtime's job) and knows nothing of torch or Megatron.

Validation is strict where a mistake would silently change a run: the format marker, the schema
version, toggle names, value kinds and every key (a misspelt ``toggle`` would otherwise apply
nothing). Each problem is one :class:`ProfileError` line naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProfileError, did_you_mean
from .facts import version_tuple
from .registry import BY_DEST, format_value

FORMAT = "megatron-perf-toggles/profile"
SCHEMA = 1
PROFILE_ENV = "MEGATRON_PERF_TOGGLES_PROFILE"
ENVIRONMENT_WORDS = {"megatron": "Megatron", "transformer_engine": "Transformer Engine", "torch": "torch",
                     "gpu": "GPU", "world_size": "world size"}
TOP_KEYS = ("format", "schema", "created", "made_by", "command", "environment", "toggles", "confirmation", "notes")
CHOICE_KEYS = ("value", "evidence", "note")
EVIDENCE_NUMBERS = ("speedup", "low", "high", "confidence", "loss_ratio", "peak_memory_delta_mb")
EVIDENCE_KEYS = ("against", *EVIDENCE_NUMBERS, "verdict", "blocks", "design", "loss_verdict", "rule")
# read and dropped: an earlier version's loss flag (a noise band), which the loss test's verdict replaced
LEGACY_EVIDENCE_KEYS = ("loss_within_noise",)
CONFIRMATION_NUMBERS = ("speedup", "low", "high", "confidence")
CONFIRMATION_KEYS = (*CONFIRMATION_NUMBERS, "verdict", "blocks", "outcome")


@dataclass(frozen=True, slots=True)
class Evidence:
    """Why a value was chosen: ``speedup`` is ms/iter with ``against`` over ms/iter with the chosen
    value (above 1: the chosen value is faster), with its interval and the verdict on it."""

    against: bool | str
    speedup: float | None = None
    low: float | None = None
    high: float | None = None
    verdict: str = ""
    confidence: float | None = None
    blocks: int | None = None
    design: str = ""  # the ablate design the numbers come from, e.g. "leave-one-out"
    loss_ratio: float | None = None  # loss with the chosen value / loss with ``against``
    # the loss test of the chosen value against ``against`` over the blocks (equivalent, different or
    # inconclusive, with its margin); "" where not measured
    loss_verdict: str = ""
    rule: str = ""  # the decision rule that picked the value, in words
    # measured peak allocated MB with the chosen value minus with ``against`` (per GPU; None: not measured)
    peak_memory_delta_mb: float | None = None

    def brief(self) -> str:
        """``x1.036 [1.025, 1.047] vs off, faster``: what a decision's reason quotes."""
        if self.speedup is None:
            return f"vs {format_value(self.against)}: {self.verdict or 'no measurement'}"
        interval = f" [{self.low:.3f}, {self.high:.3f}]" if self.low is not None and self.high is not None else ""
        verdict = f", {self.verdict}" if self.verdict else ""
        return f"x{self.speedup:.3f}{interval} vs {format_value(self.against)}{verdict}"


@dataclass(frozen=True, slots=True)
class Confirmation:
    """The chosen values, all together, against the defaults: each toggle's evidence is one
    comparison, and the set they make was never run until this check (``speedup``: ms/iter with
    the defaults over ms/iter with the chosen values). ``outcome`` says what tune did with it."""

    speedup: float | None = None
    low: float | None = None
    high: float | None = None
    confidence: float | None = None
    verdict: str = ""
    blocks: int | None = None
    outcome: str = ""

    def to_record(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k in CONFIRMATION_KEYS
                if (v := getattr(self, k)) not in (None, "")}


@dataclass(frozen=True, slots=True)
class Choice:
    value: bool | str
    evidence: Evidence | None = None
    note: str = ""


@dataclass(frozen=True, slots=True)
class Environment:
    """What a profile was measured on, or what a run has. ``None``: not recorded / not known."""

    megatron: str | None = None
    transformer_engine: str | None = None
    torch: str | None = None
    gpu: str | None = None
    world_size: int | None = None

    def to_record(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ENVIRONMENT_WORDS}


@dataclass(frozen=True, slots=True)
class Profile:
    toggles: dict[str, Choice]
    environment: Environment = field(default_factory=Environment)
    created: str = ""  # ISO 8601 date and time of the measurement
    made_by: str = ""  # e.g. "megatron-perf-toggles tune 0.3.0"
    command: str = ""  # the command line measured
    notes: str = ""
    confirmation: Confirmation | None = None  # absent where the chosen values are the defaults
    source: str = ""  # where it was read from (not written): decisions' reasons name it

    def reason(self, dest: str) -> str:
        """A decision's reason: the file and, briefly, the evidence."""
        choice = self.toggles[dest]
        where = f"profile {self.source}" if self.source else "profile"
        if choice.evidence is None:
            return f"{where} (no measurement recorded)"
        return f"{where}: {choice.evidence.brief()}"


# --- reading -------------------------------------------------------------------------------------


def _fail(source: str, what: str, hint: str | None = None) -> ProfileError:
    return ProfileError(f"{PROFILE_ENV}={source}: {what}",
                        hint or "fix the file or unset the variable; a profile is described in docs/profiles-and-tune.md")


def _keys(source: str, where: str, data: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _fail(source, f"{where} must be a JSON object, not {type(data).__name__}")
    for key in data:
        if key not in allowed:
            hint = f"{did_you_mean(str(key), allowed)}accepted: {', '.join(allowed)}"
            raise _fail(source, f"{where}: unknown key {key!r}", hint)
    return data


def _typed(source: str, where: str, value: Any, kinds: tuple[type, ...], words: str) -> Any:
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise _fail(source, f"{where} is {json.dumps(value)}, expected {words}")
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(source, f"{where} is {value}, expected a finite number")
    return value


def _value(source: str, dest: str, raw: Any, where: str) -> bool | str:
    toggle = BY_DEST[dest]
    if toggle.kind == "bool":
        if not isinstance(raw, bool):
            raise _fail(source, f"{where} is {json.dumps(raw)}, expected true or false")
        return raw
    if raw not in toggle.choices:
        raise _fail(source, f"{where} is {json.dumps(raw)}, expected one of {', '.join(map(json.dumps, toggle.choices))}")
    return str(raw)


def _evidence(source: str, dest: str, raw: Any) -> Evidence | None:
    if raw is None:
        return None
    where = f"toggles.{dest}.evidence"
    data = _keys(source, where, raw, (*EVIDENCE_KEYS, *LEGACY_EVIDENCE_KEYS))
    if "against" not in data:
        raise _fail(source, f"{where} has no 'against' (the value the chosen one was measured against)")
    numbers = {k: _typed(source, f"{where}.{k}", data.get(k), (int, float), "a number") for k in EVIDENCE_NUMBERS}
    return Evidence(
        against=_value(source, dest, data["against"], f"{where}.against"), **numbers,
        verdict=_typed(source, f"{where}.verdict", data.get("verdict"), (str,), "text") or "",
        blocks=_typed(source, f"{where}.blocks", data.get("blocks"), (int,), "a whole number"),
        design=_typed(source, f"{where}.design", data.get("design"), (str,), "text") or "",
        loss_verdict=_typed(source, f"{where}.loss_verdict", data.get("loss_verdict"), (str,), "text") or "",
        rule=_typed(source, f"{where}.rule", data.get("rule"), (str,), "text") or "",
    )


def _check_interval(source: str, where: str, low: float | None, high: float | None) -> None:
    if low is not None and high is not None and low > high:
        raise _fail(source, f"{where}.low {low} is above {where}.high {high}", "an interval runs from low to high")


def _choice(source: str, dest: str, raw: Any) -> Choice:
    if dest not in BY_DEST:
        raise _fail(source, f"unknown toggle {dest!r}",
                    did_you_mean(dest, list(BY_DEST)).rstrip() or f"toggles: {', '.join(BY_DEST)}")
    data = _keys(source, f"toggles.{dest}", raw, CHOICE_KEYS)
    if "value" not in data:
        raise _fail(source, f"toggles.{dest} has no 'value'")
    value = _value(source, dest, data["value"], f"toggles.{dest}.value")
    evidence = _evidence(source, dest, data.get("evidence"))
    if evidence is not None:
        # Evidence compares the value with the other one: "against" the value itself is a slip
        # that would quote a measurement of nothing.
        if evidence.against == value:
            raise _fail(source, f"toggles.{dest}.evidence.against is the chosen value "
                        f"({json.dumps(value)}): it must be the value it was measured against")
        _check_interval(source, f"toggles.{dest}.evidence", evidence.low, evidence.high)
    return Choice(value, evidence, _typed(source, f"toggles.{dest}.note", data.get("note"), (str,), "text") or "")


def _environment(source: str, raw: Any) -> Environment:
    data = _keys(source, "environment", raw, tuple(ENVIRONMENT_WORDS))
    texts = {k: _typed(source, f"environment.{k}", data.get(k), (str,), "text or null")
             for k in ENVIRONMENT_WORDS if k != "world_size"}
    world = _typed(source, "environment.world_size", data.get("world_size"), (int,), "a whole number or null")
    if world is not None and world < 1:
        raise _fail(source, f"environment.world_size is {world}, expected 1 or more")
    return Environment(**texts, world_size=world)


def _confirmation(source: str, raw: Any) -> Confirmation | None:
    if raw is None:
        return None
    data = _keys(source, "confirmation", raw, CONFIRMATION_KEYS)
    numbers: dict[str, float | None] = {
        k: _typed(source, f"confirmation.{k}", data.get(k), (int, float), "a number") for k in CONFIRMATION_NUMBERS}
    _check_interval(source, "confirmation", numbers["low"], numbers["high"])

    def text(key: str) -> str:
        return _typed(source, f"confirmation.{key}", data.get(key), (str,), "text") or ""

    return Confirmation(**numbers, verdict=text("verdict"), outcome=text("outcome"),
                        blocks=_typed(source, "confirmation.blocks", data.get("blocks"), (int,), "a whole number"))


def parse_profile(text: str, source: str = "") -> Profile:
    """The profile in ``text`` (the file's content; ``source`` names it in reasons and errors), or
    one ProfileError line saying what is wrong."""
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # JSON keeps the last of two equal keys silently: in a reviewed file, the reviewer may
        # have read the first one.
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise _fail(source, f"the key {key!r} appears twice in one object", "keep one of them")
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as error:
        raise _fail(source, f"not valid JSON ({error})") from None
    except RecursionError:
        raise _fail(source, "not a profile: its JSON is nested too deeply to read") from None
    data = _keys(source, "the file", data, TOP_KEYS)
    if data.get("format") != FORMAT:
        raise _fail(source, f"format is {json.dumps(data.get('format'))}, expected {json.dumps(FORMAT)}",
                    "is this a megatron-perf-toggles profile? tune writes one as OUT/profile.json")
    if type(data.get("schema")) is not int or data.get("schema") != SCHEMA:  # not true, not 1.0
        raise _fail(source, f"schema {json.dumps(data.get('schema'))} is not one this version reads ({SCHEMA})",
                    "write it again with this version's tune, or upgrade megatron-perf-toggles")
    toggles = data.get("toggles")
    if not isinstance(toggles, dict):
        raise _fail(source, "'toggles' must be a JSON object of toggle name -> {\"value\": ...}")
    texts = {k: _typed(source, k, data.get(k), (str,), "text") or "" for k in ("created", "made_by", "command", "notes")}
    return Profile(toggles={dest: _choice(source, dest, raw) for dest, raw in toggles.items()},
                   environment=_environment(source, data.get("environment", {})),
                   confirmation=_confirmation(source, data.get("confirmation")), source=source, **texts)


# --- writing -------------------------------------------------------------------------------------


def _evidence_record(evidence: Evidence) -> dict[str, Any]:
    out: dict[str, Any] = {"against": evidence.against}
    for key in EVIDENCE_KEYS[1:]:
        value = getattr(evidence, key)
        if value not in (None, ""):
            out[key] = round(value, 6) if isinstance(value, float) else value
    return out


def profile_record(profile: Profile) -> dict[str, Any]:
    """The profile as JSON data, in the order people read it."""
    toggles: dict[str, Any] = {}
    for dest, choice in profile.toggles.items():
        entry: dict[str, Any] = {"value": choice.value}
        if choice.evidence is not None:
            entry["evidence"] = _evidence_record(choice.evidence)
        if choice.note:
            entry["note"] = choice.note
        toggles[dest] = entry
    out: dict[str, Any] = {"format": FORMAT, "schema": SCHEMA, "created": profile.created, "made_by": profile.made_by,
                           "command": profile.command, "environment": profile.environment.to_record(),
                           "toggles": toggles}
    if profile.confirmation is not None:
        out["confirmation"] = profile.confirmation.to_record()
    if profile.notes:
        out["notes"] = profile.notes
    return out


def render_profile(profile: Profile) -> str:
    """The file's text: indented JSON that reads well in review and parses back to ``profile``."""
    return json.dumps(profile_record(profile), indent=2) + "\n"


# --- comparing with the run at hand ----------------------------------------------------------------


def _same(key: str, made: Any, here: Any) -> bool:
    if key == "world_size":
        return made == here
    if key == "gpu":
        a, b = str(made).lower().split(), str(here).lower().split()
        return a == b or set(a) <= set(b) or set(b) <= set(a)  # "H200" names "NVIDIA H200"
    va, vb = (version_tuple(str(v).split("+", 1)[0]) for v in (made, here))
    if va and vb:
        n = min(len(va), len(vb))  # "2.20" was made for any 2.20.x; local tags (+cu128) do not count
        return va[:n] == vb[:n]
    return str(made) == str(here)


@dataclass(frozen=True, slots=True)
class EnvironmentCheck:
    """The profile's environment against the run's: what differs, and what could not be checked."""

    mismatches: dict[str, tuple[Any, Any]]  # key -> (profile's, this run's)
    unchecked: dict[str, str]  # key -> why this run's value is not known at plan time

    def line(self, profile: Profile) -> str | None:
        """The one ``profile:`` line for the start-up table, or None where nothing is worth saying."""
        if not self.mismatches and not self.unchecked:
            return None
        where = profile.source or "the profile"
        parts: list[str] = []
        if self.mismatches:
            diff = "; ".join(f"{ENVIRONMENT_WORDS[k]} {made} there, {here if here is not None else 'none'} here"
                             for k, (made, here) in self.mismatches.items())
            parts.append(f"{where} was measured elsewhere ({diff}): its values still apply, but its "
                         "speedups may not hold here; re-run tune on this setup to check")
        if self.unchecked:
            why = "; ".join(f"{ENVIRONMENT_WORDS[k]} ({w})" for k, w in self.unchecked.items())
            parts.append(f"{'' if self.mismatches else where + ': '}not checked, unknown at plan time: {why}")
        return "; ".join(parts)

    def to_record(self) -> dict[str, Any]:
        return {"mismatches": {k: {"profile": m, "here": h} for k, (m, h) in self.mismatches.items()},
                "unchecked": dict(self.unchecked)}


@dataclass(frozen=True, slots=True)
class Observed:
    """This run's environment as far as it is known when the toggles are decided, and for each fact
    that is not (a CPU dry run has no GPU; ``explain`` plans for no particular world), why not."""

    environment: Environment = field(default_factory=Environment)
    unknown: dict[str, str] = field(default_factory=dict)


def profile_in_use(profile: Profile, observed: Observed | None) -> tuple[dict[str, Any], str | None]:
    """The provenance record's ``profile`` section and the one ``profile:`` line (or None)."""
    if observed is None:
        observed = Observed(unknown={k: "not given to the planner" for k in ENVIRONMENT_WORDS})
    check = check_environment(profile.environment, observed.environment, observed.unknown)
    record = {"path": profile.source, "created": profile.created, "made_by": profile.made_by,
              "command": profile.command, "measured_on": profile.environment.to_record(),
              "here": {k: (None if k in observed.unknown else v) for k, v in observed.environment.to_record().items()},
              **check.to_record()}
    return record, check.line(profile)


def check_environment(made: Environment, here: Environment, unknown: Mapping[str, str]) -> EnvironmentCheck:
    """Compare each fact the profile recorded with this run's; a fact of this run listed in
    ``unknown`` (with why) is reported as unchecked, never as a mismatch."""
    mismatches: dict[str, tuple[Any, Any]] = {}
    unchecked: dict[str, str] = {}
    for key in ENVIRONMENT_WORDS:
        theirs = getattr(made, key)
        if theirs is None:
            continue  # the profile did not record it: nothing to compare
        if key in unknown:
            unchecked[key] = unknown[key]
            continue
        ours = getattr(here, key)
        if ours is None or not _same(key, theirs, ours):
            mismatches[key] = (theirs, ours)
    return EnvironmentCheck(mismatches, unchecked)
