"""``megatron-perf-toggles ablate``: controlled toggle experiments that cannot be confounded.

1. Expand the design into arms (design.py).
2. Confound check: resolve every arm's full effective Megatron arguments through the plugin's dry
   run (Megatron's real parser and validate_args). What each variable derives (settings Megatron
   changes along with it) is learnt on the live tree from a pair of dry runs that differ in that
   variable alone. Refuse to start when an arm differs from the baseline in anything its changed
   variables do not explain (shown as a diff), or when an arm does not get its intended value (a
   guard forced it).
3. Run the arms in blocks: one unmeasured warm-up run, then each block runs every arm once in an
   order shuffled by the seed, so drift and warm-up hit every arm alike. Each run has its own log
   and directories; resume skips finished runs; a crashed run is reported with its last lines.
4. Measure from Megatron's own log lines; compare each arm with the baseline block by block
   (report.py, on stats.py: paired intervals, verdicts, loss band, sizing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import PerfTogglesError, fail
from .design import (
    DESIGNS,
    OTHERS,
    Arm,
    DesignError,
    baseline_of,
    expand,
    is_candidate_key,
    parse_candidates,
    parse_toggles,
    parse_vary,
)
from .report import compare, measure_run, sizing, widest_interval, write_results
from .world import env_prefix, launch_world_size, logged_world_size, stated_or_launched, world_size

# Arguments that legitimately differ between arms, or are bookkeeping, not the experiment.
NOT_COMPARED = {"perf_toggles", "perf_toggles_precision", "rank", "local_rank", "world_size"}
DRY_RUN_TIMEOUT_S = 600
ERROR_TAIL_LINES = 12


class ConfoundError(PerfTogglesError):
    """Arms differ in more than the intended variables, or do not get their intended values."""


# --- Megatron arguments, each once -------------------------------------------------------------


def _flag_key(word: str) -> str:
    return word.split("=", 1)[0].replace("_", "-")


def set_args(argv: Sequence[str], values: Mapping[str, str | None]) -> list[str]:
    """``argv`` with every ``--flag [values...]`` / ``--flag=value`` of ``values`` removed (a flag's
    values are the words after it up to the next ``--`` word, so switches and lists go whole), then
    each flag whose value is not None appended once with that value."""
    keys = {_flag_key(f) for f in values}
    out: list[str] = []
    skipping = False
    for word in argv:
        if word.startswith("--"):
            skipping = _flag_key(word) in keys
            if skipping:
                continue
        elif skipping:
            continue
        out.append(word)
    for flag, value in values.items():
        if value is not None:
            out += [flag, value]
    return out


def with_added(argv: Sequence[str], added: Sequence[str]) -> list[str]:
    """``argv`` with the flags of ``added`` (a candidate's arguments) replaced by ``added``: each
    Megatron argument once, the candidate's value winning."""
    flags = {_flag_key(w): None for w in added if w.startswith("--")}
    return [*set_args(argv, flags), *added]


def repeated_flags(argv: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    for word in argv:
        if word.startswith("--"):
            seen[_flag_key(word)] = seen.get(_flag_key(word), 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def _settings_args(arm: Arm) -> dict[str, str | None]:
    words = arm.extra_args()
    return dict(zip(words[::2], words[1::2], strict=True))


# --- confound check ---------------------------------------------------------------------------


def arm_args(megatron_args: Sequence[str], arm: Arm, paths: Mapping[str, str | None] | None = None) -> list[str]:
    """The arm's Megatron arguments, each once: the common ones, the arm's settings and paths
    replacing their own, and a candidate's arguments added."""
    return with_added(set_args(megatron_args, {**_settings_args(arm), **(paths or {})}), arm.added_args())


def dry_run_command(script: str, megatron_args: Sequence[str], arm: Arm, world: int | None = None) -> list[str]:
    """The arm's dry run, planned for ``world`` processes where the launcher starts more than one
    (tensor or pipeline parallelism over 8 GPUs does not validate in a world of 1)."""
    plan = ["--world-size", str(world)] if world and world > 1 else []
    return [sys.executable, "-m", "megatron_perf_toggles.run", "--dry-run", "--json", *plan, script,
            *arm_args(megatron_args, arm)]


def resolve_arm(script: str, megatron_args: Sequence[str], arm: Arm, environ: dict[str, str],
                world: int | None = None) -> dict[str, Any]:
    """The arm's dry-run record (decisions + effective Megatron arguments after validate_args)."""
    cmd = dry_run_command(script, megatron_args, arm, world)
    # One process, as rank 0 (a dry run under a job's RANK=3 would print no record), planning for
    # ``world`` through the dry run's own --world-size rather than the caller's WORLD_SIZE.
    env = {k: v for k, v in environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, **arm.env(), "RANK": "0"},
                              timeout=DRY_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfoundError(f"arm {arm.name}: the dry run took over {DRY_RUN_TIMEOUT_S}s and was stopped") from None
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ConfoundError(f"arm {arm.name}: the dry run failed (exit {proc.returncode}): {tail}")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise ConfoundError(f"arm {arm.name}: the dry run printed no JSON record") from None


def planned_world(launch: str | None, stated: int | None) -> int:
    """The world the dry runs plan for: ``--world-size``, else what ``launch`` plainly starts, else 1."""
    return stated_or_launched(launch, stated) or 1


def planned_for(resolver: Callable[..., dict[str, Any]], launch: str | None, stated: int | None = None
                ) -> tuple[Callable[..., dict[str, Any]], str]:
    """The resolver, planning the dry runs for the world the runs will have, and a note that says
    which: ``--world-size`` where given (it wins over the launcher's number, which may miss a
    launcher nested in a script), else what ``launch`` plainly starts. A launcher whose world size
    is not plain (``--nproc-per-node gpu``, elastic nodes, one unknown here) and no ``--world-size``
    leave the dry runs at one process, where validate_args refuses model parallelism; the note says so."""
    launched, world = launch_world_size(launch), planned_world(launch, stated)
    if stated is not None:
        source = "--world-size" + (f"; --launch looks like {launched}" if launched not in (None, stated) else "")
    elif launched is None:
        return resolver, "one process (the launcher's world size is not known here: say it with --world-size)"
    else:
        source = "--launch"
    if world == 1:
        return resolver, f"one process (from {source})"
    return functools.partial(resolver, world=world), f"a world of {world} (from {source})"


def resolve_all(resolver: Callable[..., dict[str, Any]], script: str, megatron_args: Sequence[str],
                arms: Sequence[Arm], environ: dict[str, str]) -> list[dict[str, Any]]:
    """Dry-run the arms a few at a time (each is one Megatron import, CPU-bound)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(len(arms), (os.cpu_count() or 2), 4))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda arm: resolver(script, megatron_args, arm, environ), arms))


def probe_arms(arms: Sequence[Arm]) -> dict[str, list[Arm]]:
    """For each design variable, the baseline with that variable alone changed, once per other value.

    Where the design already has such an arm (one-at-a-time, leave-one-out and factorial all do),
    the probe is that same run and costs no extra dry run. A candidate's arm is its own probe:
    whatever its arguments derive is part of the candidate.
    """
    base = baseline_of(arms)
    values: dict[str, set[Any]] = {}
    probes: dict[str, list[Arm]] = {}
    for arm in arms:
        for name, value in arm.intended().items():
            if is_candidate_key(name):
                probes.setdefault(name, []).append(arm)
            else:
                values.setdefault(name, set()).add(value)
    for name, seen in values.items():
        for value in sorted(seen - {base.intended().get(name)}, key=str):
            if isinstance(value, bool):  # a toggle; settings from --vary are strings
                probe = Arm(f"probe:{name}={value}", {**base.toggles, name: value}, dict(base.settings),
                            fixed=dict(base.fixed))
            else:
                probe = Arm(f"probe:{name}={value}", dict(base.toggles), {**base.settings, name: str(value)},
                            fixed=dict(base.fixed))
            same = next((a for a in arms if a.signature() == probe.signature()), None)
            probes.setdefault(name, []).append(same or probe)
    return probes


def _diff(base: dict[str, Any], other: dict[str, Any], ignore: set[str]) -> dict[str, tuple[Any, Any]]:
    keys = (set(base) | set(other)) - ignore
    return {k: (base.get(k), other.get(k)) for k in sorted(keys) if base.get(k) != other.get(k)}


def derived_settings(base_record: dict[str, Any], probe_records: Mapping[str, Sequence[dict[str, Any]]]
                     ) -> dict[str, set[str]]:
    """What each variable derives: the arguments in which its single-change dry runs differ from
    the baseline's, besides the variable itself (e.g. grad_reduce_in_bf16 ->
    accumulate_allreduce_grads_in_fp32, and megatron_fsdp_grad_comm_dtype on core 0.17-0.18)."""
    base = base_record.get("effective_args", {})
    return {name: {k for rec in recs for k in _diff(base, rec.get("effective_args", {}), NOT_COMPARED | {name})}
            for name, recs in probe_records.items()}


def check_confounds(arms: Sequence[Arm], records: Sequence[dict[str, Any]],
                    derived: Mapping[str, set[str]] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfoundError naming every problem; return quietly when the arms are clean.

    An arm may differ from the baseline only in the variables it changes and in what those
    variables derive (``derived``, from single-change dry runs): a difference that none of its
    changed variables produces alone is a confound, even if it arises only from their combination.
    """
    derived = derived or {}
    problems: list[str] = []
    for arm, rec in zip(arms, records, strict=True):
        decisions = rec.get("decisions", {})
        effective = rec.get("effective_args", {})
        for dest, want in arm.pinned().items():
            got = decisions.get(dest, {})
            if got.get("value") != want:
                problems.append(f"arm {arm.name}: {dest} should be {want} but is {got.get('value')} "
                                f"({got.get('source')}; {got.get('reason')})")
        for name, text in arm.settings.items():
            if name in effective and str(effective[name]) != text and _as_float(effective[name]) != _as_float(text):
                problems.append(f"arm {arm.name}: {name} should be {text} but Megatron resolved {effective[name]}")
    base_arm = baseline_of(arms)
    base = records[list(arms).index(base_arm)].get("effective_args", {})
    for arm, rec in zip(arms, records, strict=True):
        if arm is base_arm:
            continue
        changed = {n for n, v in arm.intended().items() if base_arm.intended().get(n) != v}
        allowed = NOT_COMPARED | changed | {k for n in changed for k in derived.get(n, ())}
        diff = _diff(base, rec.get("effective_args", {}), allowed)
        if diff:
            lines = [f"    {k}: {base_arm.name}={a!r}  {arm.name}={b!r}" for k, (a, b) in diff.items()]
            problems.append(f"arm {arm.name} differs from {base_arm.name} beyond the intended variables "
                            f"({', '.join(sorted(changed)) or 'none'}) and what each derives alone:\n"
                            + "\n".join(lines))
    # A candidate's environment (an allocator or NCCL setting) is part of what its run gets, on top
    # of the caller's: a candidate that sets what the caller's environment already holds changes nothing.
    keys = {k for a in arms for k in a.added_env()}
    same: dict[str, list[str]] = {}
    for a, r in zip(arms, records, strict=True):
        env = {k: a.added_env().get(k, (environ or {}).get(k)) for k in keys}
        same.setdefault(json.dumps([r.get("effective_args", {}), env], sort_keys=True, default=str), []).append(a.name)
    for names in same.values():
        if len(names) > 1 and not problems:
            caller = sorted(f"{k}={v}" for a in arms if a.name in names for k, v in a.added_env().items()
                            if (environ or {}).get(k) == v)
            problems.append(f"arms {', '.join(names)} resolve to identical Megatron arguments and environment: "
                            "they cannot measure a difference"
                            + (f" ({', '.join(caller)} is already set here)" if caller else ""))
    if problems:
        raise ConfoundError("confound check failed, nothing was run:\n  " + "\n  ".join(problems))


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def resolve_and_check(resolver: Callable[..., dict[str, Any]], script: str, megatron_args: Sequence[str],
                      arms: Sequence[Arm], environ: dict[str, str]
                      ) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    """Dry-run the arms and the single-change probes (each distinct run once), then check."""
    probes = probe_arms(arms)
    unique: dict[Any, Arm] = {}
    for arm in [*arms, *(p for ps in probes.values() for p in ps)]:
        unique.setdefault(arm.signature(), arm)
    resolved = dict(zip(unique, resolve_all(resolver, script, megatron_args, list(unique.values()), environ),
                        strict=True))
    records = [resolved[a.signature()] for a in arms]
    base_record = resolved[baseline_of(arms).signature()]
    derived = derived_settings(base_record, {n: [resolved[p.signature()] for p in ps] for n, ps in probes.items()})
    check_confounds(arms, records, derived, environ)
    return records, derived


# --- runs: blocks, directories, commands ----------------------------------------------------------


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


def arm_paths(effective: dict[str, Any], directory: Path) -> dict[str, str]:
    """Each run its own log directory (and checkpoints, where it saves), so no run resumes from or
    overwrites another. A ``--load`` other than ``--save`` (a pretrained start) is shared: runs only read it."""
    out = {"--tensorboard-dir": str(directory / "tensorboard")}
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
             effective: dict[str, Any]) -> Run:
    here = run_dir(out, arm, block)
    return Run(arm, block, here, arm_command(launch, script, megatron_args, arm, arm_paths(effective, here)))


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


def execute(run: Run, environ: dict[str, str], progress: Progress, index: int, remaining: int) -> dict[str, Any]:
    """Run one arm once unless its status says done with the same command and the same plugin
    variables (the arm's env: the same command with another toggle pinned is another run); never
    raises on a crash."""
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
                                    env={**environ, **run.arm.env()}, bufsize=1)
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


# --- measuring ----------------------------------------------------------------------------------

def megatron_args_of(ns: argparse.Namespace) -> list[str]:
    """The Megatron arguments as given after the script: argparse keeps the ``--`` that separates
    them from ours, and only that first one is ours to drop (ablate and tune alike)."""
    args = list(ns.megatron_args)
    return args[1:] if args[:1] == ["--"] else args


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


def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise DesignError(f"--out {out}: not writable ({error.strerror or error})") from None


DESCRIPTION = (
    "Run a controlled toggle experiment: every arm is resolved through Megatron's real "
    "parser first, and the run is refused if arms differ in anything but the intended variables. "
    "Arms run in blocks (each block every arm once, in a seeded shuffled order) after one unmeasured "
    "warm-up run; each arm is compared with the baseline block by block, with a confidence interval.")
EPILOG = ("example: megatron-perf-toggles ablate --design factorial --toggles grad_reduce_in_bf16 "
          "--vary adam_eps=1e-8,1e-5 --out runs/2x2 -- pretrain_gpt.py <megatron args>")


def build_ablate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-perf-toggles ablate", description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    return p


WORLD_SIZE_HELP = ("the processes the runs will have: the dry runs that check every arm first plan for it, and "
                   "per-GPU figures divide by it where the runs' logs do not say (default: what --launch plainly "
                   "starts, e.g. torchrun's --nproc-per-node x --nnodes; 1 for this python); needed where the "
                   "launcher does not say, as with srun around torchrun or a wrapper script")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``ablate`` options, for :func:`main`'s parser and the ``megatron-perf-toggles ablate`` subcommand."""
    p.add_argument("--design", required=True, choices=DESIGNS,
                   help="one-at-a-time: all off, then each alone; leave-one-out: all on, then each off; "
                   "factorial: every combination (with --vary settings); headline: all off against all on; "
                   "candidates: the command as given against each --candidate's additions")
    p.add_argument("--toggles", help="comma list of toggle dests taking part (default: all five on/off toggles)")
    p.add_argument("--others", choices=OTHERS, default="inherit",
                   help="toggles not taking part: inherit the environment / plugin default (default), or pin "
                   "them off or on in every arm")
    p.add_argument("--vary", action="append", metavar="NAME=V1,V2", help="a Megatron setting to vary (factorial)")
    p.add_argument("--candidate", action="append", metavar="NAME='[VAR=value ...] ARGS'",
                   help="with --design candidates: an arm that adds these Megatron arguments to the common "
                   "ones, and sets the environment variables written before them (repeat for more arms), "
                   "compared with the command as given, e.g. --candidate overlap='--overlap-grad-reduce "
                   "--overlap-param-gather' --candidate alloc='PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True'")
    p.add_argument("--out", default="ablation", help="results directory (default: ./ablation)")
    p.add_argument("--launch", help="launcher prefix, e.g. 'torchrun --nproc-per-node 8' (default: this python)")
    p.add_argument("--world-size", type=int, metavar="N", help=WORLD_SIZE_HELP)
    p.add_argument("--repeats", type=int, default=3, help="blocks to run; each block runs every arm once (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seeds each block's arm order (default 0)")
    p.add_argument("--iters", type=int, help="iterations per run (sets --train-iters; default: the arguments' own)")
    p.add_argument("--warmup", type=int, default=3, help="iterations skipped before steady-state medians (default 3)")
    p.add_argument("--no-warmup-run", dest="warmup_run", action="store_false",
                   help="skip the unmeasured warm-up run before the first block")
    p.add_argument("--confidence", type=float, default=0.95, help="confidence of the intervals (default 0.95)")
    p.add_argument("--effect", type=float, default=0.01,
                   help="the effect the sizing advice is for, as a fraction (default 0.01 = 1 %%)")
    p.add_argument("--target-ci", type=float, metavar="FRACTION",
                   help="after --repeats blocks, add blocks until every interval is within +-FRACTION "
                   "(0.01 = +-1 %%), --budget is spent or --max-repeats is reached")
    p.add_argument("--max-repeats", type=int, default=30, help="most blocks --target-ci may run (default 30)")
    p.add_argument("--budget", type=float, metavar="MINUTES",
                   help="no block starts that would end later than this many minutes after this call's start "
                   "(the warm-up run always runs, unless done in an earlier call: it times the others; with "
                   "--no-warmup-run the first block starts unpriced unless runs of it were done earlier); run "
                   "the same command again to resume, with a fresh budget in which runs done earlier cost nothing")
    p.add_argument("--dry-run", action="store_true",
                   help="check confounds, print arms, block order and commands; run and write nothing")
    p.add_argument("script", help="the Megatron training script, e.g. pretrain_gpt.py")
    p.add_argument("megatron_args", nargs=argparse.REMAINDER, help="Megatron arguments")


def _validate(ns: argparse.Namespace) -> None:
    if ns.repeats < 1:
        raise DesignError(f"--repeats {ns.repeats}: at least 1 (3 or more for an interval worth reading)")
    if ns.warmup < 0:
        raise DesignError(f"--warmup {ns.warmup}: cannot be negative")
    if ns.iters is not None and ns.iters <= ns.warmup:
        raise DesignError(f"--iters {ns.iters} must be more than --warmup {ns.warmup}: nothing would be measured")
    if not 0.5 < ns.confidence < 1:
        raise DesignError(f"--confidence {ns.confidence}: expected a fraction between 0.5 and 1, e.g. 0.95")
    if not 0 < ns.effect < 1:
        raise DesignError(f"--effect {ns.effect}: expected a fraction, e.g. 0.01 for 1 %")
    if ns.target_ci is not None and not 0 < ns.target_ci < 1:
        raise DesignError(f"--target-ci {ns.target_ci}: expected a fraction, e.g. 0.01 for +-1 %")
    if ns.budget is not None and ns.budget <= 0:
        raise DesignError(f"--budget {ns.budget}: expected minutes > 0")
    if ns.world_size is not None and ns.world_size < 1:
        raise DesignError(f"--world-size {ns.world_size}: at least 1")
    if not Path(ns.script).is_file():
        raise DesignError(f"script not found: {ns.script}")


def main(argv: Sequence[str] | None = None, resolver: Callable[..., dict[str, Any]] = resolve_arm,
         clock: Callable[[], float] = time.monotonic) -> int:
    return run_ablation(build_ablate_parser().parse_args(list(sys.argv[1:] if argv is None else argv)), resolver, clock)


def run_ablation(ns: argparse.Namespace, resolver: Callable[..., dict[str, Any]] = resolve_arm,
        clock: Callable[[], float] = time.monotonic) -> int:
    """The experiment the parsed options ask for (``main``'s body; also the cli subcommand's)."""
    # Longer than 50 lines on purpose: every check a run must pass before the first GPU minute is
    # spent, in the order they are reported; the work itself is in experiment().
    args = megatron_args_of(ns)
    try:
        _validate(ns)
        dests, flags = _known_args()
        toggles = parse_toggles(ns.toggles)
        if ns.design != "candidates":
            # A toggle a guard turns off for this model can be on in no arm: left out before any dry run.
            from .guarded import leave_out

            toggles = leave_out(toggles, ns.script, args, planned_world(ns.launch, ns.world_size),
                                say=lambda line: print(line, file=sys.stderr, flush=True))
        arms = expand(ns.design, toggles, parse_vary(ns.vary, dests), ns.others,
                      parse_candidates(ns.candidate, flags))
        out = Path(ns.out)
        if not ns.dry_run:
            _check_out(out)
        repeated = repeated_flags(args)
        if repeated:
            print(f"[ablate] note: given more than once (Megatron takes the last): {', '.join(repeated)}",
                  file=sys.stderr)
        if ns.iters is not None:
            args = set_args(args, {"--train-iters": str(ns.iters)})
        environ = dict(os.environ)
        resolver, world = planned_for(resolver, ns.launch, ns.world_size)
        print(f"[ablate] {len(arms)} arms ({ns.design}); resolving each through Megatron's parser and "
              f"validate_args, for {world}...", file=sys.stderr, flush=True)
        records, derived = resolve_and_check(resolver, ns.script, args, arms, environ)
        effective = records[arms.index(baseline_of(arms))].get("effective_args", {})
        iters = ns.iters if ns.iters is not None else effective.get("train_iters")
        if isinstance(iters, int) and iters <= ns.warmup:
            raise DesignError(f"--train-iters {iters} must be more than --warmup {ns.warmup}: nothing would be measured")
        explained = {n: sorted(k) for n, k in derived.items() if k}
        print("[ablate] confound check passed: arms differ only in "
              + ", ".join(sorted({n for a in arms for n in a.intended()}))
              + (" and what they derive: " + "; ".join(f"{n} -> {', '.join(k)}" for n, k in explained.items())
                 if explained else ""), file=sys.stderr)
        check_launcher(ns.launch, ns.script, args, arms)

        def runs_of_block(block: int) -> list[Run]:
            return [make_run(out, arms[i], block, ns.launch, ns.script, args, records[i])
                    for i in block_order(ns.seed, block, len(arms))]

        total = ns.repeats * len(arms) + (1 if ns.warmup_run else 0)
        print(f"[ablate] {total} runs: {'1 unmeasured warm-up run, then ' if ns.warmup_run else ''}{ns.repeats} "
              f"block(s) x {len(arms)} arms (seed {ns.seed}); {iters} iterations per run, the first {ns.warmup} "
              "left out of the medians", file=sys.stderr, flush=True)
        if ns.dry_run:
            for b in range(ns.repeats):
                print(f"block {b + 1}: " + ", ".join(r.arm.name for r in runs_of_block(b)))
            for run in runs_of_block(0):
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in run.arm.env().items())
                print(f"{run.arm.name}{' (baseline)' if run.arm.baseline else ''}:\n  {env} {shlex.join(run.command)}")
            return 0
        result = experiment(ns, arms, records, args, out, environ, runs_of_block, iters, derived, clock)
        write_results(out, result, records)
        return 1 if any(r.get("status") == "failed" for r in result["runs"]) else 0
    except PerfTogglesError as error:
        fail(error)
    return 2


def experiment(ns: argparse.Namespace, arms: Sequence[Arm], records: Sequence[dict[str, Any]], args: Sequence[str],
               out: Path, environ: dict[str, str], runs_of_block: Callable[[int], list[Run]], iters: Any,
               derived: Mapping[str, set[str]], clock: Callable[[], float],
               prior_seconds: Sequence[float] = ()) -> dict[str, Any]:
    """Warm-up run, then blocks until --repeats (and --target-ci) are met or --budget would be passed.

    ``prior_seconds``: run times from an earlier experiment on the same job (tune's later phases,
    which have no warm-up run), used to price a block until this experiment has timed a run of its
    own; without them and without a warm-up run, the first block is not priced."""
    # Longer than 50 lines on purpose: the stopping rules (repeats, target interval, budget) share
    # the loop's state and read best in the order they are checked.
    start = clock()
    planned = ns.repeats * len(arms) + (1 if ns.warmup_run else 0)
    progress = Progress(planned)
    statuses: list[dict[str, Any]] = []
    index = 0
    if ns.warmup_run:
        base = baseline_of(arms)
        warm = make_run(out, base, -1, ns.launch, ns.script, args, records[list(arms).index(base)])
        index += 1
        earlier = finished_earlier(warm.directory, warm.arm, warm.command) is not None
        statuses.append(execute(warm, environ, progress, index, planned - index))
        per_run = statuses[-1]["seconds"]
        to_do = sum(finished_earlier(r.directory, r.arm, r.command) is None
                    for b in range(ns.repeats) for r in runs_of_block(b))
        if statuses[-1]["status"] != "done":
            print(f"[ablate] the warm-up run failed after {per_run:.0f}s: it prices nothing", file=sys.stderr,
                  flush=True)
        else:
            more = " (--target-ci may add blocks)" if ns.target_ci is not None and ns.max_repeats > ns.repeats else ""
            left = (f"about {per_run * to_do / 60:.1f} min for the {to_do} runs of --repeats blocks still to do"
                    if to_do else "every run of the --repeats blocks is done")
            print(f"[ablate] the warm-up run took {per_run:.0f}s{' (in an earlier call)' if earlier else ''}: "
                  f"{left}{more}", file=sys.stderr, flush=True)
    seq = records[0].get("effective_args", {}).get("seq_length")
    base_name = baseline_of(arms).name
    block, stop_reason = 0, None
    orders: list[list[str]] = []
    while True:
        if block >= ns.repeats:
            if ns.target_ci is None:
                break
            rows = compare(arms, [measure_run(s, ns.warmup) for s in statuses], block, seq,
                           world_size(statuses, base_name, ns.launch, ns.world_size), ns.confidence)
            width = widest_interval(rows)
            if width <= ns.target_ci:
                stop_reason = f"every interval within +-{ns.target_ci * 100:g} % after {block} blocks"
                break
            if block >= ns.max_repeats:
                stop_reason = f"--max-repeats {ns.max_repeats} reached (widest interval +-{width * 100:.2f} %)"
                break
        runs = runs_of_block(block)
        previous = [finished_earlier(r.directory, r.arm, r.command) for r in runs]
        # a resumed block costs only its runs not done earlier (a whole block of them stopped
        # every resumed experiment whose first call had used the budget up); one with none left
        # costs nothing and is never the reason to stop. Priced by this call's finished runs, else
        # (no warm-up run) by this block's runs done earlier, else by the caller's prior times.
        to_run = [r for r, done in zip(runs, previous, strict=True) if done is None]
        seconds = run_seconds(statuses) or run_seconds(previous) or list(prior_seconds)
        if ns.budget is not None and seconds and to_run:
            predicted = statistics.median(seconds) * len(to_run)
            used = clock() - start
            if used + predicted > ns.budget * 60:
                left = "" if len(to_run) == len(runs) else f", {len(to_run)} of its {len(runs)} runs still to do"
                # the first run on a fresh machine also pays one-time costs (kernel and helper
                # builds): say so where that price, not the time already used, stopped it
                timed = ", timed by the warm-up run alone" if (block == 0 and ns.warmup_run
                                                                 and used <= ns.budget * 60) else ""
                stop_reason = (f"--budget {ns.budget:g} min: block {block + 1} (about {predicted / 60:.1f} min"
                               f"{left}{timed}) would not fit after {used / 60:.1f} min")
                break
        orders.append([r.arm.name for r in runs])
        progress.total = max(progress.total, index + len(runs))
        for run in runs:
            index += 1
            statuses.append(execute(run, environ, progress, index, max(progress.total - index, 0)))
        block += 1
    if stop_reason:
        print(f"[ablate] stopped: {stop_reason}", file=sys.stderr)
    measured = [measure_run(s, ns.warmup) for s in statuses]
    gpus = world_size(statuses, base_name, ns.launch, ns.world_size)
    planned = planned_world(ns.launch, ns.world_size)
    logged = logged_world_size(statuses, base_name)
    if logged is not None and logged != planned:
        print(f"[ablate] warning: the runs had a world of {logged}, the dry runs planned for {planned}: "
              "say --world-size " + str(logged), file=sys.stderr)
    rows = compare(arms, measured, block, seq, gpus, ns.confidence, ns.effect)
    return {"design": ns.design, "seed": ns.seed, "repeats": ns.repeats, "blocks_run": block, "block_order": orders,
            "world_size": gpus, "planned_world_size": planned,
            "warmup_run": ns.warmup_run, "iters": iters, "warmup": ns.warmup, "confidence": ns.confidence,
            "target_ci": ns.target_ci, "budget_min": ns.budget, "stop_reason": stop_reason,
            "derived": {n: sorted(k) for n, k in derived.items()}, "rows": rows,
            "sizing": sizing(rows, ns.effect, ns.confidence), "runs": measured,
            "commands": {a.name: {"env": a.env(), "argv": arm_command(ns.launch, ns.script, args, a),
                                  **({"candidate_env": a.added_env(), "candidate_args": a.added_args()}
                                     if a.adds else {})} for a in arms},
            "seconds": clock() - start}


def _known_args() -> tuple[set[str] | None, set[str] | None]:
    """Megatron's argument dests and flags (``--no-...`` switches store into a dest of another
    name), from the recorded main surface: catches typos before any run."""
    from ..surfaces import replay

    try:
        actions = replay.load_surface("main")["actions"]
    except Exception:  # noqa: BLE001 - without the record, Megatron's parser reports unknown flags
        return None, None
    return {a["dest"] for a in actions}, {f for a in actions for f in a["flags"]}
