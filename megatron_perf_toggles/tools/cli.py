"""``megatron-perf-toggles``: explain, flags, doctor, patch, ablate, tune, surface.

Every command is a subparser of one parser; every error, a usage error included, is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from .._version import __version__
from ..core import layout
from ..core.decision.decide import Plan, requested
from ..core.env import EnvSettings, read_env
from ..core.facts import Capabilities, MegatronFacts, describe_stack, parse_assume
from ..core.precision import LOG_DIR_DESTS
from ..core.profile import ENVIRONMENT_WORDS, Profile
from ..core.registry import SETTINGS, TOGGLES, format_value
from ..errors import OneLineArgumentParser, PerfTogglesError, fail
from ..frontends import explain as explain_frontends
from ..launcher import screen
from ..runtime import profile_file, provenance
from ..runtime import surface_replay as replay
from ..runtime.controller import Registration, new_context
from ..runtime.machine import target as planned
from ..runtime.machine.capabilities import detect, megatron_facts, resolve
from ..runtime.machine.probe import installed, torch_module
from . import megatron_usage
from .llama3_8b import EXAMPLE_WORLD, LLAMA3_8B_EXAMPLE, llama3_8b_args
from .planning import DEFAULT_SURFACE, checkout_script, launch_environment, plan_command_line

WGRAD_WORDS = {
    "apex": "APEX fused_weight_gradient_mlp_cuda",
    "fallback": "torch fallback (addmm, fp32 accumulation) in place of APEX",
    "off": "off (gradient accumulation fusion is off)",
    "missing": "none: fusion is on as Megatron's own default (MEGATRON_PERF_TOGGLES=0), and Megatron will need "
               "APEX's fused_weight_gradient_mlp_cuda at the first backward",
}


# --- explain ----------------------------------------------------------------------------------


# The narrowest the last column of a table may be beside the others; narrower, it goes under them.
MIN_LAST_COLUMN = 50
UNDER_INDENT = "    "


def _width() -> int | None:
    """The columns to fit the text to: ``COLUMNS`` where set (a pipe too), else the terminal's.
    None when the output goes to a pipe or a file: tools and grep get each line whole."""
    return screen.width(sys.stdout)


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(width, 1), break_long_words=False, break_on_hyphens=False) or [""]


def _table(rows: list[list[str]], header: list[str], width: int | None = None) -> str:
    """Columns padded to their widest cell. With ``width``, the last column (the reason, the
    longest) is wrapped to fit beside the others, or, where that would leave it narrower than
    MIN_LAST_COLUMN, wrapped on lines of its own under each row."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if width is not None and width - indent < min(widths[-1], MIN_LAST_COLUMN):
        fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1])

        def head(cells: list[str]) -> list[str]:  # the other columns, on one line where it fits
            line = fmt.format(*cells).rstrip()
            return [line] if len(line) <= width else _wrap("  ".join(cells), width)

        lines = [*head(header[:-1]), UNDER_INDENT + header[-1], "-" * min(indent, width)]
        for row in rows:
            lines += head([str(cell) for cell in row[:-1]])
            lines += [UNDER_INDENT + part for part in _wrap(str(row[-1]), width - len(UNDER_INDENT))]
        return "\n".join(line.rstrip() for line in lines)
    if width is not None:
        widths[-1] = min(widths[-1], width - indent)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    for row in rows:
        last = _wrap(str(row[-1]), widths[-1])
        lines.append(fmt.format(*row[:-1], last[0]))
        lines += [" " * indent + more for more in last[1:]]
    return "\n".join(line.rstrip() for line in lines)


def _say(text: str, width: int | None, more: str = UNDER_INDENT) -> None:
    """A line of prose, wrapped to ``width`` where there is one, its continuation lines starting
    with ``more``. Long words (paths) are not broken: they stay whole, to copy."""
    print(textwrap.fill(text, width, subsequent_indent=more, break_long_words=False, break_on_hyphens=False)
          if width else text)


def _say_export(name: str, value: str, why: str, width: int | None) -> None:
    """``export NAME=VALUE  # why``; where that does not fit, the why wraps on comment lines of
    its own, so that the lines still paste into a shell."""
    export = f"launch environment: export {name}={value}"
    if width is None or len(export) + len(why) + 4 <= width:
        print(f"{export}  # {why}")
    else:
        print(export)
        _say(f"{UNDER_INDENT}# {why}", width, more=UNDER_INDENT + "# ")


def _caps_summary(caps: Capabilities) -> str:
    bits = [
        f"TE {caps.te_version}" if caps.te_version else "no TE",
        "APEX fused wgrad" if caps.apex_fused_wgrad else "no APEX fused wgrad",
        f"aiter {caps.aiter_version}" if caps.aiter_version else "no aiter",
        f"torch {caps.torch_version}" if caps.torch_version else "no torch",
        f"{caps.device} {caps.gpu_arch}" if caps.gpu_arch else (caps.device or "no device"),
    ]
    return ", ".join(bits)


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
        out.append(f"{words}: {shown} ({source})")
    return out


def _megatron_args(ns: argparse.Namespace) -> list[str]:
    """The Megatron command line to plan (the reference model's without one). A toggle's flag
    and its --no- form together is one line here, before the target may ask torch about the GPU."""
    from ..runtime.provider import refuse_contradictions

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


def _profile_summary(profile: Profile) -> str:
    env = profile.environment
    facts = ", ".join(f"{ENVIRONMENT_WORDS[k]} {getattr(env, k)}" for k in ENVIRONMENT_WORDS
                      if getattr(env, k) is not None)
    when = f" on {profile.created}" if profile.created else ""
    return (f"{profile.source}: {len(profile.toggles)} toggle(s), measured{when}"
            + (f" with {facts}" if facts else " (no environment recorded)"))


def _explain_target(ns: argparse.Namespace) -> planned.Target:
    """What to plan for: the options, else for the built-in example its own world of eight GPUs
    (explain and flags)."""
    target = target_from(ns)
    if not ns.megatron_args and target.world_size is None:
        target = replace(target, world_size=EXAMPLE_WORLD, world_source="the built-in example's")
    return target


def _check_world(ns: argparse.Namespace, target: planned.Target, args: dict[str, Any], front: bool) -> None:
    """Where no validate_args was asked (a recorded surface, a Bridge recipe, a Primus file), a world
    that the layout does not divide is one line, as Megatron's check would be (core.layout)."""
    if ns.megatron and not front:
        return
    world = planned.planned_world(target, os.environ) or 1
    layout.check(world, args, target.world_source or ("WORLD_SIZE" if target.world_size is None
                                                      and "WORLD_SIZE" in os.environ else ""))


def _explain_header(ns: argparse.Namespace, caps: Capabilities, label: str, target: planned.Target,
                    profile: Profile | None, width: int | None, megatron_source: str, front: bool) -> None:
    """Who plans (Megatron), for what (world, GPU), on which stack (one line), and the command."""
    _say(f"Megatron: {label}", width)
    _say(f"Plan for: {planned.describe(target)}", width)
    # A plan for another machine names its planned stack alone: nothing of this machine's software.
    _say(f"Stack:    {describe_stack(caps, hint=False)}" if caps.stack else f"Machine:  {_caps_summary(caps)}", width)
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
    _check_world(ns, target, args, bool(front))
    megatron_source = (f"Megatron {caps.megatron.version}, as the front end imports it" if front
                       else f"detected in the checkout {caps.megatron.path}" if ns.megatron
                       else f"recorded surface {ns.megatron_version or DEFAULT_SURFACE!r}")
    if ns.json:
        payload = provenance.build_record(
            plan, caps, read_env(os.environ).raw_for_record(os.environ), megatron_args, megatron=label,
            target={**target.to_record(), "summary": planned.describe(target)},
            sources=fact_sources(caps, megatron_source), stack=caps.stack or None,
            launch_environment=[v.to_record() for v in launch])
        print(json.dumps(payload, indent=1, sort_keys=True, default=str))
        return 0
    width = _width()
    _explain_header(ns, caps, label, target, profile, width, megatron_source, bool(front))
    print()
    rows = [[dest, format_value(d.value), d.source, provenance.memory_words(plan, dest) or "-", d.reason]
            for dest, d in plan.shown().items()]
    print(_table(rows, ["toggle", "value", "source", "peak memory", "reason"], width))
    if ns.verbose and plan.not_applicable:  # the MoE toggles on a dense model: one line, nothing more
        _say(f"MoE toggles: not a mixture-of-experts model ({', '.join(plan.not_applicable)} left as Megatron's)",
             width)
    if plan.memory is not None:
        from ..core.memory.memory_guard import summary

        _say(summary(plan.memory), width)
    _say(f"precision tag: {plan.precision}; fused wgrad path: {WGRAD_WORDS[plan.wgrad_path]}", width)
    for dest in LOG_DIR_DESTS:
        if args.get(dest):
            _say(f"{dest}: {args[dest]}", width)
    if not plan.log_dirs and any(args.get(d) for d in LOG_DIR_DESTS):
        _say("(log directories not tagged: MEGATRON_PERF_TOGGLES_TAG_LOG_DIR=0)", width)
    for var in launch:
        _say_export(var.name, var.value, var.why, width)
    for m in plan.messages:
        _say(f"{m.level}: {m.text}", width)
    return 0


# --- flags ------------------------------------------------------------------------------------


def _stock_flags(tree: str | None, surface: str | None) -> tuple[set[str], dict[str, Any]]:
    """The option strings the target Megatron has by itself (without the plugin), and its defaults."""
    if tree:
        from ..launcher.import_shims import megatron_importable
        from ..runtime.process_changes import PROCESS_CHANGES
        from .surfaces.record import describe_parser, megatron_parser

        with PROCESS_CHANGES.scope(), megatron_importable(tree):  # reading the flags leaves the process as it was
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
    plan = plan_command_line(megatron_args, tree=ns.megatron, surface=ns.megatron_version,
                             target=_explain_target(ns))[0]
    stock, defaults = _stock_flags(ns.megatron, ns.megatron_version)
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


# --- doctor -----------------------------------------------------------------------------------


def _doctor_megatron(tree: str | None) -> tuple[MegatronFacts | None, str | None]:
    """The facts of the Megatron in use (importing it, no parser built), or why there is none.

    A checkout named with --megatron that is missing or does not import is an error (exit 2);
    with none named, "not importable" is part of the report."""
    import importlib.util

    from ..launcher.import_shims import import_failure, megatron_importable
    from ..runtime.process_changes import PROCESS_CHANGES

    if tree is not None and not os.path.isfile(os.path.join(tree, "megatron", "training", "arguments.py")):
        raise PerfTogglesError(f"--megatron {tree}: not a Megatron-LM checkout (no megatron/training/arguments.py)",
                               "pass the directory that holds pretrain_gpt.py")
    if tree is None and importlib.util.find_spec("megatron") is None:
        return None, "not importable (put the Megatron-LM checkout on PYTHONPATH, or pass --megatron PATH)"
    try:
        with PROCESS_CHANGES.scope(), megatron_importable(tree):  # a report changes nothing
            import megatron.training.arguments  # noqa: F401 - what megatron_facts() inspects
    except Exception as error:  # noqa: BLE001 - any import failure is one line
        what, hint = import_failure(error)
        if tree is not None:
            raise PerfTogglesError(f"cannot import Megatron-LM from {tree}: {what}", hint) from None
        return None, f"cannot import Megatron-LM from PYTHONPATH: {what}"
    return megatron_facts(), None


def _machine_diagnosed() -> Capabilities:
    """This machine's capabilities for ``doctor``: torch imported, as a run imports it (a plan may
    read its build file instead), and a torch that is installed but does not import named."""
    broken = installed("torch") and torch_module() is None
    caps = detect(deep=True)
    if broken:
        caps = replace(caps, notes={**caps.notes, "torch": "torch is installed but does not import "
                                                            "(python -c 'import torch' shows why)"})
    return caps


def _te_report(caps: Capabilities) -> dict[str, Any]:
    """Transformer Engine and its kernels the toggles use, for doctor's JSON."""
    return {"version": caps.te_version, "fused_qkv_rope_kernel": caps.te_fused_qkv_rope,
            "cross_entropy_kernel": caps.te_cross_entropy, "grouped_linear": caps.te_grouped_linear,
            "moe_permutation_kernels": caps.te_fused_permute, "moe_router_kernels": caps.te_fused_router}


def _doctor_plan(caps: Capabilities) -> tuple[Plan, EnvSettings, Profile | None, Capabilities]:
    """What the toggles decide on this machine (or the one MEGATRON_PERF_TOGGLES_ASSUME plans),
    for a Llama-style bf16 run: doctor's process object comes from the factory like every entry
    point's, reads the environment and profile once, and plans through its controller."""
    ctx = new_context("doctor", os.environ, mode="plan", announce=False)
    controller = ctx.controller
    assert controller is not None, "new_context makes the controller"
    env, profile = controller.env, controller.profile
    assumed = resolve(env.assume) if env.assume else None
    effective = replace(assumed, megatron=caps.megatron) if assumed else caps
    controller.capabilities, controller.observing = effective, "doctor"
    view = argparse.Namespace(**_llama_view())
    return controller.plan(view, Registration(controller, {}, ())), env, profile, effective


def cmd_doctor(ns: argparse.Namespace) -> int:
    facts, why_not = _doctor_megatron(ns.megatron)  # a bad --megatron fails before torch is imported
    caps = _machine_diagnosed()
    if facts is not None:
        caps = replace(caps, megatron=facts)
    plan, env, profile, effective = _doctor_plan(caps)
    report = {
        "megatron": asdict(facts) if facts is not None else {"error": why_not},
        "torch": {"version": caps.torch_version, "device": caps.device},
        "gpu_arch": caps.gpu_arch,
        "transformer_engine": _te_report(caps),
        "apex_fused_wgrad": caps.apex_fused_wgrad,
        "aiter": caps.aiter_version,
        "notes": caps.notes,
        "toggles_here": {dest: d.to_record() for dest, d in plan.decisions.items()},
        "assumed": list(effective.assumed),
        "wgrad_path": plan.wgrad_path,
        "profile": plan.profile,
    }
    if ns.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
        return 0
    yes = {True: "yes", False: "no", None: "unknown"}
    width = _width()
    _say(f"megatron-perf-toggles {__version__}, Python {sys.version.split()[0]}", width)
    if facts is not None:
        _say(f"Megatron-LM:        {facts.version} at {facts.path}", width)
        _say(f"  fused_single_qkv_rope field: {yes[facts.fused_single_qkv_rope_field]}; "
             f"asserts te cross entropy: {yes[facts.asserts_te_cross_entropy]}", width)
    else:
        _say(f"Megatron-LM:        {why_not}", width)
    backend = {"rocm": "ROCm/HIP", "cuda": "CUDA", "cpu": "CPU only"}.get(caps.device or "", "")
    _say(f"torch:              {caps.torch_version or 'not installed'} {backend}".rstrip(), width)
    _say(f"GPU architecture:   {caps.gpu_arch or 'none visible'}", width)
    _say(f"Transformer Engine: {caps.te_version or 'not installed'}"
         + (f" (fused QKV RoPE kernel: {yes[caps.te_fused_qkv_rope]}, cross-entropy kernel: "
            f"{yes[caps.te_cross_entropy]}; MoE: grouped linear {yes[caps.te_grouped_linear]}, permutation "
            f"{yes[caps.te_fused_permute]}, router {yes[caps.te_fused_router]} (used from TE 2.7))"
            if caps.te_version else ""), width)
    _say(f"APEX fused wgrad:   {yes[caps.apex_fused_wgrad]}", width)
    _say(f"aiter (AMD):        {caps.aiter_version or 'not installed'}", width)
    _say(f"fused wgrad path:   {WGRAD_WORDS[plan.wgrad_path]}", width)
    for note in caps.notes.values():
        _say(f"  note: {note}", width)
    if profile is not None:
        _say(f"profile:            {_profile_summary(profile)}", width)
        for message in plan.messages:
            if message.level == "profile":
                _say(f"  {message.text}", width)
    print()
    label = "Toggles on this machine" + (" (planned via MEGATRON_PERF_TOGGLES_ASSUME)" if env.assume else "")
    _say(f"{label}, for a Llama-style bf16 run:", width)
    rows = [[dest, format_value(d.value), d.reason] for dest, d in plan.shown().items()]  # a dense run: no MoE rows
    print(_table(rows, ["toggle", "value", "why"], width))
    return 0


def _llama_view() -> dict[str, Any]:
    return llama3_8b_args("bf16", "position_embedding_type", "num_layers", "optimizer")


# --- entry ------------------------------------------------------------------------------------


def _env_epilog() -> str:
    lines = ["environment variables:"]
    for t in TOGGLES:
        lines.append(f"  {t.env:<34} {t.help}")
    for s in SETTINGS:
        lines.append(f"  {s.env:<34} {s.help}")
    return "\n".join(lines)


def _target_options(parser: argparse.ArgumentParser) -> None:
    planned.add_options(parser.add_argument_group("what to plan for (as the launcher's --dry-run)"))


def build_cli_parser() -> argparse.ArgumentParser:
    """One parser with a real subparser per command; the offline tools bring their own options."""
    parser = OneLineArgumentParser(
        prog="megatron-perf-toggles",
        description="Default-on Megatron-LM performance toggles: see what they decide, where they can "
        "run, and wire them into a checkout.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_env_epilog(),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_explain(sub)
    _add_flags(sub)
    _add_doctor(sub)
    _add_tools(sub)
    return parser


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
    explain_frontends.add_options(ex)
    _planning_options(ex, "a Megatron-LM checkout: use its real parser",
                      "plan against a recorded Megatron surface instead (default: main; for --primus-config "
                      "without a Megatron-LM, the surface of the commit Primus pins)")
    ex.set_defaults(func=cmd_explain)


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


def _planning_options(parser: Any, tree_help: str, version_help: str) -> None:
    """What explain and flags plan against: a checkout or a recorded surface, the planned machine,
    and the Megatron command line after --."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--megatron", metavar="PATH", help=tree_help)
    where.add_argument("--megatron-version", metavar="NAME", choices=replay.available(), help=version_help)
    _target_options(parser)
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER, help="Megatron arguments, after --")


def _add_doctor(sub: Any) -> None:
    doc = sub.add_parser("doctor", help="report what this machine has and which toggles can be on here",
                         description="Report Megatron, torch (ROCm/CUDA), GPU architecture, Transformer Engine "
                         "and its kernels, APEX and aiter, then which toggles can be on here and why not.")
    doc.add_argument("--megatron", metavar="PATH", help="a Megatron-LM checkout (default: whatever is importable)")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.set_defaults(func=cmd_doctor)


def _add_tools(sub: Any) -> None:
    """patch, ablate, tune, surface: each tool declares its options once, for its own module's parser too."""
    from . import patching
    from .ablate import command as ablate
    from .surfaces import record

    pa = sub.add_parser("patch", help="apply the matching patch from patches/ to a Megatron-LM checkout",
                        description=patching.DESCRIPTION, allow_abbrev=False, message_prefix="")
    patching.add_arguments(pa)
    pa.set_defaults(func=patching.run)
    ab = sub.add_parser("ablate", help="controlled toggle experiments that cannot be confounded",
                        description=ablate.DESCRIPTION, epilog=ablate.EPILOG)
    ablate.add_arguments(ab)
    ab.set_defaults(func=ablate.run_ablation)
    from .tune import command as tune

    tu = sub.add_parser("tune", help="measure the toggles on your command line and write a profile",
                        description=tune.DESCRIPTION, epilog=tune.EPILOG)
    tune.add_arguments(tu)
    tu.set_defaults(func=tune.run_tune)
    su = sub.add_parser("surface", help="record a Megatron tree's argparse surface as JSON facts",
                        description=record.DESCRIPTION)
    record.add_arguments(su)
    su.set_defaults(func=record.run)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the command; every PerfTogglesError, a usage error included, is one line and exit 2."""
    parser = build_cli_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = parser.parse_args(words)
        if ns.command is None:
            parser.print_help()
            return 2
        if ns.command in ("explain", "flags") and ns.megatron_args[:1] == ["--"]:
            ns.megatron_args = ns.megatron_args[1:]
        return ns.func(ns)
    except PerfTogglesError as error:
        fail(megatron_usage.dash_hint(error, words, parser))
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
