"""Resume safety: warn when a resumed run's toggles differ from those of the run that wrote the checkpoint.

Each launch appends one line to ``perf_toggles_history.jsonl`` in ``--save``: the checkpoint
iteration it started from and its decisions. The checkpoint a resume loads (iteration L, from
Megatron's ``latest_checkpointed_iteration.txt``) was written by the last launch that started
before L, so a launch that crashed before saving never masks the real one. Most toggles change
numerics only, so a difference is a warning that names it. GRAD_REDUCE_IN_BF16 can also change
the optimizer checkpoint's layout (ckpt_layout.py): the entry records that layout, and a guard in
decide.py keeps the saved value where the other one could not load.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from ..core.decision.decide import Message
from ..core.registry import format_value

HISTORY_NAME = "perf_toggles_history.jsonl"
TRACKER_NAME = "latest_checkpointed_iteration.txt"  # written by Megatron next to its checkpoints


RELEASE = -1  # a "release" tracker: Megatron loads the release/ folder (no iteration; weights only)


def latest_iteration(directory: str | None) -> int | None:
    """The iteration the tracker in ``directory`` names (RELEASE for a release checkpoint), None where
    there is no readable tracker."""
    if not directory:
        return None
    try:
        with open(os.path.join(directory, TRACKER_NAME), encoding="utf-8", errors="replace") as fh:
            text = fh.read().strip()
    except (OSError, ValueError):
        return None
    if text == "release":
        return RELEASE
    return int(text) if text.isdigit() else None


def _start_iteration(entry: Mapping[str, Any]) -> int | None:
    value = entry.get("start_iteration") or 0
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _history(directory: str) -> list[dict[str, Any]]:
    entries = []
    try:
        with open(os.path.join(directory, HISTORY_NAME), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a torn line from a killed launch
                if isinstance(entry, dict) and isinstance(entry.get("decisions", {}), dict) \
                        and _start_iteration(entry) is not None:
                    entries.append(entry)
    except (OSError, ValueError):
        return []
    return entries


def checkpoint_dir(args: Mapping[str, Any]) -> str | None:
    """Where Megatron resumes from: ``--load`` where it holds a checkpoint, else
    ``--pretrained-checkpoint`` where that does (Megatron falls back to it, as a finetune)."""
    load_dir = args.get("load")
    if load_dir and latest_iteration(load_dir) is not None:
        return str(load_dir)
    pretrained = args.get("pretrained_checkpoint")
    if pretrained and latest_iteration(pretrained) is not None:
        return str(pretrained)
    return str(load_dir) if load_dir else None


def loaded_iteration(args: Mapping[str, Any], load_dir: str | None = None) -> int | None:
    """The iteration Megatron will resume from (out of ``load_dir``, default ``checkpoint_dir``):
    ``--ckpt-step`` if given, else the newer of the persistent tracker there and a global
    non-persistent one (RELEASE for a release checkpoint). (A local non-persistent checkpoint is found
    by Megatron's checkpoint manager at run time; it is not looked at here.)"""
    load_dir = load_dir or checkpoint_dir(args)
    if not load_dir:
        return None
    if args.get("ckpt_step"):
        return int(args["ckpt_step"])
    found = [latest_iteration(load_dir)]
    if args.get("non_persistent_ckpt_type") == "global":  # beside the directory Megatron loads from
        found.append(latest_iteration(args.get("non_persistent_global_ckpt_dir")
                                      or os.path.join(load_dir, "non_persistent")))
    known = [i for i in found if i is not None]
    return max(known) if known else None


def format_on_disk(args: Mapping[str, Any], iteration: int, directory: str | None = None) -> str | None:
    """The format of the checkpoint at ``iteration`` (in ``directory``, default ``--load``), told as
    Megatron tells it when it reads a torch_dist or auto-detected checkpoint (a distributed
    checkpoint's metadata.json, the torch format's mp_rank_0* folders, a torch_dcp .metadata,
    fsdp_dtensor under Megatron FSDP); None where that folder cannot be read or holds none of them."""
    folder = "release" if iteration == RELEASE else f"iter_{iteration:07d}"
    try:
        names = os.listdir(os.path.join(str(directory or args.get("load")), folder))
    except (OSError, ValueError):
        return None
    if "metadata.json" in names:
        return "torch_dist"
    if any(n.startswith("mp_rank_0") for n in names):
        return "torch"
    if ".metadata" in names:
        return "fsdp_dtensor" if args.get("use_megatron_fsdp") else "torch_dcp"
    return None


def checkpoint_writer(args: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the launch that wrote the checkpoint this run resumes recorded, or None where there is
    no checkpoint to resume. The history lives beside the checkpoint (the run that saved there
    appended to it); a checkpoint no launch of the plugin recorded is the iteration alone
    (``decisions`` empty), so a guard can tell "nothing recorded" from "nothing to resume". The
    format found on disk comes with it (Megatron reads a torch_dist or auto-detected checkpoint in
    that one)."""
    directory = checkpoint_dir(args)
    loaded = loaded_iteration(args, directory) if directory else None
    if loaded is None or not directory:
        return None
    writers = [e for e in _history(directory) if (_start_iteration(e) or 0) < loaded]
    found = {"iteration": loaded, "load_dir": directory, "format_on_disk": format_on_disk(args, loaded, directory),
             # Megatron loads weights alone from a release checkpoint and from --pretrained-checkpoint
             # (it finetunes from there): no optimizer state
             "weights_only": loaded == RELEASE or directory != str(args.get("load") or "")}
    if not writers:
        return {**found, "decisions": {}, "recorded": False}
    return {**writers[-1], **found}


def compare_with_checkpoint(writer: Mapping[str, Any] | None,
                            decisions: Mapping[str, Mapping[str, Any]]) -> list[Message]:
    """A warning naming each toggle that differs from the checkpoint writer's (after the guards,
    which already restored any value the checkpoint layout depends on)."""
    if not writer:
        return []
    before_values = writer.get("decisions", {})
    diffs = [f"{dest} {format_value(before_values[dest])} -> {format_value(now.get('value'))}"
             for dest, now in decisions.items() if dest in before_values and before_values[dest] != now.get("value")]
    if not diffs:
        return []
    return [Message("warning", f"resuming from {writer.get('load_dir')} (iteration {writer.get('iteration')}) with "
                    "different toggles than the run that saved it: " + ", ".join(diffs)
                    + " (numerics change; the checkpoint layout does not)")]


def new_launch_id() -> str:
    """An id for one launch's history line, so the same launch can rewrite it."""
    return f"{os.getpid()}-{time.time_ns()}"


def record_launch(save_dir: str | None, decisions: Mapping[str, Mapping[str, Any]], precision: str,
                  checkpoint_facts: Mapping[str, Any] | None = None, launch_id: str | None = None) -> None:
    """Append this launch (rank 0 only) to the history beside the checkpoints, with what its
    checkpoints will look like (ckpt_layout.checkpoint_facts)."""
    if not save_dir:
        return
    os.makedirs(save_dir, exist_ok=True)
    entry: dict[str, Any] = {"start_iteration": latest_iteration(save_dir) or 0, "precision": precision,
                             "decisions": {dest: d.get("value") for dest, d in decisions.items()},
                             **(checkpoint_facts or {})}
    path = os.path.join(save_dir, HISTORY_NAME)
    if launch_id:
        entry["launch"] = launch_id
        marker = f'"launch": "{launch_id}"'
        if os.path.exists(path):
            # This launch wrote its line already (the safety net changed a decision since): replace it.
            with open(path) as fh:
                lines = fh.readlines()
            if any(marker in line for line in lines):
                with open(path, "w") as fh:
                    fh.writelines(line for line in lines if marker not in line)
    with open(path, "a") as fh:
        fh.write(json.dumps(entry, sort_keys=True) + "\n")
