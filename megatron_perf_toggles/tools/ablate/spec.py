"""Stage 1 of an experiment, options to a checked spec: ``ExperimentSpec`` declares what one
experiment is, once, and ``ablate`` and ``tune`` take their shared options (flag, type, default,
help) from it, so the two commands cannot drift apart. :func:`checked` is the stage: the parsed
options, every value checked, in one line where one is bad.

Checking includes the toggles named: one a guard turns off for this model is left out first, in
well under a second, against the recorded argument surface of the Megatron at hand (``explain``'s
planning, the same guards and planned world as the dry runs): a design that asks for fused
single-QKV RoPE on a model with q/k layer norm could have that toggle on in no arm, and the
confound check would refuse the whole design after a minute of dry runs. Each toggle left out
gets one line that says why.

Each field's ``metadata`` is its option: ``flag`` (absent for the positional script and Megatron
arguments), ``help`` (the field's documentation, shown by ``--help``), and where needed ``type``,
``metavar`` and ``action``. A field without metadata is no option (set by the caller: a tune
phase's design and confidence). ``--help`` renders ``%(default)s``, so a command may give a field
another default (``--out``) and keep the one help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.registry import BY_DEST, TOGGLES
from ...errors import PerfTogglesError

ALL_TOGGLES = tuple(t.dest for t in TOGGLES if t.kind == "bool")  # every on/off toggle --toggles may name
# The default for a dense model: the toggles that apply to every model. A mixture-of-experts run
# (--num-experts set) adds the MoE toggles (default_toggles), so dense experiments stay as they were.
DEFAULT_TOGGLES = tuple(d for d in ALL_TOGGLES if BY_DEST[d].scope == "all")


class DesignError(PerfTogglesError):
    """The experiment is ill-specified (a bad option value, unknown design, toggle or setting, or no arms)."""


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


def after_separator(words: Sequence[str]) -> list[str]:
    """The Megatron arguments as given after the script: argparse keeps the ``--`` that separates
    them from ours, and only that first one is ours to drop."""
    args = list(words)
    return args[1:] if args[:1] == ["--"] else args

WORLD_SIZE_HELP = ("the processes the runs will have: the dry runs that check every arm first plan for it, and "
                   "per-GPU figures divide by it where the runs' logs do not say (default: what --launch plainly "
                   "starts, e.g. torchrun's --nproc-per-node x --nnodes; 1 for this python); needed where the "
                   "launcher does not say, as with srun around torchrun or a wrapper script")


def _opt(flag: str | None, help: str, **more: Any) -> dict[str, Any]:
    return {"flag": flag, "help": help, **more}


@dataclass(slots=True)
class ExperimentSpec:
    """One experiment on one Megatron command line: where it runs, how many blocks, how it is read.

    ``ablate`` builds one from its options; ``tune`` builds one from the same options and derives
    one per phase (:func:`dataclasses.replace`) with that phase's design and confidence."""

    script: str = field(default="", metadata=_opt(None, "the Megatron training script, e.g. pretrain_gpt.py"))
    megatron_args: list[str] = field(default_factory=list, metadata=_opt(
        None, "Megatron arguments", nargs=argparse.REMAINDER))
    toggles: str | None = field(default=None, metadata=_opt(
        "--toggles", f"comma list of on/off toggle dests taking part (default: all {len(DEFAULT_TOGGLES)}: "
        f"{', '.join(DEFAULT_TOGGLES)})"))
    launch: str | None = field(default=None, metadata=_opt(
        "--launch", "launcher prefix, e.g. 'torchrun --nproc-per-node 8' (default: this python)"))
    world_size: int | None = field(default=None, metadata=_opt("--world-size", WORLD_SIZE_HELP, type=int,
                                                                 metavar="N"))
    out: str = field(default="ablation", metadata=_opt(
        "--out", "results directory (default: ./%(default)s); run the same command again to resume"))
    repeats: int = field(default=3, metadata=_opt(
        "--repeats", "blocks per experiment (each phase of tune is one); each block runs every arm once "
        "(default %(default)s)", type=int))
    seed: int = field(default=0, metadata=_opt("--seed", "seeds each block's arm order (default %(default)s)",
                                               type=int))
    iters: int | None = field(default=None, metadata=_opt(
        "--iters", "iterations per run (sets --train-iters; default: the arguments' own)", type=int))
    warmup: int = field(default=3, metadata=_opt(
        "--warmup", "iterations left out of each run's steady-state medians (default %(default)s)", type=int))
    warmup_run: bool = field(default=True, metadata=_opt(
        "--no-warmup-run", "skip the unmeasured warm-up run before the first block (with --concurrent: the compile "
        "warm-up, one short run of each arm at once before the runs)", action="store_false"))
    confidence: float = field(default=0.95, metadata=_opt(
        "--confidence", "confidence of the intervals (default %(default)s)", type=float))
    budget: float | None = field(default=None, metadata=_opt(
        "--budget", "no block starts that would end later than this many minutes after this call's start (the "
        "first, unmeasured warm-up run always runs, unless done in an earlier call: it times the others; without "
        "it a block is priced by runs done earlier, or by an earlier phase's runs, else starts unpriced); run the "
        "same command again to resume, with a fresh budget in which runs done earlier cost nothing",
        type=float, metavar="MINUTES"))
    effect: float = field(default=0.01, metadata=_opt(
        "--effect", "the effect the sizing advice is for, as a fraction (default 0.01 = 1 %%)", type=float))
    target_ci: float | None = field(default=None, metadata=_opt(
        "--target-ci", "after --repeats blocks, add blocks until every interval is within +-FRACTION "
        "(0.01 = +-1 %%), --budget is spent or --max-repeats is reached", type=float, metavar="FRACTION"))
    max_repeats: int = field(default=30, metadata=_opt(
        "--max-repeats", "most blocks --target-ci may run (default %(default)s)", type=int))
    block_seeds: int | None = field(default=None, metadata=_opt(
        "--block-seeds", "blocks are seeds: block i runs every arm with Megatron's --seed BASE+i (i from 0; the "
        "warm-up run has BASE), so a loss comparison has one run per seed and arm", type=int, metavar="BASE"))
    loss_window: int | None = field(default=None, metadata=_opt(
        "--loss-window", "the loss test's training-loss measure: each run's mean loss over its last N iterations "
        "(default: the last tenth); the loss test runs with --block-seeds or with this option", type=int,
        metavar="N"))
    loss_measure: str = field(default="auto", metadata=_opt(
        "--loss-measure", "what the loss test compares per run: validation (the last held-out validation loss, "
        "logged with --eval-iters > 0), train-window (the mean training loss over --loss-window), or auto "
        "(validation where every run logged one; default)", choices=("auto", "validation", "train-window")))
    loss_margin: float = field(default=1.0, metadata=_opt(
        "--loss-margin", "the loss test's equivalence margin, in %% of the baseline's loss (default %(default)s): "
        "an arm is equivalent where the whole interval of its per-seed differences lies within +-PCT",
        type=float, metavar="PCT"))
    loss_alpha: float = field(default=0.05, metadata=_opt(
        "--loss-alpha", "the level of each of the loss test's two one-sided tests (default %(default)s: a 90 %% "
        "interval)", type=float, metavar="ALPHA"))
    common_start: bool = field(default=False, metadata=_opt(
        "--common-start", "with --block-seeds: each seed first runs the baseline for one iteration and saves it "
        "(torch_dist), and every arm of that seed starts from those weights (Megatron's --load --finetune "
        "--no-load-optim --no-load-rng), so the loss test pairs even a toggle that draws the initial weights "
        "another way", action="store_true"))
    concurrent: int = field(default=1, metadata=_opt(
        "--concurrent", "run K runs at once (for loss-only experiments: runs that share a GPU time the "
        "sharing, so the result then carries no speed figures; instead of the warm-up run, with --common-start, a "
        "compile warm-up: one short run of each arm with runs left, in the common starts' waves where it adds no "
        "wave of its own, that fills the compile caches first); each run gets its own "
        "MASTER_PORT; where K runs' planned peak plus each process's own overhead does not fit the GPU's "
        "memory, as many as fit (one line says so) (default %(default)s: one at a time)", type=int, metavar="K"))
    split_blocks: bool = field(default=False, metadata=_opt(
        "--split-blocks", "with --budget, stop before a run, not only before a block, that would not fit; the "
        "same command resumes the block there, so its runs ran in two calls (perhaps on two machines: more "
        "noise in that block's ratios; the results name such blocks)", action="store_true"))
    # ablate's own options (declared by its command; tune sets design per phase): the design's name,
    # as the results record it, what the toggles not taking part get, the settings it varies and the
    # candidates it tries, and whether this is a dry run
    design: str = "ablation"
    others: str = "inherit"
    vary: list[str] | None = None
    candidate: list[str] | None = None
    dry_run: bool = False
    # what checking the options found (:func:`checked`): the named toggles (or the model's default
    # ones) a guard turns off for this model, which can take part in no arm
    left_out: tuple[str, ...] = ()

    # --- options -----------------------------------------------------------------------------

    @classmethod
    def add_options(cls, parser: argparse.ArgumentParser, names: Iterable[str],
                    defaults: Mapping[str, Any] | None = None) -> None:
        """Add the options of the fields ``names`` to ``parser``, each as declared here (``defaults``:
        another default for a field, as a command's own)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        defaults = defaults or {}
        for name in names:
            f = fields[name]
            meta = dict(f.metadata)
            flag = meta.pop("flag")
            default = defaults.get(name, f.default if f.default is not dataclasses.MISSING else None)
            if flag is None:
                parser.add_argument(name, **meta)
            elif meta.get("action") == "store_false":
                parser.add_argument(flag, dest=name, **meta)
            else:
                parser.add_argument(flag, dest=name, default=default, **meta)

    @classmethod
    def from_options(cls, ns: argparse.Namespace, **fixed: Any) -> ExperimentSpec:
        """The spec the parsed options say (fields a command has no option for keep their default)."""
        given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        given["megatron_args"] = after_separator(given.get("megatron_args", []))
        return cls(**{**given, **fixed})

    # --- checks ------------------------------------------------------------------------------

    def check(self) -> None:
        """Every check of the options before the first dry run; the first bad value is one line."""
        self.check_options()
        if not Path(self.script).is_file():
            raise DesignError(f"script not found: {self.script}")

    def check_options(self) -> None:
        """The options' values alone (no file is looked at): the first bad one is one line."""
        problems = self._problems()
        if problems:
            raise DesignError(problems[0])

    def _problems(self) -> Sequence[str]:
        rules = [
            (self.repeats < 1, f"--repeats {self.repeats}: at least 1 (3 or more for an interval worth reading)"),
            (self.warmup < 0, f"--warmup {self.warmup}: cannot be negative"),
            (self.iters is not None and self.iters <= self.warmup,
             f"--iters {self.iters} must be more than --warmup {self.warmup}: nothing would be measured"),
            (not 0.5 < self.confidence < 1,
             f"--confidence {self.confidence}: expected a fraction between 0.5 and 1, e.g. 0.95"),
            (not 0 < self.effect < 1, f"--effect {self.effect}: expected a fraction, e.g. 0.01 for 1 %"),
            (self.target_ci is not None and not 0 < self.target_ci < 1,
             f"--target-ci {self.target_ci}: expected a fraction, e.g. 0.01 for +-1 %"),
            (self.budget is not None and self.budget <= 0, f"--budget {self.budget}: expected minutes > 0"),
            (self.world_size is not None and self.world_size < 1, f"--world-size {self.world_size}: at least 1"),
            (self.block_seeds is not None and self.block_seeds < 0, f"--block-seeds {self.block_seeds}: "
             "a seed cannot be negative"),
            (self.loss_window is not None and self.loss_window < 1, f"--loss-window {self.loss_window}: at least 1"),
            (self.loss_window is not None and self.iters is not None and self.loss_window > self.iters,
             f"--loss-window {self.loss_window} is more than --iters {self.iters}"),
            (not self.loss_margin > 0, f"--loss-margin {self.loss_margin}: expected a margin in % above 0, e.g. 1"),
            (not 0 < self.loss_alpha < 0.5, f"--loss-alpha {self.loss_alpha}: expected a level between 0 and 0.5, "
             "e.g. 0.05"),
            (self.concurrent < 1, f"--concurrent {self.concurrent}: at least 1"),
            (self.split_blocks and self.budget is None, "--split-blocks needs --budget"),
            (self.concurrent > 1 and self.target_ci is not None,
             "--target-ci needs timed runs, and --concurrent runs share the GPU: choose one"),
        ]
        problems = [text for bad, text in rules if bad]
        return problems + (self._common_start_problems() if self.common_start else [])

    def _common_start_problems(self) -> list[str]:
        """What the options must give for a common start (loss/common_start.py), one line each."""
        out = []
        if self.block_seeds is None:
            out.append("--common-start needs --block-seeds: it saves one start per seed")
        if any(w.split("=", 1)[0] == "--load" for w in self.megatron_args):
            out.append("--common-start sets --load itself (each seed's start): leave --load out of the arguments")
        return out

    @property
    def named_toggles(self) -> tuple[str, ...]:
        """The on/off toggles ``--toggles`` names, else those that apply to the model the arguments
        describe (:func:`parse_toggles`)."""
        return parse_toggles(self.toggles, self.megatron_args)

    @property
    def model_toggles(self) -> tuple[str, ...]:
        """The on/off toggles that apply to the model the arguments describe (:func:`default_toggles`)."""
        return default_toggles(self.megatron_args)

    @property
    def loss_test(self) -> bool:
        """Whether the results carry the loss test: seeds as blocks, or a loss measure asked for."""
        return self.block_seeds is not None or self.loss_window is not None or self.loss_measure != "auto"

    # --- what the options say about the world the runs have ----------------------------------

    @property
    def launched_world(self) -> int | None:
        """What ``--launch`` plainly starts (None: not plain; see :func:`launch_world_size`)."""
        return launch_world_size(self.launch)

    @property
    def stated_or_launched(self) -> int | None:
        """The world the user said (``--world-size``), else what ``--launch`` plainly starts, else None."""
        return self.world_size if self.world_size is not None else self.launched_world

    @property
    def planned_world(self) -> int:
        """The world the dry runs plan for: ``--world-size``, else what ``--launch`` plainly starts, else 1."""
        return self.stated_or_launched or 1

    @property
    def world_words(self) -> str:
        """Which world the dry runs plan for, and from what, in words: ``--world-size`` where given (it
        wins over the launcher's number, which may miss a launcher nested in a script), else what
        ``--launch`` plainly starts. A launcher whose world is not plain (``--nproc-per-node gpu``,
        elastic nodes, one unknown here) and no ``--world-size`` leave the dry runs at one process,
        where validate_args refuses model parallelism: the words say so."""
        launched, world = self.launched_world, self.planned_world
        if self.world_size is not None:
            source = "--world-size" + (f"; --launch looks like {launched}" if launched not in (None, self.world_size)
                                       else "")
        elif launched is None:
            return "one process (the launcher's world size is not known here: say it with --world-size)"
        elif not self.launch:
            return "one process (no --launch: this python starts each run)"
        else:
            source = "--launch"
        return f"one process (from {source})" if world == 1 else f"a world of {world} (from {source})"

    @property
    def launch_sets(self) -> set[str]:
        """The variables a ``--launch 'env VAR=value ... CMD'`` prefix sets for every run."""
        return env_prefix(shlex.split(self.launch) if self.launch else [])[0]

    @property
    def launched_command(self) -> list[str]:
        """The command ``--launch`` runs, after any ``env VAR=value`` words ([]: this python)."""
        return env_prefix(shlex.split(self.launch) if self.launch else [])[1]


def _option(words: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` in ``words`` (``--x 8``, ``--x=8``), or None."""
    for i, word in enumerate(words):
        key, eq, val = word.partition("=")
        if key in names:
            return val if eq else (words[i + 1] if i + 1 < len(words) else "")
    return None


# Launchers that start the training processes themselves: behind srun or mpirun they multiply the
# count, so the outer launcher's number is not the world.
INNER_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


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
        if any(Path(w).name in INNER_LAUNCHERS for w in words[1:]):
            return None
        count = _option(words, ("-n", "--ntasks") if name == "srun" else ("-np", "-n", "--np", "-c"))
    elif name == "torchrun" or "torch.distributed.run" in words or "torch.distributed.launch" in words:
        per_node = _option(words, ("--nproc-per-node", "--nproc_per_node")) or "1"
        nodes = _option(words, ("--nnodes",)) or "1"
        count = str(int(per_node) * int(nodes)) if per_node.isdigit() and nodes.isdigit() else None
    else:
        return 1 if name.startswith("python") else None  # a script run by python: one process
    return int(count) if count and count.isdigit() and int(count) > 0 else None


SHARED = ("toggles", "launch", "world_size", "out", "repeats", "seed", "iters", "warmup", "warmup_run",
          "confidence", "budget")  # both commands' options; ablate adds the stopping and sizing ones
POSITIONALS = ("script", "megatron_args")


def checked(ns: argparse.Namespace, say: Callable[[str], None] | None = None) -> ExperimentSpec:
    """The stage: the spec the parsed options say, every value checked (the first bad one is one
    line, exit 2), the script there, and the toggles a guard turns off for this model found and
    left out (``left_out``), each named in one line (``say``; default: stderr)."""
    spec = ExperimentSpec.from_options(ns)
    spec.check()
    if spec.design == "candidates":  # the candidates design names no toggles
        return spec
    named = spec.named_toggles
    if spec.design == "each-alone":  # its defaults arm turns on the toggles not named too
        named = tuple(dict.fromkeys((*named, *spec.model_toggles)))
    kept = leave_out(named, spec.script, spec.megatron_args, spec.planned_world, say or _stderr)
    return dataclasses.replace(spec, left_out=tuple(d for d in named if d not in kept))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def leave_out(toggles: tuple[str, ...], script: str, megatron_args: Sequence[str], world: int | None,
              say: Callable[[str], None] = print) -> tuple[str, ...]:
    """``toggles`` less those a guard turns off for this model (planning.guarded_off), each named in one line."""
    from ..planning import guarded_off

    off = guarded_off(toggles, script, megatron_args, world)
    for dest, why in off.items():
        say(f"[ablate] left out {dest}: a guard turns it off for this model ({why})")
    return tuple(d for d in toggles if d not in off)
