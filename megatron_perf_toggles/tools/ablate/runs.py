"""Stage 3 of an experiment, the arms to runs: each run's command and environment, every arm
resolved through Megatron's dry run once.

An arm's run in a block is its command (the launcher, the Megatron arguments each once: the common
ones, the arm's settings, the block's seed and the run's own paths replacing their own, a
candidate's additions after them) and its environment (the arm's plugin variables and a
candidate's, over the caller's). Before any run, every arm (and each single-change probe) is
dry-run and checked for confounds (confounds.py), the launcher and the output directory are
checked, and the iterations a run makes must leave some to measure. Runs at once (``--concurrent``)
also get a short compile warm-up run of each arm (the schedule says which this call makes).
:func:`resolved` is the stage.
"""

from __future__ import annotations

import functools
import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .confounds import ConfoundError, resolve_and_check
from .design import Arm, Design
from .loss import common_start
from .spec import INNER_LAUNCHERS, DesignError, ExperimentSpec

Resolver = Callable[..., dict[str, Any]]


# --- Megatron's arguments, each once ---------------------------------------------------------------


def _flag_key(word: str) -> str:
    return word.split("=", 1)[0].replace("_", "-")


def set_args(argv: Sequence[str], values: Mapping[str, str | None]) -> list[str]:
    """``argv`` with every ``--flag [values...]`` / ``--flag=value`` of ``values`` removed (a flag's
    values are the words after it up to the next ``--`` word, so switches and lists go whole), then
    each flag whose value is not None appended once with that value. An arm's settings, its per-run
    paths and a candidate's additions replace the common arguments' own this way, so that no flag is
    given twice with two values (Megatron would take the last, silently)."""
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
    """Flags given more than once (Megatron takes the last): worth a note before anything runs."""
    seen: dict[str, int] = {}
    for word in argv:
        if word.startswith("--"):
            seen[_flag_key(word)] = seen.get(_flag_key(word), 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def arm_args(megatron_args: Sequence[str], arm: Arm, paths: Mapping[str, str | None] | None = None) -> list[str]:
    """The arm's Megatron arguments, each once: the common ones, the arm's settings and paths
    replacing their own, and a candidate's arguments added."""
    settings = dict(zip(arm.extra_args[::2], arm.extra_args[1::2], strict=True))
    return with_added(set_args(megatron_args, {**settings, **(paths or {})}), arm.added_args)


def run_args(spec: ExperimentSpec) -> list[str]:
    """The Megatron arguments as every run gets them: ``--iters`` sets ``--train-iters``."""
    if spec.iters is None:
        return list(spec.megatron_args)
    return set_args(spec.megatron_args, {"--train-iters": str(spec.iters)})


# --- a run: its command, directory and environment ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """One arm in one block: what it is called, its directory, its command and the plugin variables
    (and a candidate's) that set it apart from the other arms' runs."""

    arm: str
    block: int  # 0-based; -1 for the unmeasured warm-up run and the compile warm-ups
    directory: Path
    command: list[str]
    env: dict[str, str]

    @property
    def label(self) -> str:
        if self.block >= 0:
            return f"{self.arm} (block {self.block + 1})"
        return f"{self.arm} ({'compile ' if self.directory.parent.name == COMPILE_WARMUP_DIR else ''}warm-up)"


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


COMPILE_WARMUP_DIR = "compile-warmup"  # under runs/, beside warmup/ (the one-at-a-time warm-up run's)


def run_dir(out: Path, arm: Arm, block: int) -> Path:
    """A run's directory: ``runs/blockNN/ARM``, or for the one-at-a-time warm-up run (block -1)
    ``runs/warmup/ARM``."""
    return out / "runs" / ("warmup" if block < 0 else f"block{block + 1:02d}") / _slug(arm.name)


def compile_warmup_dir(out: Path, arm: Arm) -> Path:
    """A compile warm-up's directory, ``runs/compile-warmup/ARM``: its own, never the warm-up run's."""
    return out / "runs" / COMPILE_WARMUP_DIR / _slug(arm.name)


def make_run(out: Path, arm: Arm, block: int, launch: str | None, script: str, megatron_args: Sequence[str],
             effective: dict[str, Any], together: bool = False) -> Run:
    here = run_dir(out, arm, block)
    command = arm_command(launch, script, megatron_args, arm, arm_paths(effective, here, together))
    return Run(arm.name, block, here, command, arm.env)


def block_args(spec: ExperimentSpec, args: Sequence[str], block: int) -> list[str]:
    """Block ``block``'s Megatron arguments: with --block-seeds, its own --seed (the warm-up run, block
    -1, has the base seed), and with --common-start, that seed's saved start loaded."""
    if spec.block_seeds is None:
        return list(args)
    seed = spec.block_seeds + max(block, 0)
    words = set_args(args, {"--seed": str(seed)})
    return with_added(words, common_start.loading(Path(spec.out), seed)) if spec.common_start else words


# A compile warm-up stops after this many iterations: the first compiles what the arm's fusions
# compile on first use (torch.compile's Inductor code, Triton kernels), the second what is only
# compiled then. So every arm gets one, the baseline too: its common start runs stop after the
# first iteration. It keeps the arguments' --train-iters, since Megatron sizes the learning-rate
# schedule from it (a --train-iters under the learning-rate warm-up would fail Megatron's check).
COMPILE_WARMUP_ITERS = 2


def compile_warmup_run(spec: ExperimentSpec, arm: Arm, args: Sequence[str], effective: dict[str, Any]) -> Run:
    """--concurrent: ``arm``'s compile warm-up, unmeasured: its command as block 1 has it, but
    stopping after :data:`COMPILE_WARMUP_ITERS` iterations and loading and saving no checkpoint (a
    common start it would load may not be saved yet), in its own directory
    (``runs/compile-warmup/ARM``). It fills the compile caches on disk (shared by the processes of
    one machine) before the runs that start at once would all miss them and compile together."""
    here = compile_warmup_dir(Path(spec.out), arm)
    words = set_args(args, {"--seed": str(spec.block_seeds)}) if spec.block_seeds is not None else list(args)
    words = set_args(words, {"--exit-interval": str(COMPILE_WARMUP_ITERS)})
    paths = {**arm_paths(effective, here, together=True), "--save": None, "--load": None}
    return Run(arm.name, -1, here, arm_command(spec.launch, spec.script, words, arm, paths), arm.env)


def start_run(spec: ExperimentSpec, baseline: Arm, args: Sequence[str], block: int) -> Run:
    """--common-start: the run that saves the start of ``block``'s seed: the baseline, one iteration,
    saved after it (loss/common_start.py)."""
    out, seed = Path(spec.out), (spec.block_seeds or 0) + block
    words = set_args(set_args(args, {"--seed": str(seed)}), common_start.SAVING)
    command = arm_command(spec.launch, spec.script, words, baseline, common_start.paths(out, seed))
    return Run(common_start.NAME, 0, common_start.start_dir(out, seed), command, baseline.env)


# --- each arm's dry run -----------------------------------------------------------------------------

DRY_RUN_TIMEOUT_S = 600


def dry_run_command(script: str, megatron_args: Sequence[str], arm: Arm, world: int | None = None) -> list[str]:
    """The arm's dry run, planned for ``world`` processes where the launcher starts more than one
    (tensor or pipeline parallelism over 8 GPUs does not validate in a world of 1)."""
    plan = ["--world-size", str(world)] if world and world > 1 else []
    return [sys.executable, "-m", "megatron_perf_toggles.run", "--dry-run", "--json", *plan, script,
            *arm_args(megatron_args, arm)]


def resolve_arm(script: str, megatron_args: Sequence[str], arm: Arm, environ: dict[str, str],
                world: int | None = None) -> dict[str, Any]:
    """The arm's dry-run record (decisions + effective Megatron arguments after validate_args): the
    resolver the stage uses unless a test gives another."""
    cmd = dry_run_command(script, megatron_args, arm, world)
    # One process, as rank 0 (a dry run under a job's RANK=3 would print no record), planning for
    # ``world`` through the dry run's own --world-size rather than the caller's WORLD_SIZE.
    env = {k: v for k, v in environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, **arm.env, "RANK": "0"},
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


# --- the runs' environment and launcher -----------------------------------------------------------


# What torchrun sets for each process and a plain ``python`` launch does not: Megatron initialises
# torch.distributed from the environment even for one process, so without these every run of a
# ``--launch python`` experiment fails at start-up ("MASTER_ADDR expected, but not set").
SINGLE_PROCESS = (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                  ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"))


def single_process_env(spec: ExperimentSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """The rendezvous variables a one-process run needs and ``environ`` lacks, where the launch is
    this python or a python script (no torchrun to set them) and the world is one process; nothing
    otherwise (a launcher sets its own, and a value the caller set is kept)."""
    words = spec.launched_command
    plain_python = not words or (Path(words[0]).name.startswith("python") and not any(
        w in INNER_LAUNCHERS or Path(w).name in INNER_LAUNCHERS for w in words[1:]))
    if not plain_python or spec.stated_or_launched != 1:
        return {}
    return {name: value for name, value in SINGLE_PROCESS if name not in environ}


def runs_environ(spec: ExperimentSpec, environ: Mapping[str, str]) -> dict[str, str]:
    """Every run's environment: the caller's, with what a plain ``python`` launch lacks (above)."""
    return {**single_process_env(spec, environ), **environ}


def check_launcher(spec: ExperimentSpec, arms: Sequence[Arm] = ()) -> None:
    """The program an arm's command starts must exist, and the prefix must not set what an arm
    sets: ``env GRAD_REDUCE_IN_BF16=1 torchrun ...`` would give every arm the same value, after
    the dry runs had checked them apart. Checked before the first GPU minute."""
    launcher = shlex.split(spec.launch)[0] if spec.launch else sys.executable
    if shutil.which(launcher) is None and not Path(launcher).is_file():
        raise DesignError(f"--launch: {launcher!r} is not an executable on PATH")
    clash = sorted({k for arm in arms for k in arm.env} & spec.launch_sets)
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


def check_measurable(spec: ExperimentSpec, iters: Any) -> None:
    """The iterations a run makes (``--iters`` or the arguments' own, as resolved) must leave some
    after the warm-up ones."""
    if isinstance(iters, int) and iters <= spec.warmup:
        raise DesignError(f"--train-iters {iters} must be more than --warmup {spec.warmup}: nothing would be measured")


# --- the stage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Runs:
    """The stage's value: the design's arms resolved (each arm's dry-run record, and what each
    variable derives), every run's environment and arguments, the iterations a run makes, and the
    runs themselves: each block's, one per arm in the design's order, for every block the
    experiment may run; the baseline's warm-up run; with --common-start, each block's start run;
    with --concurrent, each arm's compile warm-up run, the baseline's too (in the design's order;
    the schedule picks those this call makes)."""

    spec: ExperimentSpec
    design: Design
    records: list[dict[str, Any]]
    derived: dict[str, set[str]]
    environ: dict[str, str]
    args: list[str]
    iters: Any
    blocks: list[list[Run]]
    warmup: Run
    starts: list[Run]
    commands: dict[str, dict[str, Any]]
    compile_warmups: list[Run]


def resolved(spec: ExperimentSpec, design: Design, environ: Mapping[str, str], resolver: Resolver,
             say: Callable[[str], None] | None = None) -> Runs:
    """The stage: every arm dry-run and checked for confounds, every check a run must pass before
    the first GPU minute is spent, then every run's command. ``say`` (ablate's): the notes on the way."""
    note = say or (lambda line: None)
    if not spec.dry_run:
        check_out(Path(spec.out))
    args, arms = run_args(spec), design.arms
    repeated = repeated_flags(spec.megatron_args)
    if repeated:
        note(f"note: given more than once (Megatron takes the last): {', '.join(repeated)}")
    env = runs_environ(spec, environ)
    note(f"{len(arms)} arms ({spec.design}); resolving each through Megatron's parser and validate_args, "
         f"for {spec.world_words}...")
    bound = planned(resolver, spec)
    records, derived = resolve_and_check(bound, spec.script, args, design, env)
    base = records[arms.index(design.baseline)]
    iters = spec.iters if spec.iters is not None else base.get("effective_args", {}).get("train_iters")
    check_measurable(spec, iters)
    if spec.common_start:
        common_start.check_record(base)
    note(_passed(design, derived))
    check_launcher(spec, arms)
    return _runs(spec, design, records, derived, env, args, iters)


def planned(resolver: Resolver, spec: ExperimentSpec) -> Resolver:
    """The resolver, planning every dry run for the world the runs will have (``spec.world_words``
    says which): tensor or pipeline parallelism over 8 GPUs does not validate in a world of 1."""
    world = spec.planned_world
    return resolver if world == 1 else functools.partial(resolver, world=world)


def _passed(design: Design, derived: Mapping[str, set[str]]) -> str:
    explained = {n: sorted(k) for n, k in derived.items() if k}
    return ("confound check passed: arms differ only in " + ", ".join(sorted({n for a in design.arms
                                                                               for n in a.intended}))
            + (" and what they derive: " + "; ".join(f"{n} -> {', '.join(k)}" for n, k in explained.items())
               if explained else ""))


def _runs(spec: ExperimentSpec, design: Design, records: list[dict[str, Any]], derived: dict[str, set[str]],
          env: dict[str, str], args: list[str], iters: Any) -> Runs:
    """Every run the experiment may make: --repeats blocks, or with --target-ci up to --max-repeats."""
    out, together = Path(spec.out), spec.concurrent > 1
    most = max(spec.repeats, spec.max_repeats) if spec.target_ci is not None else spec.repeats

    def run(arm: Arm, block: int) -> Run:
        effective = records[design.arms.index(arm)].get("effective_args", {})
        return make_run(out, arm, block, spec.launch, spec.script, block_args(spec, args, block), effective, together)

    blocks = [[run(arm, b) for arm in design.arms] for b in range(most)]
    starts = [start_run(spec, design.baseline, args, b) for b in range(most)] if spec.common_start else []
    warmups = [compile_warmup_run(spec, arm, args, records[design.arms.index(arm)].get("effective_args", {}))
               for arm in design.arms] if together else []
    commands = {a.name: {"env": a.env, "argv": arm_command(spec.launch, spec.script, args, a),
                         **({"candidate_env": a.added_env, "candidate_args": a.added_args} if a.adds else {})}
                for a in design.arms}
    return Runs(spec, design, records, derived, env, args, iters, blocks, run(design.baseline, -1), starts, commands,
                warmups)
