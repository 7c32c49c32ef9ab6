"""One experiment's seeds from several ``ablate --out`` directories, pooled into one result.

Showing equivalence within +-0.5 % takes more seeds than one GPU session runs, so an experiment is
continued across sessions, each on a fresh machine running new seeds (a later ``--block-seeds``).
Each session's ``results.json`` is a *part*; the answer must come from every seed so far. Pooling
is sound because the pairs never cross a part: each seed's arms ran in one part, on one card, so
what a card or a software stack does to every arm alike cancels within the seed's difference.

This module reads the parts, refuses what is not one experiment (one line, naming the first
difference): other arms or toggle variables, another Megatron command line apart from the words
each run or machine sets its own (the seed, the run's output directories, where a file lies), a
seed in two parts, another common start. Then it builds the pooled result: every run, its block
renumbered after the parts before it, with each part's seeds and where it ran. A pooled result is
itself a part: its own parts come back out of it, so the next session's part pools onto it.
reanalyse.py runs the loss test on it and on each part, and writes the report.

Reading ``results.json`` alone (each run's per-iteration losses), never the logs: a part comes
from another machine, whose paths are not here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runs import arm_paths
from ..spec import DesignError

RESULTS = "results.json"
SAME_HINT = "pool only the results of one ablate command, each session run with a later --block-seeds"
REQUIRED = ("commands", "rows", "runs", "blocks_run")
ENTRY = "megatron_perf_toggles.run"  # the module every arm's command launches, between the launcher and the script


@dataclass(frozen=True)
class Part:
    """One session's results (or one part of a pooled result): its seeds and where it ran."""

    source: str  # as given on the command line (a pooled result's part: as it was given then)
    result: Mapping[str, Any]
    seeds: tuple[int, ...]
    where: dict[str, Any] = field(default_factory=dict)
    within: str | None = None  # the pooled result it was read from, if any

    @property
    def label(self) -> str:
        """The part as an error line names it: its source, and the pooled result holding it."""
        return self.source if self.within is None else f"{self.source} (in {self.within})"


# --- reading the parts ---------------------------------------------------------------------------


def results_file(given: str) -> Path:
    """The results.json a part names: the file itself, or the one in an ablate --out directory."""
    path = Path(given)
    return path / RESULTS if path.is_dir() else path


def read(given: str) -> dict[str, Any]:
    """A part's results, checked to be an ablate results.json with seeded blocks."""
    path = results_file(given)
    if not path.is_file():
        raise DesignError(f"{given}: no such file or directory" if not Path(given).exists()
                          else f"{given}: no {RESULTS} in it", "give an ablate --out directory or its results.json")
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DesignError(f"{path}: not readable JSON ({error})", "give an ablate --out directory") from None
    missing = [k for k in REQUIRED if not isinstance(result, dict) or k not in result]
    if missing:
        raise DesignError(f"{path} is not an ablate results.json (no {missing[0]!r})",
                          "give the --out directory of an ablate run")
    if not result.get("block_seeds"):
        raise DesignError(f"{given}: its blocks repeat one seed (no --block-seeds): there are no seeds to pool",
                          "run each session with --block-seeds")
    return result


def where(result: Mapping[str, Any]) -> dict[str, Any]:
    """Where a part ran: the GPU (its name where recorded, else its memory), Megatron, TE, torch, CUDA."""
    versions = result.get("versions") or {}
    caps = versions.get("capabilities") or {}
    return {"gpu": versions.get("gpu") or caps.get("gpu_name"), "gpu_memory_mb": caps.get("gpu_memory_mb"),
            "megatron": (versions.get("megatron") or {}).get("version"), "te": caps.get("te_version"),
            "torch": caps.get("torch_version"), "cuda": (result.get("environment") or {}).get("CUDA_VERSION")}


def parts_of(result: Mapping[str, Any], given: str) -> list[Part]:
    """The parts a results file holds: itself, or a pooled result's own parts (each its blocks)."""
    seeds = [int(s) for s in result["block_seeds"][:result["blocks_run"]]]
    recorded = (result.get("pool") or {}).get("parts")
    if not recorded:
        return [Part(given, result, tuple(seeds), where(result))]
    parts, start = [], 0
    for p in recorded:
        count = len(p["seeds"])
        parts.append(Part(p["source"], blocks(result, start, start + count), tuple(p["seeds"]), p.get("where", {}),
                          given))
        start += count
    return parts


def blocks(result: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """The result with only blocks ``start`` to ``stop`` - 1, renumbered from 0."""
    def inside(k: Any) -> bool:
        return start <= int(k) < stop
    runs = [{**r, "block": r["block"] - start} for r in result["runs"] if inside(r.get("block", -1))]
    starts = {str(int(k) - start): s for k, s in (result.get("common_start") or {}).items() if inside(k)}
    return {**result, "runs": runs, "common_start": starts or None, "blocks_run": stop - start,
            "block_seeds": result["block_seeds"][start:stop], "pool": None}


def read_parts(given: Sequence[str]) -> list[Part]:
    """Every part the paths name, in order (a pooled result's own parts in its place)."""
    return [part for g in given for part in parts_of(read(g), g)]


# --- one experiment ------------------------------------------------------------------------------


def own_flags() -> frozenset[str]:
    """The Megatron flags whose value each run or block has its own: its seed (--block-seeds sets
    it per block), and the output directories ablate gives each run (runs.arm_paths, asked for
    every one it may set; a --load other than --save is a shared start, compared as a file). The
    common start's words are its runs' alone, never in an arm's recorded command."""
    every = {"data_path": "d", "wandb_save_dir": "w", "save": "s"}
    return frozenset({"--seed", *arm_paths(every, Path("run"), together=True)})


def _file_word(word: str) -> str:
    """A word naming a file, as its last part: where a machine keeps its files is no part of the
    experiment (a --data-path prefix's directories, the launcher's interpreter, the script's checkout)."""
    return os.path.basename(word.rstrip("/")) if "/" in word else word


def megatron_words(argv: Sequence[str]) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """An arm's command as one experiment's: its launcher words, then each Megatron flag with its
    values (a flag's values are the words up to the next flag), without the flags each run has its
    own (:func:`own_flags`), each file by its last part, the script under ``--script``."""
    at = argv.index(ENTRY) if ENTRY in argv else -1
    launcher = ["python" if _file_word(w).startswith("python") else _file_word(w) for w in argv[:max(at - 1, 0)]]
    flags: dict[str, tuple[str, ...]] = {"--script": tuple(_file_word(w) for w in argv[at + 1:at + 2])}
    current: str | None = None
    own = own_flags()
    for word in argv[at + 2:]:
        if word.startswith("--"):
            current, _, value = word.partition("=")
            flags[current] = (_file_word(value),) if value else ()
        elif current is not None:
            flags[current] += (_file_word(word),)
    return launcher, {k: v for k, v in flags.items() if k not in own}


def flag_difference(mine: Mapping[str, tuple[str, ...]], theirs: Mapping[str, tuple[str, ...]]) -> str | None:
    """The first flag the two commands set apart, in words; None where none is."""
    for flag in [*mine, *(k for k in theirs if k not in mine)]:
        if mine.get(flag) != theirs.get(flag):
            if flag not in theirs or flag not in mine:
                return f"{flag} {' '.join(mine.get(flag) or theirs[flag])} in {'the first' if flag in mine else 'the second'} only"
            return f"{flag} {' '.join(mine[flag]) or '(no value)'} against {' '.join(theirs[flag]) or '(no value)'}"
    return None


def arm_difference(name: str, mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """How one arm's recorded command differs between two parts (None: it does not)."""
    for key, what in (("env", "toggle variables"), ("candidate_env", "candidate's variables")):
        a, b = mine.get(key) or {}, theirs.get(key) or {}
        apart = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if apart:
            k = apart[0]
            return f"arm {name}'s {what}: {k}={a.get(k, '(unset)')} against {k}={b.get(k, '(unset)')}"
    launch_a, args_a = megatron_words(mine.get("argv", []))  # a candidate's arguments among them
    launch_b, args_b = megatron_words(theirs.get("argv", []))
    if launch_a != launch_b:
        return f"arm {name}'s launcher: {' '.join(launch_a)} against {' '.join(launch_b)}"
    flags = flag_difference(args_a, args_b)
    return None if flags is None else f"arm {name}'s Megatron arguments: {flags}"


def design_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """What sets two parts' experiments apart, the first thing found, in words (None: one experiment)."""
    base_a = next((r["arm"] for r in a["rows"] if r.get("baseline")), None)
    base_b = next((r["arm"] for r in b["rows"] if r.get("baseline")), None)
    if sorted(a["commands"]) != sorted(b["commands"]):
        return f"the arms: {', '.join(sorted(a['commands']))} against {', '.join(sorted(b['commands']))}"
    if base_a != base_b:
        return f"the baseline: {base_a} against {base_b}"
    if bool(a.get("common_start")) != bool(b.get("common_start")):
        return f"--common-start: {'on' if a.get('common_start') else 'off'} against " \
               f"{'on' if b.get('common_start') else 'off'} (another pairing)"
    for name in a["commands"]:
        apart = arm_difference(name, a["commands"][name], b["commands"][name])
        if apart:
            return apart
    return None


def check_one_experiment(parts: Sequence[Part]) -> None:
    """Every part against the first: one experiment, and no seed in two parts."""
    first = parts[0]
    for part in parts[1:]:
        apart = design_difference(first.result, part.result)
        if apart:
            raise DesignError(f"{first.label} and {part.label} are not one experiment: {apart}", SAME_HINT)
    owner: dict[int, str] = {}
    for part in parts:
        for seed in part.seeds:
            if seed in owner:
                raise DesignError(f"seed {seed} is in both {owner[seed]} and {part.label}: a seed counts once",
                                  "continue an experiment with a --block-seeds after every seed run so far")
            owner[seed] = part.label


def loss_window(parts: Sequence[Part], asked: int | None) -> int | None:
    """The training-loss window every part is tested with: the one asked, else the one they share."""
    if asked is not None:
        return asked
    windows = {p.result.get("loss_window") for p in parts}
    if len(windows) > 1:
        shown = " and ".join(sorted(str(w or "a tenth") for w in windows))
        raise DesignError(f"the parts used loss windows of {shown} iterations", "give --loss-window N to test all alike")
    return windows.pop()


# --- the pooled result ---------------------------------------------------------------------------


def part_record(part: Part) -> dict[str, Any]:
    return {"source": part.source, "seeds": list(part.seeds), "where": part.where}


def pooled(parts: Sequence[Part], window: int | None) -> dict[str, Any]:
    """One result of every part's runs: each part's blocks after those of the parts before it, the
    first part's commands (one experiment's: :func:`check_one_experiment`), a row per arm. Only the
    blocks a part finished (its seeds) count: a run of a block it left unfinished would otherwise be
    numbered as the next part's first seed and paired with that part's runs."""
    first = parts[0].result
    runs: list[dict[str, Any]] = []
    starts: dict[str, Any] = {}
    offset = 0
    for part in parts:
        n = len(part.seeds)  # a block the part did not finish (a budget stop mid-block) is not its
        runs += [{**r, "block": r["block"] + offset} for r in part.result["runs"] if 0 <= int(r.get("block", -1)) < n]
        starts.update({str(int(k) + offset): s for k, s in (part.result.get("common_start") or {}).items()
                       if 0 <= int(k) < n})
        offset += n
    rows = [{"arm": r["arm"], "baseline": bool(r.get("baseline")), "env": r.get("env", {})} for r in first["rows"]]
    return {"design": first.get("design"), "iters": first.get("iters"), "blocks_run": offset,
            "block_seeds": [s for p in parts for s in p.seeds], "loss_window": window,
            "common_start": starts or None, "commands": first["commands"], "rows": rows, "runs": runs,
            "pool": {"parts": [part_record(p) for p in parts]}}


def gpu_words(w: Mapping[str, Any]) -> str:
    """A part's card in words: its name, else its memory (results before the name was recorded)."""
    if w.get("gpu"):
        return str(w["gpu"])
    if w.get("gpu_memory_mb"):
        return f"an unnamed {w['gpu_memory_mb'] / 1024:.0f} GiB GPU"
    return "a GPU not recorded"


def stack_words(w: Mapping[str, Any]) -> str:
    """A part's software in words: Megatron, TE, torch, CUDA (each where recorded)."""
    named = (("Megatron", "megatron"), ("TE", "te"), ("torch", "torch"), ("CUDA", "cuda"))
    return ", ".join(f"{label} {w[key]}" for label, key in named if w.get(key)) or "versions not recorded"


def where_summary(parts: Sequence[Part]) -> str:
    """``4 seeds on NVIDIA H100 80GB HBM3, 16 on NVIDIA H200``: the seeds per card, in order met."""
    counts: dict[str, int] = {}
    for part in parts:
        card = gpu_words(part.where)
        counts[card] = counts.get(card, 0) + len(part.seeds)
    said = [f"{n} on {card}" for card, n in counts.items()]
    first = next(iter(counts.values()))
    said[0] = said[0].replace(" on ", f" seed{'s' if first != 1 else ''} on ", 1)
    return ", ".join(said)


def seed_words(seeds: Sequence[int]) -> str:
    """``1234-1237, 1240``: seeds as runs of consecutive numbers."""
    spans: list[list[int]] = []
    for s in seeds:
        if spans and s == spans[-1][-1] + 1:
            spans[-1].append(s)
        else:
            spans.append([s])
    return ", ".join(f"{sp[0]}-{sp[-1]}" if len(sp) > 1 else str(sp[0]) for sp in spans)
