"""How many processes (GPUs) a run had: Megatron's own start-up line where a run logged it, else
what the launcher prefix plainly starts. ``ablate`` divides tokens/s by it and ``tune`` records it in
the profile; both ask here, so the two never disagree."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

WORLD_IN_LOG = re.compile(r"using world size: (\d+)")  # Megatron's own line at start-up


def _option(words: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` in ``words`` (``--x 8``, ``--x=8``), or None."""
    for i, word in enumerate(words):
        key, eq, val = word.partition("=")
        if key in names:
            return val if eq else (words[i + 1] if i + 1 < len(words) else "")
    return None


# Launchers that start the training processes themselves: behind srun or mpirun they multiply the
# count, so the outer launcher's number is not the world.
_INNER = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def env_prefix(words: Sequence[str]) -> tuple[set[str], list[str]]:
    """``env VAR=value ... CMD ...``: the variables the prefix sets, and the command it runs (the
    words as given where they do not start with ``env``). ``env``'s own options end the reading."""
    if not words or Path(words[0]).name != "env":
        return set(), list(words)
    rest = list(words[1:])
    names: set[str] = set()
    while rest and "=" in rest[0] and not rest[0].startswith("-"):
        names.add(rest.pop(0).split("=", 1)[0])
    return names, rest


def launch_world_size(launch: str | None) -> int | None:
    """The world size a launcher prefix starts, where it says so plainly; None where it does not
    (``--nproc-per-node gpu``, elastic ``--nnodes 1:2``, ``srun -n 2 torchrun ...``, a launcher not
    known here): a wrong number would make every run of the profile warn "measured elsewhere", and
    plan the dry runs for the wrong world; an unknown one is not checked."""
    if not launch:
        return 1  # this python: one process
    _, words = env_prefix(shlex.split(launch))  # `env VAR=value ... torchrun ...`: the launcher follows
    name = Path(words[0]).name if words else ""
    if name in ("srun", "mpirun", "mpiexec"):
        if any(Path(w).name in _INNER for w in words[1:]):
            return None
        count = _option(words, ("-n", "--ntasks") if name == "srun" else ("-np", "-n", "--np", "-c"))
    elif name == "torchrun" or "torch.distributed.run" in words or "torch.distributed.launch" in words:
        per_node = _option(words, ("--nproc-per-node", "--nproc_per_node")) or "1"
        nodes = _option(words, ("--nnodes",)) or "1"
        count = str(int(per_node) * int(nodes)) if per_node.isdigit() and nodes.isdigit() else None
    else:
        return 1 if name.startswith("python") else None  # a script run by python: one process
    return int(count) if count and count.isdigit() and int(count) > 0 else None


def logged_world_size(runs: Sequence[Mapping[str, Any]], arm: str) -> int | None:
    """The world size Megatron printed in one of ``arm``'s finished runs: the run's own word."""
    for run in runs:
        if run.get("arm") != arm or run.get("status") != "done" or not run.get("log"):
            continue
        try:
            with open(run["log"], errors="replace") as fh:
                for line in fh:
                    found = WORLD_IN_LOG.search(line)
                    if found:
                        return int(found.group(1))
        except OSError:
            continue
    return None


def world_size(runs: Sequence[Mapping[str, Any]], arm: str, launch: str | None,
               stated: int | None = None) -> int | None:
    """The runs' own word where they logged it, else the user's (``--world-size``), else the
    launcher's, else None (unknown)."""
    logged = logged_world_size(runs, arm)
    return logged if logged is not None else stated_or_launched(launch, stated)


def stated_or_launched(launch: str | None, stated: int | None) -> int | None:
    """The world the user said (``--world-size``), else what ``launch`` plainly starts, else None."""
    return stated if stated is not None else launch_world_size(launch)


# What torchrun sets for each process and a plain ``python`` launch does not: Megatron initialises
# torch.distributed from the environment even for one process, so without these every run of a
# ``--launch python`` experiment fails at start-up ("MASTER_ADDR expected, but not set").
SINGLE_PROCESS = (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                  ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"))


def single_process_env(launch: str | None, stated: int | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The rendezvous variables a one-process run needs and ``environ`` lacks, where the launch is
    this python or a python script (no torchrun to set them) and the world is one process; nothing
    otherwise (a launcher sets its own, and a value the caller set is kept)."""
    _, words = env_prefix(shlex.split(launch) if launch else [])
    plain_python = not words or (Path(words[0]).name.startswith("python") and not any(
        w in _INNER or Path(w).name in _INNER for w in words[1:]))
    if not plain_python or stated_or_launched(launch, stated) != 1:
        return {}
    return {name: value for name, value in SINGLE_PROCESS if name not in environ}
