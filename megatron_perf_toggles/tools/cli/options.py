"""What ``explain`` and ``flags`` plan against: a checkout or a recorded surface, the planned
machine, the profile, and the Megatron command line after ``--``.

Both commands take the same options and read them the same way, so the reading lives here once.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from ...core.env import EnvSettings, read_env
from ...core.profile import Profile
from ...runtime import profile_file
from ...runtime import surface_replay as replay
from ...runtime.machine import target as planned
from ..llama3_8b import EXAMPLE_WORLD, LLAMA3_8B_EXAMPLE
from ..planning import checkout_script


def _megatron_args(ns: argparse.Namespace) -> list[str]:
    """The Megatron command line to plan (the reference model's without one). A toggle's flag
    and its --no- form together is one line here, before the target may ask torch about the GPU."""
    from ...runtime.provider import refuse_contradictions

    megatron_args = list(ns.megatron_args) or list(LLAMA3_8B_EXAMPLE)
    refuse_contradictions(megatron_args)
    return megatron_args


def target_from(ns: argparse.Namespace) -> planned.Target:
    """What to plan for; a ``--megatron`` that is no checkout is one line first (the target may
    ask torch about this machine's GPU, which takes seconds)."""
    if getattr(ns, "megatron", None):
        checkout_script(ns.megatron)
    return planned.from_options(ns)


def profile_named(env: EnvSettings | None = None) -> Profile | None:
    """The profile MEGATRON_PERF_TOGGLES_PROFILE names, read before any planning: a malformed one
    is one error line here, even where planning runs a checkout whose output is held back."""
    path = (env or read_env(os.environ)).profile_path
    return profile_file.load(path) if path else None


def _explain_target(ns: argparse.Namespace) -> planned.Target:
    """What to plan for: the options, else for the built-in example its own world of eight GPUs
    (explain and flags)."""
    target = target_from(ns)
    if not ns.megatron_args and target.world_size is None:
        target = replace(target, world_size=EXAMPLE_WORLD, world_source="the built-in example's")
    return target


def _target_options(parser: argparse.ArgumentParser) -> None:
    planned.add_options(parser.add_argument_group("what to plan for (as the launcher's --dry-run)"))


def _planning_options(parser: Any, tree_help: str, version_help: str) -> None:
    """What explain and flags plan against: a checkout or a recorded surface, the planned machine,
    and the Megatron command line after --."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--megatron", metavar="PATH", help=tree_help)
    where.add_argument("--megatron-version", metavar="NAME", choices=replay.available(), help=version_help)
    _target_options(parser)
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER, help="Megatron arguments, after --")

