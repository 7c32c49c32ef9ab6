"""The precision a parsed Megatron namespace really trains in, and log directories tagged with it."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from .registry import flag_of

FP8_RECIPE_TAGS = {
    "delayed": "fp8",
    "tensorwise": "fp8_tensorwise",
    "mxfp8": "mxfp8",
    "blockwise": "fp8_blockwise",
}
FP4_RECIPE_TAGS = {"nvfp4": "nvfp4", "mxfp4": "mxfp4"}
TAGS = ("bf16", "fp16", "fp32", *FP8_RECIPE_TAGS.values(), *FP4_RECIPE_TAGS.values())
LOG_DIR_DESTS = ("tensorboard_dir", "wandb_save_dir")


def precision_tag(args: Mapping[str, Any]) -> str:
    """FP4 wins over FP8 (Megatron quantizes with the narrowest format set); unknown recipes
    keep their own name so the tag never lies."""
    if args.get("fp4"):
        recipe = str(args.get("fp4_recipe") or "nvfp4")
        return FP4_RECIPE_TAGS.get(recipe, f"fp4_{recipe}")
    if args.get("fp8"):
        recipe = str(args.get("fp8_recipe") or "delayed")
        return FP8_RECIPE_TAGS.get(recipe, f"fp8_{recipe}")
    if args.get("fp16"):
        return "fp16"
    if args.get("bf16"):
        return "bf16"
    return "fp32"


def _components(path: str) -> list[str]:
    return [part for part in path.split("/") if part]


def tag_dir(path: str, tag: str) -> str:
    """``path`` with ``tag`` as its last component, unless ``tag`` is already one of its
    components: a launch script may have tagged it itself (``.../bf16/<timestamp>``), and a
    resumed run must log into the same directory. A path that carries only another precision's
    tag gets the true tag appended (``mislabelled`` says which)."""
    if tag in _components(path):
        return path
    trimmed = path.rstrip("/") or path
    return posixpath.join(trimmed, tag)


def mislabelled(path: str, tag: str) -> str | None:
    """The other known precision tag that ``path`` carries as a component while the run trains
    in ``tag``, if any (the first one found)."""
    parts = _components(path)
    if tag in parts:
        return None
    return next((part for part in parts if part in TAGS and part != tag), None)


def tagged_log_dirs(args: Mapping[str, Any], tag: str) -> dict[str, str]:
    """dest -> tagged directory, for the log directories that are set. ``save``/``load`` are
    deliberately absent: checkpoints must stay where resume finds them."""
    return {dest: tag_dir(str(args[dest]), tag) for dest in LOG_DIR_DESTS if args.get(dest)}


def log_dir_warnings(args: Mapping[str, Any], tag: str) -> list[str]:
    """One line per log directory whose path names another precision than the one in use."""
    out = []
    for dest in LOG_DIR_DESTS:
        path = args.get(dest)
        other = mislabelled(str(path), tag) if path else None
        if other:
            out.append(f"{flag_of(dest)} {path} names precision {other!r}, but this run trains in "
                       f"{tag}: logging to {tag_dir(str(path), tag)} instead")
    return out
