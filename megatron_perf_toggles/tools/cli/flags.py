"""``flags``: the Megatron flags the environment implies, decided against the target Megatron, for
shell scripts that run Megatron without the plugin.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ...core.decision.decide import requested
from ...core.env import read_env
from ...core.registry import TOGGLES
from ...runtime import surface_replay as replay
from ...runtime.machine import target as planned
from ..planning import DEFAULT_SURFACE, plan_command_line
from .options import _explain_target, _megatron_args, _planning_options, profile_named


def _stock_flags(tree: str | None, surface: str | None, elsewhere: bool) -> tuple[set[str], dict[str, Any]]:
    """The option strings the target Megatron has by itself (without the plugin), and its defaults
    (``elsewhere``: for another machine's plan, as ``explain`` reads the checkout)."""
    if tree:
        from ...launcher.import_shims import megatron_importable
        from ...runtime.process_changes import PROCESS_CHANGES
        from ..surfaces.record import describe_parser, megatron_parser

        with PROCESS_CHANGES.scope(), megatron_importable(tree, elsewhere=elsewhere):  # leaves the process as it was
            actions = describe_parser(megatron_parser())
    else:
        actions = replay.load_surface(surface or DEFAULT_SURFACE)["actions"]
    return ({flag for a in actions for flag in a["flags"]},
            {a["dest"]: a["default"] for a in actions})


def cmd_flags(ns: argparse.Namespace) -> int:
    """The flags the environment implies, decided against the target Megatron: what its guards
    would turn off is left out (a ``#`` line on stderr says why), so pasting the output into a
    launch never turns a guarded default into a refused explicit request."""
    env = read_env(os.environ)
    profile = profile_named(env)
    megatron_args = _megatron_args(ns)
    target = _explain_target(ns)
    plan = plan_command_line(megatron_args, tree=ns.megatron, surface=ns.megatron_version, target=target)[0]
    stock, defaults = _stock_flags(ns.megatron, ns.megatron_version, planned.elsewhere(target))
    words: list[str] = []
    why_not: list[str] = []
    for t in TOGGLES:
        if ns.group != "all" and t.script_bucket != ns.group:
            continue
        decision = plan.decisions[t.dest]
        asked = requested(t.dest, env, profile)
        if asked.source == "default" and not env.plugin_enabled:
            continue  # MEGATRON_PERF_TOGGLES=0: Megatron's defaults, so no flag
        value = asked.value
        flag = t.flag_for(value)
        if decision.value != value:
            why_not.append(f"# {' '.join(flag)} left out: {decision.reason}")
        elif flag[0] not in stock and defaults.get(t.dest) == value:
            why_not.append(f"# {' '.join(flag)} left out: already this Megatron's default")
        elif flag[0] not in stock:
            why_not.append(f"# {' '.join(flag)} left out: this Megatron has no {flag[0]} by itself "
                           "(the launcher or the provider adds it)")
        else:
            words.extend(flag)
    for line in why_not:
        print(line, file=sys.stderr)
    print(" ".join(words))
    return 0


def _add_flags(sub: Any) -> None:
    fl = sub.add_parser("flags", help="print the Megatron flags the environment implies, as the target accepts them",
                        description="Print the toggle flags that the current environment implies, for shell "
                        "scripts that keep GPT_ARGS / EXTRA_ARGS buckets and run Megatron without the plugin. "
                        "The flags are decided against the target Megatron (recorded surface 'main' by default, "
                        "or --megatron PATH) for a command line (the built-in Llama-3-8B one, or yours after --): "
                        "a flag whose default a guard turns off, or that the target lacks without the plugin, "
                        "is left out, with a '#' line on stderr saying why. stdout holds the flags alone.")
    fl.add_argument("--group", choices=("gpt", "extra", "all"), default="all",
                    help="gpt: transformer and mixed-precision flags, plus gradient accumulation fusion (as the "
                    "originating train_llama3.sh routed it); extra: distributed and training flags")
    _planning_options(fl, "a Megatron-LM checkout to decide against",
                      "a recorded Megatron surface to decide against (default: main)")
    fl.set_defaults(func=cmd_flags)

