"""``--common-start``: every arm of a seed starts from one saved state, so the seed pairs its runs
even where a toggle draws the initial weights another way.

Under one seed, Transformer Engine's grouped experts draw their initial weights in another order
than the sequential experts, so the grouped-GEMM arm and stock do not start from the same weights
and the loss test must compare them unpaired (Welch), which needs far more seeds. With
``--common-start`` each seed's block first runs the baseline for one iteration and saves it
(``runs/start/seedS/checkpoint``); every run of that block, the baseline's too, then loads those
weights alone (Megatron's ``--load DIR --finetune --no-load-optim --no-load-rng``: the iteration,
the optimizer and the random state start afresh, from the seed). The start is the baseline after
one step of its learning-rate warm-up, not its initial draw: Megatron saves no checkpoint at
iteration 0.

A torch_dist checkpoint (Megatron's distributed format) loads across the expert layouts, and one the
plugin's launch recorded, loaded without its optimizer state, leaves every toggle free (its resume
guards keep a toggle at its saved value only where the layout may not load the other); so the
arguments must resolve to ``--ckpt-format torch_dist``, and may not give ``--load`` themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..argv import set_args, with_added
from ..design import Arm, DesignError
from ..runs import Run, arm_command

LOADS = ("--finetune", "--no-load-optim", "--no-load-rng")


def start_dir(out: Path, seed: int) -> Path:
    return out / "runs" / "start" / f"seed{seed}"


def checkpoint(out: Path, seed: int) -> Path:
    return start_dir(out, seed) / "checkpoint"


def loading(args: Sequence[str], out: Path, seed: int) -> list[str]:
    """A block's arguments that load the seed's start: its weights alone."""
    return with_added(args, ["--load", str(checkpoint(out, seed)), *LOADS])


def start_run(out: Path, baseline: Arm, seed: int, launch: str | None, script: str, args: Sequence[str]) -> Run:
    """The run that saves the seed's start: the baseline, one iteration, saved after it (``args``:
    the block's arguments, its --seed set). It keeps the arguments' --train-iters (Megatron sizes
    the learning-rate schedule from it, and a warm-up longer than one iteration would fail its
    check) and stops after the first iteration with --exit-interval, which saves."""
    arm = Arm("common-start", dict(baseline.toggles), dict(baseline.settings), fixed=dict(baseline.fixed),
              adds=dict(baseline.adds))
    here = start_dir(out, seed)
    words = set_args(args, {"--exit-interval": "1", "--save-interval": "1"})
    paths = {"--save": str(checkpoint(out, seed)), "--tensorboard-dir": str(here / "tensorboard")}
    return Run(arm, 0, here, arm_command(launch, script, words, arm, paths))


def check_options(block_seeds: int | None, megatron_args: Sequence[str]) -> list[str]:
    """What the options must give for a common start (problems, one line each)."""
    out = []
    if block_seeds is None:
        out.append("--common-start needs --block-seeds: it saves one start per seed")
    if any(w.split("=", 1)[0] == "--load" for w in megatron_args):
        out.append("--common-start sets --load itself (each seed's start): leave --load out of the arguments")
    return out


def check_record(record: Mapping[str, Any]) -> None:
    """The baseline's resolved arguments must save torch_dist, which loads across expert layouts."""
    fmt = record.get("effective_args", {}).get("ckpt_format")
    if fmt != "torch_dist":
        raise DesignError(f"--common-start: the arguments resolve to --ckpt-format {fmt}, not torch_dist",
                          "a torch_dist checkpoint loads across the expert layouts: pass --ckpt-format torch_dist")
