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
arguments must resolve to ``--ckpt-format torch_dist``, and may not give ``--load`` themselves
(spec.py checks the options, runs.py makes the start runs from what is here).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..spec import DesignError

NAME = "common-start"  # what the results call a start run (its arm)
LOADS = ("--finetune", "--no-load-optim", "--no-load-rng")
# The start run keeps the arguments' --train-iters (Megatron sizes the learning-rate schedule from
# it, and a warm-up longer than one iteration would fail its check) and stops after the first
# iteration with --exit-interval, which saves.
SAVING = {"--exit-interval": "1", "--save-interval": "1"}


def start_dir(out: Path, seed: int) -> Path:
    return out / "runs" / "start" / f"seed{seed}"


def checkpoint(out: Path, seed: int) -> Path:
    return start_dir(out, seed) / "checkpoint"


def loading(out: Path, seed: int) -> list[str]:
    """What a block's arguments add to load the seed's start: its weights alone."""
    return ["--load", str(checkpoint(out, seed)), *LOADS]


def paths(out: Path, seed: int) -> dict[str, str]:
    """The start run's own paths: where it saves the start, and its log directory."""
    return {"--save": str(checkpoint(out, seed)), "--tensorboard-dir": str(start_dir(out, seed) / "tensorboard")}


def check_record(record: Mapping[str, Any]) -> None:
    """The baseline's resolved arguments must save torch_dist, which loads across expert layouts."""
    fmt = record.get("effective_args", {}).get("ckpt_format")
    if fmt != "torch_dist":
        raise DesignError(f"--common-start: the arguments resolve to --ckpt-format {fmt}, not torch_dist",
                          "a torch_dist checkpoint loads across the expert layouts: pass --ckpt-format torch_dist")
