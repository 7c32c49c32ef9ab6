"""Runs: each arm's command, its own directory, one process at a time, resumable.

A run whose status says done with the same command and the same plugin variables is not run
again, so the same command resumes an experiment. A crashed run is reported with its last lines
and never stops the others.
"""

from __future__ import annotations

import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .argv import arm_args
from .design import Arm, DesignError
from .world import env_prefix

ERROR_TAIL_LINES = 12


def block_order(seed: int, block: int, n_arms: int) -> list[int]:
    """Arm indices in the order block ``block`` runs them: a shuffle seeded by (seed, block), so a
    block's order does not depend on how many blocks run and a resumed experiment repeats it."""
    order = list(range(n_arms))
    random.Random(f"ablate/{seed}/{block}").shuffle(order)
    return order


@dataclass(slots=True)
class Run:
    arm: Arm
    block: int  # 0-based; -1 for the unmeasured warm-up run
    directory: Path
    command: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.arm.name} (warm-up)" if self.block < 0 else f"{self.arm.name} (block {self.block + 1})"


def arm_command(launch: str | None, script: str, megatron_args: Sequence[str], arm: Arm,
                paths: Mapping[str, str | None] | None = None) -> list[str]:
    """The arm's launch: each Megatron argument once (the arm's settings and paths replace the
    common arguments' own)."""
    prefix = shlex.split(launch) if launch else [sys.executable]
    return [*prefix, "-m", "megatron_perf_toggles.run", script, *arm_args(megatron_args, arm, paths)]


def arm_paths(effective: dict[str, Any], directory: Path, together: bool = False) -> dict[str, str]:
    """Each run its own log directory (and checkpoints, where it saves), so no run resumes from or
    overwrites another. A ``--load`` other than ``--save`` (a pretrained start) is shared: runs only read it.
    ``together`` (runs at once): each its own dataset index cache, which they would otherwise all
    write in one place at the same moment."""
    out = {"--tensorboard-dir": str(directory / "tensorboard")}
    if together and effective.get("data_path"):
        out["--data-cache-path"] = str(directory / "data-cache")
    if effective.get("wandb_save_dir"):
        out["--wandb-save-dir"] = str(directory / "wandb")
    if effective.get("save"):
        out["--save"] = str(directory / "checkpoints")
        if effective.get("load") == effective.get("save"):
            out["--load"] = str(directory / "checkpoints")
    return out


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in name)


def run_dir(out: Path, arm: Arm, block: int) -> Path:
    return out / "runs" / ("warmup" if block < 0 else f"block{block + 1:02d}") / _slug(arm.name)


def make_run(out: Path, arm: Arm, block: int, launch: str | None, script: str, megatron_args: Sequence[str],
             effective: dict[str, Any], together: bool = False) -> Run:
    here = run_dir(out, arm, block)
    return Run(arm, block, here, arm_command(launch, script, megatron_args, arm, arm_paths(effective, here, together)))


class Progress:
    """One status line on stderr: run i/N, block, arm, iteration, ETA."""

    def __init__(self, total_runs: int, stream: Any = None, live: bool | None = None) -> None:
        self.total = total_runs
        self.stream = stream or sys.stderr
        # A redrawn line only on a terminal; a log file gets one line per run.
        self.live = live if live is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self.run_seconds: list[float] = []
        self.last = ""

    def update(self, index: int, name: str, iteration: int, total_iters: int, ms_per_iter: float | None,
               remaining_runs: int) -> None:
        eta = ""
        if ms_per_iter and total_iters:
            left = (total_iters - iteration) * ms_per_iter / 1000
            per_run = statistics.median(self.run_seconds) if self.run_seconds else total_iters * ms_per_iter / 1000
            eta = f" ETA run {left:5.0f}s, all {left + remaining_runs * per_run:6.0f}s"
        width = 24
        done = int(width * iteration / total_iters) if total_iters else 0
        bar = "#" * done + "." * (width - done)
        self.last = f"[run {index}/{self.total}] {name[:36]:<36} [{bar}] it {iteration}/{total_iters}{eta}"
        if self.live:
            self.stream.write(f"\r{self.last}   ")
            self.stream.flush()

    def finish_run(self, seconds: float, status: str) -> None:
        self.run_seconds.append(seconds)
        self.stream.write(f"{'' if self.live else self.last} {status} in {seconds:.0f}s\n")
        self.last = ""
        self.stream.flush()


def error_tail(text: str, lines: int = ERROR_TAIL_LINES) -> list[str]:
    """The last lines of a failed run's output, starting at its last traceback where it has one."""
    all_lines = text.rstrip().splitlines()
    start = max((i for i, ln in enumerate(all_lines) if ln.lstrip().startswith("Traceback")), default=None)
    picked = all_lines[start:] if start is not None else all_lines
    return picked[-lines:]


def report_failure(status: dict[str, Any], stream: Any) -> None:
    stream.write(f"[ablate] FAILED: {status['label']}, exit code {status['returncode']}; "
                 f"last lines of {status['log']}:\n")
    for line in status.get("error_tail", []):
        stream.write(f"    {line}\n")
    stream.flush()


def run_seconds(statuses: Sequence[Mapping[str, Any] | None]) -> list[float]:
    """How long the finished runs took: what prices the runs still to do (a crash, often quick,
    says nothing about how long a run takes)."""
    return [s["seconds"] for s in statuses if s and s.get("status") == "done" and s.get("seconds")]


def finished_earlier(directory: Path, arm: Arm, command: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The status of a run that finished in an earlier call and need not run again (None: it must
    run): done, with the arm's plugin variables and, where given, the same command. Without a
    command (tune, before its dry runs) the answer is a forecast that the run itself confirms."""
    try:
        previous = json.loads((directory / "status.json").read_text())
    except (OSError, ValueError):  # none yet, or torn by a kill: run it
        return None
    if previous.get("status") != "done" or previous.get("env") != arm.env():
        return None
    if command is not None and previous.get("command") != list(command):
        return None
    return previous


def execute_together(batch: Sequence[Run], environ: dict[str, str], first_port: int, done: int, total: int
                     ) -> list[dict[str, Any]]:
    """Run ``batch`` at once (threads wait on the processes), each with its own MASTER_PORT from
    ``first_port`` on; their statuses in the batch's order."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict[str, Any]:
        progress = Progress(total, live=False)
        return execute(batch[i], environ, progress, done + i + 1, 0, {"MASTER_PORT": str(first_port + i)})

    with ThreadPoolExecutor(max_workers=max(1, len(batch))) as pool:
        return list(pool.map(one, range(len(batch))))


def execute(run: Run, environ: dict[str, str], progress: Progress, index: int, remaining: int,
            extra_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run one arm once unless its status says done with the same command and the same plugin
    variables (the arm's env: the same command with another toggle pinned is another run); never
    raises on a crash. ``extra_env``: what this run alone gets besides (a port of its own)."""
    from .megatron_log import ITERATION, parse_lines

    run.directory.mkdir(parents=True, exist_ok=True)
    status_file = run.directory / "status.json"
    previous = finished_earlier(run.directory, run.arm, run.command)
    if previous is not None:
        progress.stream.write(f"[run {index}/{progress.total}] {run.label}: done earlier, skipped\n")
        return previous
    log_path = run.directory / "log.txt"
    start = time.monotonic()
    last_ms: float | None = None
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(run.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**environ, **(extra_env or {}), **run.arm.env()}, bufsize=1)
        except OSError as error:
            log.write(f"could not start {run.command[0]}: {error}\n")
            code = 127
        else:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if ITERATION.search(line):
                    it = parse_lines([line]).iterations[0]
                    last_ms = it.get("ms_per_iter") or last_ms
                    progress.update(index, run.label, it.iteration, it.total, last_ms, remaining)
            code = proc.wait()
    seconds = time.monotonic() - start
    status: dict[str, Any] = {"arm": run.arm.name, "block": run.block, "label": run.label,
                              "status": "done" if code == 0 else "failed", "returncode": code, "seconds": seconds,
                              "command": run.command, "env": run.arm.env(), "log": str(log_path)}
    if code != 0:
        status["error_tail"] = error_tail(log_path.read_text(errors="replace"))
    status_file.write_text(json.dumps(status, indent=1) + "\n")
    progress.finish_run(seconds, status["status"])
    if code != 0:
        report_failure(status, progress.stream)
    return status


def check_launcher(launch: str | None, script: str, megatron_args: Sequence[str], arms: Sequence[Arm] = ()) -> None:
    """The program an arm's command starts must exist, and the prefix must not set what an arm
    sets: ``env GRAD_REDUCE_IN_BF16=1 torchrun ...`` would give every arm the same value, after
    the dry runs had checked them apart. Checked before the first GPU minute."""
    launcher = arm_command(launch, script, megatron_args, Arm("launcher", {}))[0]
    if shutil.which(launcher) is None and not Path(launcher).is_file():
        raise DesignError(f"--launch: {launcher!r} is not an executable on PATH")
    prefix_env, _ = env_prefix(shlex.split(launch) if launch else [])
    clash = sorted({k for arm in arms for k in arm.env()} & prefix_env)
    if clash:
        raise DesignError(f"--launch sets {', '.join(clash)} for every run, over each arm's own value",
                          "leave it out of --launch: the arms set it")


def check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise DesignError(f"--out {out}: not writable ({error.strerror or error})") from None
