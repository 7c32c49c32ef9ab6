"""The dry run's report: parse and validate exactly as Megatron would, then print what was decided.

The hooks (``parse_hooks``) call :func:`dry_run` in place of Megatron's ``initialize_megatron`` /
``parse_and_validate_args`` when a dry run is asked for. Nothing after validation runs: no global
state, no distributed init, no CUDA. Parse and validate see the planned world and GPU
(``runtime.machine.target``), and every stand-in is undone before the record is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core import launch_env, layout
from ..core.env import rank_of
from ..core.facts import parse_assume
from ..core.memory.memory_words import fit_failure
from ..core.registry import TOGGLES
from ..errors import PerfTogglesError, report
from ..runtime import provenance
from ..runtime.machine import target as planned
from ..runtime.machine.capabilities import effective_assume, gpu_name_here
from ..runtime.process_changes import ProcessChanges
from ..runtime.provenance import jsonable
from . import parse_refusal, screen, summary

if TYPE_CHECKING:  # types only: the hooks call the dry run, so it never imports them when it runs
    from .parse_hooks import Hooks, Provider


def assumed_spec() -> str | None:
    """MEGATRON_PERF_TOGGLES_ASSUME as set (a bad spelling is the controller's one line)."""
    from ..core.env import read_text_setting

    return read_text_setting("MEGATRON_PERF_TOGGLES_ASSUME", os.environ)


class MegatronRejectedError(PerfTogglesError):
    """A dry run's command line that Megatron's own validate_args refuses."""


def _megatron_version() -> str | None:
    info = sys.modules.get("megatron.core.package_info")
    if info is None:
        try:
            info = importlib.import_module("megatron.core.package_info")
        except Exception:  # noqa: BLE001 - the version is informative only
            return None
    return getattr(info, "__version__", None)


def dry_run_record(hooks: Hooks, args: argparse.Namespace, args_defaults: Mapping[str, Any], via: str,
                   notes: list[str], launch: list[launch_env.LaunchVar]) -> dict[str, Any]:
    """The decisions (provenance.build_record) plus where they were made, what Megatron kept, the
    planned target and the launch environment."""
    chain = hooks.last_chain
    outcome, controller = hooks.outcome(), hooks.controller
    plan, caps, environ = None, None, None
    if outcome is not None and controller is not None:
        plan, caps, environ = outcome.plan, outcome.capabilities, controller.env.raw_for_record(controller.environ)
    else:
        notes.append("megatron_perf_toggles.extra_args_provider is not in the provider chain: no decisions")
    names = vars(args)
    return provenance.build_record(
        plan, caps, environ, list(sys.argv),
        dry_run=True,
        megatron={"version": _megatron_version(), "path": hooks.root, "parse_path": via},
        providers=[
            {"name": run.name, "added": {dest: jsonable(names.get(dest)) for dest in run.added}}
            for run in (chain.runs if chain is not None else [])
        ],
        args_defaults={k: jsonable(v) for k, v in args_defaults.items()},
        after_validate={t.dest: jsonable(names[t.dest]) for t in TOGGLES if t.dest in names},
        # Every argument as validate_args left it: what `ablate` compares between arms.
        effective_args={k: jsonable(v) for k, v in sorted(names.items()) if not k.startswith("_")},
        notes=notes,
        # The GPU this process sees (not the planned one): what `tune` writes into a profile.
        gpu_visible=gpu_name_here(),
        target={**(hooks.target or planned.Target()).to_record(), "summary": planned.describe(hooks.target)},
        layout=layout.parallel(_world(names, hooks), names),
        launch_environment=[v.to_record() for v in launch],
    )


def _world(names: Mapping[str, Any], hooks: Hooks) -> int:
    """The world Megatron parsed (its ``world_size``), else the one planned."""
    world = names.get("world_size")
    if isinstance(world, int) and world > 0:
        return world
    return planned.planned_world(hooks.target, os.environ) or 1


class ReportedExit(SystemExit):
    """The dry run ended with its one line already printed (Megatron refused the command line)."""


def assertion_site(error: BaseException) -> str:
    """Where a bare ``assert`` of Megatron's failed: file, line and the assert's source, so that
    "AssertionError" with no message still says which check refused the command line."""
    import linecache
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "no message"
    last = frames[-1]
    where = last.filename
    marker = f"{os.sep}megatron{os.sep}"
    if marker in where:
        where = "megatron" + os.sep + where.rsplit(marker, 1)[1]
    source = (last.line or linecache.getline(last.filename, last.lineno or 0)).strip()
    return f"{where}:{last.lineno}: {source or 'assert'}"


def _rejection(error: BaseException, target: planned.Target | None, log: str | None,
               fix: str | None = None) -> MegatronRejectedError:
    """The one line for Megatron's refusal: its words, then the fix (``fix``: the layout's, as
    ``explain`` names it), then where Megatron's own output went."""
    text = " ".join(str(error).split())
    if isinstance(error, AssertionError) and not text:
        text = f"failed assertion at {assertion_site(error)}"
    hints = [fix] if fix else []
    hints += [f"Megatron's output: {log}"] if log else []
    if not fix and (target is None or target.world_size is None) and "world size" in text.lower():
        hints.append(f"plan for the job's size with --world-size N or {planned.PLAN_ENV}=WORLD:GPU")
    hint = "; ".join(hints) or None
    return MegatronRejectedError(f"Megatron's validate_args rejects this command line for "
                                 f"{planned.describe(target)}: {type(error).__name__}: {text}", hint)


def layout_fix(hooks: Hooks, args: argparse.Namespace, refused: BaseException) -> str | None:
    """Where Megatron refused (``refused``) a layout the planned world cannot hold, the fix
    ``explain`` names for the same mistake (``core.layout``, by the rules of the Megatron planned),
    in the words of the command that asked (``Target.how_world``); None where Megatron refused
    something else."""
    outcome = hooks.outcome()
    caps = outcome.capabilities if outcome is not None else None
    target = hooks.target or planned.Target()
    source = target.world_source or ("WORLD_SIZE" if "WORLD_SIZE" in os.environ else "")
    try:
        layout.check(planned.planned_world(hooks.target, os.environ) or 1, vars(args), source,
                     groups_may_divide_tp=caps is None or caps.megatron.has_rule("gqa_groups_divide_tp"),
                     resize=target.how_world(os.environ))
    except layout.LayoutError as error:
        return error.hint if error.about(str(refused)) else None
    return None


def _launch_vars(args: argparse.Namespace, hooks: Hooks) -> list[launch_env.LaunchVar]:
    """What this layout needs in the launch environment, for the machine the plan is for."""
    outcome = hooks.outcome()
    caps = outcome.capabilities if outcome is not None else None
    gpu = hooks.target.gpu if hooks.target is not None else None
    major = gpu.capability[0] if gpu is not None else launch_env.arch_major_of(caps.gpu_arch if caps else None)
    return launch_env.needed(vars(args), major, caps.te_version if caps else None)


def dry_run(hooks: Hooks, caller: Provider | None, ignore_unknown_args: bool, args_defaults: dict[str, Any],
            parsed_args: argparse.Namespace | None, via: str) -> None:
    """Parse and validate as Megatron's ``via`` would, report the plan, exit 0 (3 with
    ``--fail-if-no-fit`` where the plan does not fit the GPU's memory: errors.DoesNotFitError).

    Nothing after validation runs: no global state, no distributed init, no CUDA. Parse and
    validate see the planned world and GPU (``hooks.target``) and the launch environment the
    layout needs; every stand-in is undone before the plan is printed. By default the report is
    a summary on one screen, and Megatron's own output and the full record go to files whose paths
    it prints (``hooks.output``: ``summary``, ``json`` or ``verbose``). The order is the contract:
    stand-ins in, parse, validate, stand-ins out, then the report.
    """
    notes: list[str] = []
    quiet = hooks.output == "summary" and not hooks.capture
    chatter = hooks.chatter or io.StringIO()  # the launcher's, holding the script's own output so far
    env_changes = ProcessChanges()  # the launch environment, for this parse and validation only
    te_version = parse_assume(effective_assume(assumed_spec(), hooks.target) or "").get("te_version")
    try:
        with contextlib.redirect_stdout(chatter if quiet else sys.stderr), \
                contextlib.redirect_stderr(chatter) if quiet else contextlib.nullcontext(), \
                planned.stand_ins(hooks.target, te_version):
            # a refused parse: one line with its fix (the closest of the parser's flags), exit 2
            with parse_refusal.said_in_one_line(hooks, ReportedExit, lambda: _options(hooks)):
                args = _parsed(hooks, caller, ignore_unknown_args, parsed_args, via, notes)
            if getattr(args, "use_checkpoint_args", False) or args_defaults.get("use_checkpoint_args"):
                notes.append("--use-checkpoint-args: a dry run does not load arguments from the checkpoint")
            launch = _launch_vars(args, hooks)
            set_here = launch_env.missing(launch, os.environ)
            for var in set_here:
                env_changes.set_item(os.environ, var.name, var.value, f"launch environment {var.name}")
            args = _validated(hooks, args, args_defaults, chatter if quiet else None)
    finally:
        env_changes.uninstall()
    outcome = hooks.outcome()
    plan = outcome.plan if outcome is not None else None
    launch += launch_env.from_memory(plan.memory if plan is not None else None)
    payload = dry_run_record(hooks, args, args_defaults, via, notes, launch)
    if hooks.capture:
        hooks.context.stop(payload, plan, args)  # the planning entry point takes them
    rank0 = rank_of(os.environ) == 0
    if rank0:  # one report per job, from rank 0
        _report(hooks, payload, chatter.getvalue() if quiet else None, launch, set_here)
    failure = fit_failure(plan.memory) if hooks.fail_if_no_fit and plan is not None else None
    if failure is not None:  # every rank ends with the status; rank 0 says why, after the report, on the
        # real stderr (in summary mode this process's stderr is held for Megatron's output file)
        with contextlib.redirect_stderr(hooks.err or sys.__stderr__):
            raise ReportedExit(report(failure) if rank0 else failure.exit_code)
    raise SystemExit(0)


def _options(hooks: Hooks) -> list[str]:
    chain = hooks.last_chain
    return chain.options() if chain is not None else []


def _parsed(hooks: Hooks, caller: Provider | None, ignore_unknown_args: bool,
            parsed_args: argparse.Namespace | None, via: str, notes: list[str]) -> argparse.Namespace:
    """The arguments as Megatron's own parse gives them, our providers chained after the caller's."""
    if parsed_args is not None:
        notes.append(f"{via} was given parsed_args: they were validated, not parsed again")
        return parsed_args
    # Chain explicitly: a provider-less parse that ignores unknown arguments looks like one of
    # Megatron's peeks to the parse_args wrapper, which would leave our providers out.
    chain = hooks.chain(caller)
    hooks.last_chain = chain
    return hooks.originals["parse_args"](chain, ignore_unknown_args)


def _validated(hooks: Hooks, args: argparse.Namespace, args_defaults: dict[str, Any], chatter: io.StringIO | None
               ) -> argparse.Namespace:
    """Megatron's own validation of ``args``; where it refuses the command line, that is the answer
    a dry run exists to give: one line (``chatter``: Megatron's output so far, kept in a file)."""
    try:
        if getattr(args, "yaml_cfg", None) is not None:
            from megatron.training.yaml_arguments import validate_yaml

            return validate_yaml(args, args_defaults)
        sys.modules["megatron.training.arguments"].validate_args(args, args_defaults)
        return args
    except (AssertionError, ValueError, RuntimeError, TypeError, KeyError) as error:
        log = _write_files(None, chatter.getvalue())[1] if chatter is not None else None
        rejected = _rejection(error, hooks.target, log, layout_fix(hooks, args, error))
        if hooks.capture:
            raise rejected from None
        # One line and exit status 2 on every path, a patched script's too (nobody above
        # Megatron's entry point would catch the error there), on the real stderr.
        with contextlib.redirect_stderr(hooks.err or sys.__stderr__):
            raise ReportedExit(report(rejected)) from None


def _report(hooks: Hooks, payload: dict[str, Any], chatter: str | None, launch: list[launch_env.LaunchVar],
            set_here: list[launch_env.LaunchVar]) -> None:
    """Rank 0's report: the JSON record (the table on stderr), or the one-screen summary with the
    record and Megatron's output in files, or both (verbose)."""
    out = hooks.out or sys.stdout
    outcome = hooks.outcome()
    plan = outcome.plan if outcome is not None else None
    if hooks.output == "json":
        for line in provenance.lines(plan) if plan is not None else []:
            print(line, file=sys.stderr, flush=True)  # the table for people; the JSON for tools
        print(json.dumps(payload, indent=1, sort_keys=True, default=str), file=out, flush=True)
        return
    record, log = _write_files(payload, chatter)
    caps = outcome.capabilities if outcome is not None else None
    for line in summary.lines(payload, plan, caps, launch, set_here, record, log, hooks.output, screen.width(out)):
        print(line, file=out, flush=True)
    if hooks.output == "verbose":
        print(json.dumps(payload, indent=1, sort_keys=True, default=str), file=out, flush=True)


def _write_files(payload: dict[str, Any] | None, chatter: str | None) -> tuple[str | None, str | None]:
    """The full record and Megatron's own output, in a fresh directory: (record path, log path)."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="perf-toggles-dry-run-")
    record = log = None
    if payload is not None:
        record = os.path.join(directory, "record.json")
        with open(record, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True, default=str)
            fh.write("\n")
    if chatter is not None:
        log = os.path.join(directory, "megatron.log")
        with open(log, "w", encoding="utf-8") as fh:
            fh.write(chatter)
    return record, log
