"""Arms of a controlled toggle experiment: which toggles and settings each arm sets.

Every arm sets every design variable explicitly (toggles through their environment variables,
other settings through their Megatron flags), so nothing an arm inherits from the caller's
environment can differ between arms.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ...core.registry import BY_DEST, SETTINGS, TOGGLES, flag_of
from ...errors import PerfTogglesError

DESIGNS = ("one-at-a-time", "leave-one-out", "factorial", "headline", "candidates", "each-alone")
OTHERS = ("inherit", "off", "on")
ALL_TOGGLES = tuple(t.dest for t in TOGGLES if t.kind == "bool")  # every on/off toggle --toggles may name
# The default for a dense model: the toggles that apply to every model. A mixture-of-experts run
# (--num-experts set) adds the MoE toggles (default_toggles), so dense experiments stay as they were.
DEFAULT_TOGGLES = tuple(d for d in ALL_TOGGLES if BY_DEST[d].scope == "all")


def _num_experts(megatron_args: Sequence[str]) -> int:
    """``--num-experts N`` (or ``--num-experts=N``) among Megatron's arguments, else 0."""
    words = list(megatron_args)
    for i, word in enumerate(words):
        name, eq, value = str(word).partition("=")
        if name == "--num-experts":
            text = value if eq else (words[i + 1] if i + 1 < len(words) else "")
            return int(text) if text.isdigit() else 0
    return 0


def default_toggles(megatron_args: Sequence[str] = ()) -> tuple[str, ...]:
    """The on/off toggles that apply to the model these Megatron arguments describe."""
    args = {"num_experts": _num_experts(megatron_args)}
    return tuple(d for d in ALL_TOGGLES if BY_DEST[d].applies(args))


class DesignError(PerfTogglesError):
    """The experiment is ill-specified (unknown design, toggle or setting, or no arms)."""


@dataclass(frozen=True, slots=True)
class Vary:
    name: str  # a toggle dest or a Megatron argument dest
    values: tuple[str, ...]


    @property
    def flag(self) -> str:
        return flag_of(self.name)


@dataclass(slots=True)
class Arm:
    name: str
    toggles: dict[str, bool]  # dest -> intended value
    settings: dict[str, str] = field(default_factory=dict)  # Megatron dest -> value (from --vary)
    baseline: bool = False
    # Toggles that take no part but are pinned to one value in every arm (--others off|on).
    fixed: dict[str, bool] = field(default_factory=dict)
    # Candidate name -> what it adds to the common run: environment assignments first, then
    # Megatron arguments (--candidate).
    adds: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        toggles = {BY_DEST[d].env: "1" if v else "0" for d, v in {**self.fixed, **self.toggles}.items()}
        return {**toggles, **self.added_env()}

    def added_env(self) -> dict[str, str]:
        """The environment variables a candidate sets (e.g. an allocator or NCCL setting)."""
        return {k: v for args in self.adds.values() for k, v in split_env(args)[0].items()}

    def extra_args(self) -> list[str]:
        out: list[str] = []
        for name, value in self.settings.items():
            out += [flag_of(name), value]
        return out

    def added_args(self) -> list[str]:
        return [word for args in self.adds.values() for word in split_env(args)[1]]

    def intended(self) -> dict[str, object]:
        return {**self.toggles, **self.settings, **{candidate_key(n): shlex.join(a) for n, a in self.adds.items()}}

    def pinned(self) -> dict[str, bool]:
        """Every toggle value this arm sets: the design's toggles and the pinned others."""
        return {**self.fixed, **self.toggles}

    def signature(self) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        """What the arm's process gets (environment and extra arguments): equal means the same run."""
        return tuple(sorted(self.env().items())), (*self.extra_args(), *self.added_args())


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


def parse_toggles(text: str | None, megatron_args: Sequence[str] = ()) -> tuple[str, ...]:
    """``--toggles``; without it, the toggles that apply to the model ``megatron_args`` describe."""
    if not text:
        return default_toggles(megatron_args)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise DesignError("--toggles is empty", f"choose from: {', '.join(ALL_TOGGLES)}")
    for n in names:
        if n not in ALL_TOGGLES:
            raise DesignError(f"--toggles: unknown toggle {n!r}", f"choose from: {', '.join(ALL_TOGGLES)}")
    if len(set(names)) != len(names):
        raise DesignError("--toggles names a toggle twice")
    return names


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
    arms: list[Arm] = []
    if design == "one-at-a-time":
        base = dict.fromkeys(toggles, False)
        arms.append(Arm("all-off", base, baseline=True))
        arms += [Arm(f"only:{d}", {**base, d: True}) for d in toggles]
    elif design == "each-alone":
        arms = each_alone(toggles, rest or ())
    elif design == "headline":
        arms.append(Arm("all-off", dict.fromkeys(toggles, False), baseline=True))
        arms.append(Arm("all-on", dict.fromkeys(toggles, True)))
    elif design == "candidates":
        arms.append(Arm("baseline", {}, baseline=True))
        arms += [Arm(candidate_key(name), {}, adds={name: tuple(args)}) for name, args in (candidates or {}).items()]
    elif design == "leave-one-out":
        base = dict.fromkeys(toggles, True)
        arms.append(Arm("all-on", base, baseline=True))
        arms += [Arm(f"without:{d}", {**base, d: False}) for d in toggles]
    else:
        for settings in settings_grid:
            for combo in itertools.product((False, True), repeat=len(toggles)):
                values = dict(zip(toggles, combo, strict=True))
                arms.append(Arm(_label(values, settings), values, dict(settings)))
        arms[0].baseline = True
    if len(arms) < 2 or (not toggles and design in ("headline", "one-at-a-time", "leave-one-out", "each-alone")):
        raise DesignError(f"design {design!r} with these toggles gives {len(arms)} arm(s); nothing to compare")
    if others != "inherit":
        moe = any(BY_DEST[d].scope == "moe" for d in toggles)  # a MoE experiment pins the other MoE toggles too
        pinnable = ALL_TOGGLES if moe else DEFAULT_TOGGLES
        pinned = {d: others == "on" for d in pinnable if d not in toggles and d not in (rest or ())}
        for arm in arms:
            arm.fixed = dict(pinned)
    return arms


def baseline_of(arms: Sequence[Arm]) -> Arm:
    """The arm the others are compared with (the first, where none is marked)."""
    return next((a for a in arms if a.baseline), arms[0])
