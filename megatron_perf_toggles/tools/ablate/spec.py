"""What one experiment is, declared once: ``ExperimentSpec``, from which ``ablate`` and ``tune``
take their shared options (flag, type, default, help), so the two commands cannot drift apart.

Each field's ``metadata`` is its option: ``flag`` (absent for the positional script and Megatron
arguments), ``help`` (the field's documentation, shown by ``--help``), and where needed ``type``,
``metavar`` and ``action``. A field without metadata is no option (set by the caller: a tune
phase's design and confidence). ``--help`` renders ``%(default)s``, so a command may give a field
another default (``--out``) and keep the one help text.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .argv import after_separator, set_args
from .design import DEFAULT_TOGGLES, DesignError
from .loss.common_start import check_options as common_start_problems

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
        "--no-warmup-run", "skip the unmeasured warm-up run before the first block", action="store_false"))
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
        "sharing, so the result then carries no speed figures; no warm-up run); each run gets its own "
        "MASTER_PORT (default %(default)s: one at a time)", type=int, metavar="K"))
    split_blocks: bool = field(default=False, metadata=_opt(
        "--split-blocks", "with --budget, stop before a run, not only before a block, that would not fit; the "
        "same command resumes the block there, so its runs ran in two calls (perhaps on two machines: more "
        "noise in that block's ratios; the results name such blocks)", action="store_true"))
    design: str = "ablation"  # the design's name, as the results record it (not an option of this spec)

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

    def run_args(self) -> list[str]:
        """The Megatron arguments as every run gets them: ``--iters`` sets ``--train-iters``."""
        if self.iters is None:
            return list(self.megatron_args)
        return set_args(self.megatron_args, {"--train-iters": str(self.iters)})

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
        return problems + (common_start_problems(self.block_seeds, self.megatron_args) if self.common_start else [])

    @property
    def loss_test(self) -> bool:
        """Whether the results carry the loss test: seeds as blocks, or a loss measure asked for."""
        return self.block_seeds is not None or self.loss_window is not None or self.loss_measure != "auto"

    def check_measurable(self, iters: Any) -> None:
        """The iterations a run makes (``--iters`` or the arguments' own, as resolved) must leave
        some after the warm-up ones."""
        if isinstance(iters, int) and iters <= self.warmup:
            raise DesignError(f"--train-iters {iters} must be more than --warmup {self.warmup}: "
                              "nothing would be measured")


SHARED = ("toggles", "launch", "world_size", "out", "repeats", "seed", "iters", "warmup", "warmup_run",
          "confidence", "budget")  # both commands' options; ablate adds the stopping and sizing ones
POSITIONALS = ("script", "megatron_args")
