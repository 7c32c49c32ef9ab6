"""Planning one command line without running it: the decisions ``explain``, ``ablate`` and
``tune`` rest on, through a recorded Megatron surface or a checkout's own pretrain_gpt.py.

Its own module, below ``cli`` and ``ablate``, so that both can plan without importing each other.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core import launch_env
from ..core.decision.decide import Plan
from ..core.facts import Capabilities, megatron_facts_from_surface
from ..core.launch_env import LaunchVar
from ..core.registry import BY_DEST
from ..errors import PerfTogglesError
from ..runtime import surface_replay as replay
from ..runtime.machine import target as planned
from ..runtime.machine.capabilities import for_plan
from . import megatron_usage

DEFAULT_SURFACE = replay.DEFAULT_SURFACE


def checkout_script(tree: str) -> Path:
    """The checkout's pretrain_gpt.py; a path that is no checkout is one error line (checked before
    anything costly, such as asking torch about the GPU)."""
    root = Path(tree)
    script = root / "pretrain_gpt.py"
    if not (root / "megatron" / "training" / "arguments.py").is_file() or not script.is_file():
        raise PerfTogglesError(f"{tree} is not a Megatron-LM checkout (no pretrain_gpt.py and "
                               "megatron/training/arguments.py there)", "pass --megatron /path/to/Megatron-LM")
    return script


def parse_refusal(output: str, code: object) -> PerfTogglesError:
    """What a planning parse that stopped outside the dry run's own refusal says: the last line of
    its output, read as the dry run reads a refusal (``launcher.parse_refusal``)."""
    from ..launcher.parse_refusal import refusal

    return refusal(output if output.strip() else f"exit {code}")


Planned = tuple[Plan, Capabilities, str, dict[str, Any], list[LaunchVar]]


def launch_environment(plan: Plan, caps: Capabilities, args: dict[str, Any]) -> list[LaunchVar]:
    """What the launch must export for this layout: the dry run's rule (``core.launch_env``) on the
    plan's facts, and what the memory plan asks for (the allocator setting where only it makes the
    job fit). A checkout's dry run computes it itself and records it; this is for the plans that
    run no dry run (a recorded surface, a config front end)."""
    return launch_env.needed(args, launch_env.arch_major_of(caps.gpu_arch), caps.te_version) + \
        launch_env.from_memory(plan.memory)


def _captured(tree: str, megatron_args: Sequence[str], target: planned.Target | None) -> Any:
    """The run context of a launcher dry run of the tree's pretrain_gpt.py (launcher/parse_hooks.py)
    that handed its record back: the same providers, parse, validate_args, planned world and GPU."""
    import contextlib
    import io
    import runpy

    from ..launcher import parse_hooks as hooks
    from ..launcher.import_shims import megatron_importable
    from ..runtime.controller import new_context
    from ..runtime.provider import extra_args_provider

    script = checkout_script(tree)
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    chatter = io.StringIO()  # Megatron's own printing and warnings; the explanation is ours
    # This entry point's run context: a dry run that hands its record back. Leaving the block undoes
    # what the planning run changed (parse hooks, safety net, import shims) and restores the slot.
    ctx = new_context("planning", mode="plan", target=target, controller=False)
    try:
        with ctx, ctx.until_stopped(), megatron_importable(tree, elsewhere=planned.elsewhere(target)), \
                contextlib.redirect_stdout(chatter), \
                contextlib.redirect_stderr(chatter):
            hooks.hook_parse_path([extra_args_provider], dry_run=True, target=target, capture=True, context=ctx)
            sys.argv = [str(script), *megatron_args]
            sys.path.insert(0, str(script.resolve().parent))
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:  # Megatron's argparse refused the command line (its message is the last line)
        raise parse_refusal(chatter.getvalue(), done.code) from None
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    if ctx.record is None:
        raise PerfTogglesError(f"{script} ended before Megatron parsed its arguments")
    if ctx.plan is None or ctx.capabilities is None:
        raise PerfTogglesError(f"{script} did not reach the plugin", "is it Megatron's pretrain_gpt.py?")
    return ctx


def checkout_label(caps: Capabilities) -> str:
    """Where a checkout's plan came from, for people."""
    return f"Megatron-LM {caps.megatron.version} at {caps.megatron.path} (its pretrain_gpt.py, parse and validate)"


def _megatron_run(tree: str, megatron_args: Sequence[str], target: planned.Target | None) -> Planned:
    """Decide exactly as a launcher dry run of the tree's pretrain_gpt.py does; the record is handed
    back, not printed."""
    ctx = _captured(tree, megatron_args, target)
    caps = ctx.capabilities
    label = checkout_label(caps)
    launch = [LaunchVar(**var) for var in ctx.record["launch_environment"]]  # as the dry run worked it out
    return ctx.plan, caps, label, ctx.record["effective_args"], launch


def validated_arguments(tree: str, megatron_args: Sequence[str], target: planned.Target | None
                        ) -> tuple[Plan, str, Any]:
    """The plan and the namespace Megatron's validate_args left (its own types, not the record's text)
    of a dry run of the tree's pretrain_gpt.py: what a tool that builds Megatron's modules needs."""
    plan, _caps, label, ns = validated_run(tree, megatron_args, target)
    return plan, label, ns


def validated_run(tree: str, megatron_args: Sequence[str], target: planned.Target | None
                  ) -> tuple[Plan, Capabilities, str, Any]:
    """``validated_arguments`` with the capabilities the plan rests on: a tool that sets its process up
    as a run of the plan would (the wgrad fallback) needs to know which of them were only assumed."""
    ctx = _captured(tree, megatron_args, target)
    return ctx.plan, ctx.capabilities, checkout_label(ctx.capabilities), ctx.args


def plan_command_line(
    megatron_args: Sequence[str], tree: str | None = None, surface: str | None = None,
    environ: dict[str, str] | None = None, target: planned.Target | None = None,
) -> Planned:
    """Decide the toggles for ``megatron_args`` without announcing or writing anything: the plan,
    the capabilities it rests on, where Megatron's parser came from, the parsed arguments and the
    launch environment the layout needs (worked out once, here or by the dry run).

    With ``tree``: the launcher's dry run of its pretrain_gpt.py. Without: the recorded surface,
    with the same capability detection as that dry run (torch and TE imported where installed; on a
    machine where no GPU can be visible, torch's build file answers instead of a 2 s import)."""
    from ..runtime.controller import new_controller
    from ..runtime.provider import attach

    if tree:
        return _megatron_run(tree, megatron_args, target)
    environ = dict(os.environ if environ is None else environ)
    name = surface or DEFAULT_SURFACE
    try:
        recorded = replay.load_surface(name)
    except KeyError as error:
        raise PerfTogglesError(str(error.args[0])) from None
    parser = replay.parser_from_surface(recorded, megatron_usage.named(name))  # a mistake is one line
    controller = new_controller(environ, mode="plan", target=target)  # validates the environment first, as a run would
    label = f"recorded Megatron-LM surface {name!r} (--megatron PATH: a checkout's own parser)"
    # the planned world and GPU hold for the whole plan, as in a dry run: the capabilities follow
    # the one rule the dry run follows (capabilities.for_plan), the memory guard sees the world
    with planned.stand_ins(target, megatron=False):
        caps = for_plan(controller.env.assume, deep=True, target=target,
                        megatron=megatron_facts_from_surface(recorded), env=controller.env)
        controller.capabilities = caps
        attach(parser, controller=controller)
        ns = parser.parse_args(list(megatron_args))
    assert controller.last is not None  # the parse went through the controller
    plan = controller.last.plan
    return plan, caps, label, vars(ns), launch_environment(plan, caps, vars(ns))


# --- which toggles a guard turns off for a command line (ablate's designs leave them out) ----------


def surface_for(script: str) -> str:
    """The recorded surface of the checkout that holds ``script`` (its version), else main's."""
    from .patching import inspect_tree, patch_set_for

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
    environ = dict(os.environ if environ is None else environ)
    environ.update({BY_DEST[d].env: "1" for d in toggles})
    surface = surface_for(script)
    target = planned.make_target(world_size=world if world and world > 1 else None)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            plan = plan_command_line(list(megatron_args), surface=surface, environ=environ, target=target)[0]
    except (PerfTogglesError, SystemExit):
        return {}
    return {d: plan.decisions[d].reason for d in toggles if plan.decisions[d].value is not True}
