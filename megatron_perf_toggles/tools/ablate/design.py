"""Stage 2 of an experiment, the spec to its arms (the design): which toggles and settings each arm sets.

Every arm sets every design variable explicitly (toggles through their environment variables,
other settings through their Megatron flags), so nothing an arm inherits from the caller's
environment can differ between arms. An arm is data: what its run gets (its environment and the
Megatron words it sets) is worked out once, when it is made, and read by every later stage.

A toggle a guard turns off for this model takes part in no arm: the checked spec names them
(``ExperimentSpec.left_out``, stage 1).

:func:`designed` is the stage; :func:`expand` makes a design's arms from its toggles (``tune``
makes its phases' arms with it).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.registry import BY_DEST, SETTINGS, TOGGLES, flag_of
from .spec import ALL_TOGGLES, DEFAULT_TOGGLES, DesignError, ExperimentSpec

# the toggle lists and the error of a design are the spec's (stage 1): named here too, where a design is read
__all__ = ["ALL_TOGGLES", "DEFAULT_TOGGLES", "DesignError"]

DESIGNS = ("one-at-a-time", "leave-one-out", "factorial", "headline", "candidates", "each-alone")
OTHERS = ("inherit", "off", "on")


@dataclass(frozen=True, slots=True)
class Vary:
    name: str  # a toggle dest or a Megatron argument dest
    values: tuple[str, ...]

    @property
    def flag(self) -> str:
        return flag_of(self.name)


@dataclass(frozen=True, slots=True)
class Arm:
    """One arm of a design. ``toggles``: dest -> intended value; ``settings``: Megatron dest ->
    value (from --vary); ``fixed``: toggles that take no part but are pinned to one value in every
    arm (--others off|on); ``adds``: candidate name -> what it adds to the common run, environment
    assignments first, then Megatron arguments (--candidate).

    The rest is what the arm's run gets, worked out once: ``env`` (its plugin variables and a
    candidate's), ``extra_args`` (its settings' flags), ``added_env`` and ``added_args`` (a
    candidate's), ``intended`` (every variable it sets on purpose), ``pinned`` (every toggle value
    it sets) and ``signature`` (what its process gets: equal means the same run)."""

    name: str
    toggles: dict[str, bool]
    settings: dict[str, str] = field(default_factory=dict)
    baseline: bool = False
    fixed: dict[str, bool] = field(default_factory=dict)
    adds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    env: dict[str, str] = field(init=False, compare=False, repr=False)
    added_env: dict[str, str] = field(init=False, compare=False, repr=False)
    extra_args: list[str] = field(init=False, compare=False, repr=False)
    added_args: list[str] = field(init=False, compare=False, repr=False)
    intended: dict[str, object] = field(init=False, compare=False, repr=False)
    pinned: dict[str, bool] = field(init=False, compare=False, repr=False)
    signature: tuple[tuple[tuple[str, str], ...], tuple[str, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        pinned = {**self.fixed, **self.toggles}
        added_env = {k: v for args in self.adds.values() for k, v in split_env(args)[0].items()}
        env = {**{BY_DEST[d].env: "1" if v else "0" for d, v in pinned.items()}, **added_env}
        extra = [word for name, value in self.settings.items() for word in (flag_of(name), value)]
        added = [word for args in self.adds.values() for word in split_env(args)[1]]
        derived = {"pinned": pinned, "added_env": added_env, "env": env, "extra_args": extra, "added_args": added,
                   "intended": {**self.toggles, **self.settings,
                                **{candidate_key(n): shlex.join(a) for n, a in self.adds.items()}},
                   "signature": (tuple(sorted(env.items())), (*extra, *added))}
        for name, value in derived.items():
            object.__setattr__(self, name, value)


def candidate_key(name: str) -> str:
    """How a candidate appears among an arm's intended variables (never a Megatron dest)."""
    return f"+{name}"


def is_candidate_key(name: str) -> bool:
    return name.startswith("+")


# Upper case only: a lower-case ``ddp_bucket_size=8e7`` is a flag with its ``--`` missing, not an
# environment variable, and must be refused rather than become an arm that changes nothing.
_ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=")
# Variables the runner or the launcher sets for each run: a candidate that set them would move an
# arm to another GPU or rank, a confound rather than a setting.
RUNNER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "CUDA_VISIBLE_DEVICES")


def split_env(words: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """A candidate's words: the leading ``NAME=value`` environment assignments, and the rest (its
    Megatron arguments). Only leading words count, so a flag's value may contain '='."""
    env: dict[str, str] = {}
    for i, word in enumerate(words):
        if not _ENV_WORD.match(word):
            return env, list(words[i:])
        name, _, value = word.partition("=")
        env[name] = value
    return env, []


def _refused_env(name: str) -> str | None:
    """Why a candidate may not set ``name`` (None: it may)."""
    if name in {t.env for t in TOGGLES} or name in {s.env for s in SETTINGS} or name.startswith(
            "MEGATRON_PERF_TOGGLES"):
        return "is this plugin's own setting: vary toggles with --toggles and a design, not as a candidate"
    if name in RUNNER_ENV:
        return "is set by the runner and the launcher for each run, not by a candidate"
    return None


def parse_vary(items: list[str] | None, known_args: set[str] | None = None) -> list[Vary]:
    """``NAME=V1,V2``. NAME is a toggle dest or, if ``known_args`` is given, one of those dests."""
    out: list[Vary] = []
    for item in items or []:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_").lstrip("_")
        vals = tuple(v.strip() for v in values.split(",") if v.strip())
        if not sep or not name or len(vals) < 2:
            raise DesignError(f"--vary {item!r}: expected NAME=V1,V2[,...] with at least two values")
        if name in BY_DEST and BY_DEST[name].kind == "bool":
            raise DesignError(f"--vary {name}: on/off toggles take part through --toggles, not --vary")
        if name not in BY_DEST and known_args is not None and name not in known_args:
            raise DesignError(f"--vary {item!r}: unknown name {name!r}: neither a toggle nor a Megatron argument",
                              f"toggles: {', '.join(ALL_TOGGLES)}")
        if len(set(vals)) != len(vals):
            raise DesignError(f"--vary {item!r}: a value is listed twice")
        out.append(Vary(name, vals))
    return out


def parse_candidates(items: list[str] | None, known_flags: set[str] | None = None) -> dict[str, tuple[str, ...]]:
    """``NAME='[VAR=value ...] [--flag [value] ...]'``: what a candidate arm adds to the common run,
    environment assignments first (an allocator, NCCL or Transformer Engine setting), then Megatron
    arguments. Each flag is checked against ``known_flags`` (Megatron's option strings), when given."""
    out: dict[str, tuple[str, ...]] = {}
    for item in items or []:
        name, sep, text = item.partition("=")
        name = name.strip()
        try:
            words = tuple(shlex.split(text))
        except ValueError as error:
            raise DesignError(f"--candidate {item!r}: {error}") from None
        if not sep or not name or not words:
            raise DesignError(f"--candidate {item!r}: expected NAME='[VAR=value ...] --flag [value] ...'")
        if not all(ch.isalnum() or ch in "-_." for ch in name):
            raise DesignError(f"--candidate {item!r}: a name of letters, digits, '-', '_' and '.' only")
        if name in out:
            raise DesignError(f"--candidate {name!r} is given twice")
        env, args = split_env(words)
        if args and not args[0].startswith("--"):
            raise DesignError(f"--candidate {item!r}: after any VAR=value words, the arguments must start "
                              f"with a --flag, not {args[0]!r}")
        if len(env) < len(words) - len(args):
            raise DesignError(f"--candidate {item!r}: an environment variable is set twice")
        for var in env:
            why = _refused_env(var)
            if why:
                raise DesignError(f"--candidate {item!r}: {var} {why}")
        flags = [w.split("=", 1)[0] for w in args if w.startswith("--")]
        unknown = [f for f in flags if known_flags is not None and f not in known_flags]
        if unknown:
            raise DesignError(f"--candidate {item!r}: not a Megatron argument: {', '.join(unknown)}")
        out[name] = words
    return out


def _label(toggles: dict[str, bool], settings: dict[str, str]) -> str:
    on = [d for d, v in toggles.items() if v]
    parts = ["+".join(on) if on else "all-off"]
    parts += [f"{k}={v}" for k, v in settings.items()]
    return ",".join(parts)


def each_alone(toggles: tuple[str, ...], rest: tuple[str, ...]) -> list[Arm]:
    """Stock (every toggle off), each of ``toggles`` alone, and the plugin defaults (every toggle
    of ``toggles`` and ``rest`` at its default): the headline and each toggle's own share come
    from the same blocks. Every arm sets all of them, so the defaults arm's change is intended."""
    base = dict.fromkeys((*toggles, *rest), False)
    arms = [Arm("all-off", base, baseline=True), *(Arm(f"only:{d}", {**base, d: True}) for d in toggles)]
    return [*arms, Arm("defaults", {d: BY_DEST[d].default is True for d in base})]


def _check_design(design: str, others: str, candidates: Mapping[str, tuple[str, ...]] | None,
                  vary: list[Vary]) -> None:
    if design not in DESIGNS:
        raise DesignError(f"unknown design {design!r}", f"choose from: {', '.join(DESIGNS)}")
    if others not in OTHERS:
        raise DesignError(f"--others {others!r}: choose from {', '.join(OTHERS)}")
    if design == "candidates" and not candidates:
        raise DesignError("--design candidates needs --candidate NAME='ARGS' (at least one)")
    if design != "candidates" and candidates:
        raise DesignError("--candidate needs --design candidates")
    if design == "candidates" and vary:
        raise DesignError("--vary needs --design factorial")


def _arms(design: str, toggles: tuple[str, ...], settings_grid: list[dict[str, str]],
          candidates: Mapping[str, tuple[str, ...]] | None, rest: tuple[str, ...]) -> list[Arm]:
    """The design's arms, baseline first, before any toggle is pinned."""
    if design == "one-at-a-time":
        base = dict.fromkeys(toggles, False)
        return [Arm("all-off", base, baseline=True), *(Arm(f"only:{d}", {**base, d: True}) for d in toggles)]
    if design == "each-alone":
        return each_alone(toggles, rest)
    if design == "headline":
        return [Arm("all-off", dict.fromkeys(toggles, False), baseline=True), Arm("all-on", dict.fromkeys(toggles, True))]
    if design == "candidates":
        return [Arm("baseline", {}, baseline=True),
                *(Arm(candidate_key(name), {}, adds={name: tuple(args)}) for name, args in (candidates or {}).items())]
    if design == "leave-one-out":
        base = dict.fromkeys(toggles, True)
        return [Arm("all-on", base, baseline=True), *(Arm(f"without:{d}", {**base, d: False}) for d in toggles)]
    arms = [Arm(_label(values, settings), values, dict(settings))
            for settings in settings_grid
            for values in (dict(zip(toggles, combo, strict=True))
                           for combo in itertools.product((False, True), repeat=len(toggles)))]
    return [dataclasses.replace(arms[0], baseline=True), *arms[1:]]


def expand(design: str, toggles: tuple[str, ...], vary: list[Vary], others: str = "inherit",
           candidates: Mapping[str, tuple[str, ...]] | None = None, rest: tuple[str, ...] | None = None
           ) -> list[Arm]:
    """The design's arms, baseline first. ``others``: what the toggles outside ``toggles`` get in
    every arm: ``inherit`` (the caller's environment, else the plugin default), ``off`` or ``on``.
    A ``candidates`` design takes no toggles: the baseline is the command as given, and each
    candidate arm adds its arguments to it. ``each-alone``: ``rest`` are the other toggles its
    defaults arm turns on (default: every on/off toggle not in ``toggles``); any toggle in neither
    is pinned off in every arm."""
    if design == "each-alone":
        if others == "on":
            raise DesignError("--others on: the each-alone design keeps the others off but in its defaults arm")
        others = "off"
        rest = tuple(d for d in DEFAULT_TOGGLES if d not in toggles) if rest is None else rest
    _check_design(design, others, candidates, vary)
    if design == "candidates":
        toggles = ()
    settings_grid = [dict(zip([v.name for v in vary], combo, strict=True))
                     for combo in itertools.product(*[v.values for v in vary])] or [{}]
    if design != "factorial" and len(settings_grid) > 1:
        raise DesignError(f"--vary needs --design factorial (a {design} design varies one toggle at a time)")
    arms = _arms(design, toggles, settings_grid, candidates, rest or ())
    if len(arms) < 2 or (not toggles and design in ("headline", "one-at-a-time", "leave-one-out", "each-alone")):
        raise DesignError(f"design {design!r} with these toggles gives {len(arms)} arm(s); nothing to compare")
    if others == "inherit":
        return arms
    moe = any(BY_DEST[d].scope == "moe" for d in toggles)  # a MoE experiment pins the other MoE toggles too
    pinnable = ALL_TOGGLES if moe else DEFAULT_TOGGLES
    pinned = {d: others == "on" for d in pinnable if d not in toggles and d not in (rest or ())}
    return pinning(arms, pinned)


def pinning(arms: Sequence[Arm], pins: Mapping[str, bool]) -> list[Arm]:
    """``arms`` with ``pins`` as the toggles every one of them sets besides its own (its ``fixed``)."""
    return [dataclasses.replace(arm, fixed=dict(pins)) for arm in arms]


def baseline_of(arms: Sequence[Arm]) -> Arm:
    """The arm the others are compared with (the first, where none is marked)."""
    return next((a for a in arms if a.baseline), arms[0])


def probe_arms(arms: Sequence[Arm]) -> dict[str, list[Arm]]:
    """For each design variable, the baseline with that variable alone changed, once per other value:
    the confound check learns from their dry runs what each variable derives.

    Where the design already has such an arm (one-at-a-time, leave-one-out and factorial all do),
    the probe is that same run and costs no extra dry run. A candidate's arm is its own probe:
    whatever its arguments derive is part of the candidate.
    """
    base = baseline_of(arms)
    values: dict[str, set[Any]] = {}
    probes: dict[str, list[Arm]] = {}
    for arm in arms:
        for name, value in arm.intended.items():
            if is_candidate_key(name):
                probes.setdefault(name, []).append(arm)
            else:
                values.setdefault(name, set()).add(value)
    for name, seen in values.items():
        for value in sorted(seen - {base.intended.get(name)}, key=str):
            if isinstance(value, bool):  # a toggle; settings from --vary are strings
                probe = Arm(f"probe:{name}={value}", {**base.toggles, name: value}, dict(base.settings),
                            fixed=dict(base.fixed))
            else:
                probe = Arm(f"probe:{name}={value}", dict(base.toggles), {**base.settings, name: str(value)},
                            fixed=dict(base.fixed))
            same = next((a for a in arms if a.signature == probe.signature), None)
            probes.setdefault(name, []).append(same or probe)
    return probes


@dataclass(frozen=True, slots=True)
class Design:
    """The stage's value: a design's name, its arms (baseline first) and baseline, the single-change
    probes the confound check dry-runs besides, and what the toggles not taking part get."""

    name: str
    arms: list[Arm]
    baseline: Arm
    probes: dict[str, list[Arm]]
    others: str = "inherit"


def design_of(name: str, arms: Sequence[Arm], others: str = "inherit") -> Design:
    """``arms`` as a design named ``name`` (tune's phases make their arms themselves)."""
    return Design(name, list(arms), baseline_of(arms), probe_arms(arms), others)


# --- the stage ------------------------------------------------------------------------------------


def designed(spec: ExperimentSpec) -> Design:
    """The stage: the design the spec's options ask for, its settings varied and its candidates
    checked first (typos before any run). The toggles taking part are those the spec names (or the
    model's defaults) less those a guard turns off for this model (``spec.left_out``): such a
    toggle could be on in no arm."""
    dests, flags = known_args()
    vary, candidates = parse_vary(spec.vary, dests), parse_candidates(spec.candidate, flags)
    toggles = tuple(d for d in spec.named_toggles if d not in spec.left_out)
    # each-alone's defaults arm turns on the toggles not named too, less those a guard turns off
    rest = (tuple(d for d in spec.model_toggles if d not in toggles and d not in spec.left_out)
            if spec.design == "each-alone" else None)
    arms = expand(spec.design, toggles, vary, spec.others, candidates, rest=rest)
    return design_of(spec.design, arms, spec.others)


def known_args() -> tuple[set[str] | None, set[str] | None]:
    """Megatron's argument dests and flags (``--no-...`` switches store into a dest of another
    name), from the recorded main surface: catches typos before any run."""
    from ...runtime import surface_replay as replay

    try:
        actions = replay.load_surface("main")["actions"]
    except Exception:  # noqa: BLE001 - without the record, Megatron's parser reports unknown flags
        return None, None
    return {a["dest"] for a in actions}, {f for a in actions for f in a["flags"]}
