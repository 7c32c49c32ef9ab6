"""``explain``: what the toggles and guards decide for one command line, a Bridge recipe or a
Primus file, printed as a table (or the record as JSON); nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ...core import layout, stock_off
from ...core.decision.plan import Plan
from ...core.env import read_env
from ...core.facts import Capabilities, parse_assume
from ...core.memory.memory_words import FAIL_IF_NO_FIT_HELP, fit_failure
from ...core.precision import LOG_DIR_DESTS
from ...core.profile import Profile
from ...core.registry import format_value
from ...core.stock_off import fallback_installed
from ...errors import report
from ...frontends import explain as explain_frontends
from ...runtime import provenance
from ...runtime.machine import target as planned
from ..planning import DEFAULT_SURFACE, launch_environment, plan_command_line
from .options import _explain_target, _megatron_args, _planning_options, profile_named, target_from
from .output import WGRAD_WORDS, _caps_summary, _profile_summary, _say, _say_export, _table, _width

FACT_NAMES = (("te_version", "Transformer Engine"), ("apex_fused_wgrad", "APEX fused wgrad"),
              ("wgrad_fallback", "torch wgrad fallback"), ("aiter_version", "aiter"), ("device", "device"))


def fact_sources(caps: Capabilities, megatron_source: str) -> list[str]:
    """Where each fact the guards rest on came from: detected here, assumed (ASSUME), planned
    (--gpu), or the recorded surface / the checkout for Megatron's own."""
    out = [f"Megatron facts: {megatron_source}"]
    spec = read_env(os.environ).assume
    named = set(parse_assume(spec)) if spec else set()  # what the variable itself names
    for name, words in FACT_NAMES:
        value = getattr(caps, name)
        if name == "device" and caps.gpu_source and caps.gpu_source != "detected":
            source = f"planned: {caps.gpu_source}"
        elif caps.is_assumed(name) and caps.stack and name not in named:
            source = "planned stack"
        elif caps.is_assumed(name):
            source = "assumed (MEGATRON_PERF_TOGGLES_ASSUME)"
        else:
            source = "detected"
        shown = ("yes" if value else "no") if isinstance(value, bool) else (value or "none")
        if name == "wgrad_fallback" and value and not fallback_installed(caps, read_env(os.environ)):
            shown = "can run here, not installed (the plugin is off or MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK=0)"
        out.append(f"{words}: {shown} ({source})")
    return out


def _check_world(ns: argparse.Namespace, target: planned.Target, args: dict[str, Any], front: bool,
                 caps: Capabilities) -> None:
    """Where no validate_args was asked (a recorded surface, a Bridge recipe, a Primus file), a world
    that the layout does not divide is one line, as Megatron's check would be (core.layout), by the
    rules of the Megatron planned for."""
    if ns.megatron and not front:
        return
    world = planned.planned_world(target, os.environ) or 1
    layout.check(world, args, target.world_source or ("WORLD_SIZE" if target.world_size is None
                                                      and "WORLD_SIZE" in os.environ else ""),
                 groups_may_divide_tp=caps.megatron.has_rule("gqa_groups_divide_tp"))


def planned_layout(target: planned.Target, args: dict[str, Any]) -> dict[str, Any]:
    """The layout the plan is for (``core.layout.parallel``): the command line's, or the recipe's or
    experiment file's, on the planned world."""
    return layout.parallel(planned.planned_world(target, os.environ) or 1, args)


def _explain_header(ns: argparse.Namespace, caps: Capabilities, label: str, target: planned.Target,
                    profile: Profile | None, width: int | None, megatron_source: str, front: bool,
                    parallel: dict[str, Any]) -> None:
    """Who plans (Megatron), for what (world, GPU, layout), on which stack (one line), and the command."""
    _say(f"Megatron: {label}", width)
    _say(f"Plan for: {planned.describe(target)}", width)
    _say(f"Layout:   {layout.words(parallel)}", width)
    # A plan for another machine names its planned stack alone: nothing of this machine's software.
    _say(f"Stack:    {caps.stack}" if caps.stack else f"Machine:  {_caps_summary(caps)}", width)
    if profile is not None:
        _say(f"Profile:  {_profile_summary(profile)}", width)
    if ns.verbose:
        for line in fact_sources(caps, megatron_source):
            _say(f"  {line}", width)
    if not ns.megatron_args and not front:
        _say("Command:  built-in Llama-3-8B bf16, TP 2, sequence parallel, distributed optimizer (yours after --)",
             width)


def cmd_explain(ns: argparse.Namespace) -> int:
    front = explain_frontends.requested(ns)  # a Bridge recipe or a Primus file instead of a command line
    megatron_args = explain_frontends.command(ns) if front else _megatron_args(ns)
    profile = profile_named()
    target = target_from(ns) if front else _explain_target(ns)
    if front:
        plan, caps, label, args = explain_frontends.plan(ns, target)
        launch = launch_environment(plan, caps, args)
    else:
        plan, caps, label, args, launch = plan_command_line(megatron_args, tree=ns.megatron,
                                                            surface=ns.megatron_version, target=target)
    _check_world(ns, target, args, bool(front), caps)
    parallel = planned_layout(target, args)
    megatron_source = (f"Megatron {caps.megatron.version}, as the front end imports it" if front
                       else f"detected in the checkout {caps.megatron.path}" if ns.megatron
                       else f"recorded surface {ns.megatron_version or DEFAULT_SURFACE!r}")
    if ns.json:
        payload = provenance.build_record(
            plan, caps, read_env(os.environ).raw_for_record(os.environ), megatron_args, megatron=label,
            target={**target.to_record(), "summary": planned.describe(target)}, layout=parallel,
            sources=fact_sources(caps, megatron_source), stack=caps.stack or None,
            launch_environment=[v.to_record() for v in launch])
        print(json.dumps(payload, indent=1, sort_keys=True, default=str))
        return _status(ns, plan)
    width = _width()
    _explain_header(ns, caps, label, target, profile, width, megatron_source, bool(front), parallel)
    print()
    rows = [[dest, format_value(d.value), d.source, provenance.memory_words(plan, dest) or "-", d.reason]
            for dest, d in plan.shown().items()]
    print(_table(rows, ["toggle", "value", "source", "peak memory", "reason"], width))
    if ns.verbose and plan.not_applicable:  # the MoE toggles on a dense model: one line, nothing more
        _say(f"MoE toggles: not a mixture-of-experts model ({', '.join(plan.not_applicable)} stock's own values stand)",
             width)
    if plan.memory is not None:
        from ...core.memory.memory_words import summary

        _say(summary(plan.memory), width)
    _say(f"precision tag: {plan.precision}; fused wgrad path: {WGRAD_WORDS[plan.wgrad_path]}", width)
    for dest in LOG_DIR_DESTS:
        if args.get(dest):
            _say(f"{dest}: {args[dest]}", width)
    if not plan.log_dirs and any(args.get(d) for d in LOG_DIR_DESTS):
        _say(f"(log directories not tagged: {stock_off.untagged_because(read_env(os.environ))})", width)
    for var in launch:
        _say_export(var.name, var.value, var.why, width)
    for m in plan.messages:
        _say(f"{m.level}: {m.text}", width)
    return _status(ns, plan)


def _status(ns: argparse.Namespace, plan: Plan) -> int:
    """0, or where --fail-if-no-fit (MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT=1) asks and the plan does not
    fit the GPU's memory, one line on stderr and errors.DoesNotFitError's status: a plan that does not
    fit is still a plan, so by default explain exits 0."""
    failure = fit_failure(plan.memory) if ns.fail_if_no_fit or read_env(os.environ).fail_if_no_fit else None
    return 0 if failure is None else report(failure)


def _add_explain(sub: Any) -> None:
    ex = sub.add_parser("explain", help="show what the toggles and guards decide for a command line",
                        description="Decide the toggles for a Megatron command line (default: a built-in "
                        "Llama-3-8B bf16 one) and print value, source and reason for each, the precision "
                        "tag and the log directories. Nothing runs. The environment applies as in a run: "
                        "the toggles' variables, and MEGATRON_PERF_TOGGLES_PROFILE=FILE for a profile (its "
                        "values show with source 'profile', and a line says whether it was measured on a "
                        "setup like the one planned for).")
    ex.add_argument("--json", action="store_true", help="print the plan's full JSON record on stdout, and nothing "
                    "else (no table)")
    ex.add_argument("--verbose", action="store_true", help="also say where each fact the plan rests on came from")
    ex.add_argument("--fail-if-no-fit", action="store_true", help=FAIL_IF_NO_FIT_HELP)
    explain_frontends.add_options(ex)
    _planning_options(ex, "a Megatron-LM checkout: use its real parser",
                      "plan against a recorded Megatron surface instead (default: main; for --primus-config "
                      "without a Megatron-LM, the surface of the commit Primus pins)")
    ex.set_defaults(func=cmd_explain)

