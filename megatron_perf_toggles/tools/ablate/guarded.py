"""Toggles a guard turns off for this model are left out of a design before any dry run.

A design that asks for fused single-QKV RoPE on a model with q/k layer norm cannot have that
toggle on in any arm: the guard turns it off, and the confound check would refuse the whole
design after a minute of dry runs. So the design's toggles are decided first, in well under a
second, against the recorded argument surface of the Megatron at hand (``explain``'s planning,
the same guards and planned machine as the dry runs): each toggle that would not stay on is left
out, with one line that says why. A headline then compares the defaults as they resolve for this
model with all off.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from pathlib import Path

from ...core.registry import BY_DEST
from ...errors import PerfTogglesError
from ...runtime.machine import target as planned


def surface_for(script: str) -> str:
    """The recorded surface of the checkout that holds ``script`` (its version), else main's."""
    from ...runtime import surface_replay as replay
    from ..patching import inspect_tree, patch_set_for

    try:
        name = patch_set_for(inspect_tree(Path(script).resolve().parent))
    except PerfTogglesError:
        return "main"
    return name if name in replay.available() else "main"


def guarded_off(toggles: Sequence[str], script: str, megatron_args: Sequence[str], world: int | None,
                environ: dict[str, str] | None = None) -> dict[str, str]:
    """``{dest: why}`` for each of ``toggles`` that a guard turns off for this model even when asked
    for by its variable. Where the command line cannot be planned without Megatron (an argument the
    recorded surface lacks), nothing is left out here: the dry runs still check every arm."""
    from ..planning import plan_command_line

    environ = dict(os.environ if environ is None else environ)
    environ.update({BY_DEST[d].env: "1" for d in toggles})
    target = planned.make_target(world_size=world if world and world > 1 else None)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            plan = plan_command_line(list(megatron_args), surface=surface_for(script),
                                     environ=environ, target=target)[0]
    except (PerfTogglesError, SystemExit):
        return {}
    return {d: plan.decisions[d].reason for d in toggles if plan.decisions[d].value is not True}


def leave_out(toggles: tuple[str, ...], script: str, megatron_args: Sequence[str], world: int | None,
              say: object = print) -> tuple[str, ...]:
    """``toggles`` less those a guard turns off for this model, each named in one line."""
    off = guarded_off(toggles, script, megatron_args, world)
    for dest, why in off.items():
        say(f"[ablate] left out {dest}: a guard turns it off for this model ({why})")  # type: ignore[operator]
    return tuple(d for d in toggles if d not in off)
