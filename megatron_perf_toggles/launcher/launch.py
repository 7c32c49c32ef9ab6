"""``python -m megatron_perf_toggles.run [OPTIONS] SCRIPT [MEGATRON ARGS]``: the plugin without editing Megatron.

Installs the plugin (and any ``--extra-args-provider MOD:FUNC``) into Megatron's own parse path for
the version at hand (see ``parse_hooks``), then runs SCRIPT as ``__main__`` exactly as ``python SCRIPT``
would. Works under ``torchrun -m megatron_perf_toggles.run pretrain_gpt.py ...`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.memory.memory_words import FAIL_IF_NO_FIT_HELP
from ..core.registry import flag_of
from ..errors import OneLineArgumentParser, PerfTogglesError, report
from ..runtime.controller import new_context
from ..runtime.machine import target as planned
from ..runtime.provider import extra_args_provider
from . import parse_hooks as hooks
from .import_shims import megatron_importable

PROG = "python -m megatron_perf_toggles.run"

DESCRIPTION = """\
Run a Megatron-LM training script (pretrain_gpt.py, ...) with the megatron-perf-toggles plugin
chained into Megatron's own argument parsing, with no edit to Megatron. The script's own
extra_args_provider (e.g. ModelOpt's) still runs first; the plugin runs last, exactly once.
Works with Megatron-LM core 0.13 ... main and the ROCm fork.
"""

EPILOG = f"""\
Everything after SCRIPT goes to the script (Megatron's arguments), except
{hooks.PROVIDER_FLAG} MOD:FUNC, which is accepted there as well and taken out.
MOD alone means MOD:{hooks.DEFAULT_PROVIDER_ATTR}. Provider modules are imported from the
script's directory, the current directory and PYTHONPATH.

Megatron must be importable: run from the Megatron-LM checkout or set
PYTHONPATH=/path/to/Megatron-LM.

A dry run ({hooks.DRY_RUN_ENV}=1 does the same) parses and validates the arguments
exactly as Megatron would, prints a one-screen summary (the planned machine and software stack,
the decisions after validation, the launch environment the layout needs, warnings) and exits 0
before anything touches a GPU (with --fail-if-no-fit, 3 where the plan does not fit the GPU's
memory); Megatron's own output and the full JSON record go to files it names (--json: the record
on stdout; --verbose: everything). It plans for the world and GPU you
name (--world-size or --nnodes x --nproc-per-node; --gpu {'|'.join(planned.GPUS)} or an arch such
as sm_90 or gfx942; or {planned.PLAN_ENV}=WORLD:GPU): Megatron's parse and validate see that many
ranks, and its device queries are answered from the GPU's facts, on any machine. Without them the
real world (WORLD_SIZE) and the visible GPU are used; with no GPU visible, the plan is for
{planned.DEFAULT_GPU['cuda']} and says so. A plan for another GPU rests on that family's planned
software stack (MEGATRON_PERF_TOGGLES_ASSUME changes it).

examples:
  {PROG} pretrain_gpt.py --num-layers 32 ...
  torchrun --nproc-per-node 8 -m megatron_perf_toggles.run pretrain_gpt.py ...
  {PROG} --dry-run --extra-args-provider my_pkg.args:add_args pretrain_gpt.py ...
  {PROG} --dry-run --world-size 128 --gpu h100 pretrain_gpt.py --tensor-model-parallel-size 8 ...
"""


class ScriptNotFoundError(PerfTogglesError):
    """SCRIPT does not name a file."""


class NotAPythonScriptError(PerfTogglesError):
    """SCRIPT is a file, but not Python source (a shell script, a binary)."""


def build_launcher_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, message_prefix="",
                                   usage_hint=f"usage: {PROG} [OPTIONS] SCRIPT [MEGATRON ARGS]; see --help")
    parser.add_argument(hooks.PROVIDER_FLAG, action="append", default=[], metavar="MOD:FUNC", dest="providers",
                        help="another extra_args_provider to chain (repeatable), after the script's own and "
                             "before the plugin")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"parse and validate only, print the plan, exit 0 "
                             f"(also {hooks.DRY_RUN_ENV}=1)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_const", const="json", dest="output",
                       help="a dry run prints its full JSON record on stdout, and Megatron's own output and one "
                            "line per decision on stderr")
    shown.add_argument("--verbose", action="store_const", const="verbose", dest="output",
                       help="a dry run prints Megatron's own output, the summary and the JSON record")
    parser.add_argument("--fail-if-no-fit", action="store_true",
                        help=f"a dry run's, as explain's: {FAIL_IF_NO_FIT_HELP}")
    planned.add_options(parser.add_argument_group("what a dry run plans for (dry runs only)"))
    parser.add_argument("script", metavar="SCRIPT", help="the training script, e.g. pretrain_gpt.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="MEGATRON ARGS",
                        help="the script's arguments, passed on unchanged")
    return parser


def check_python_script(script: Path) -> None:
    """Refuse, in one line, a SCRIPT that is not Python source (``runpy`` would show a traceback)."""
    try:
        compile(script.read_bytes(), str(script), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as error:
        where = f" (line {error.lineno})" if isinstance(error, SyntaxError) and error.lineno else ""
        first_line = script.read_bytes().split(b"\n", 1)[0]
        shell = script.suffix in (".sh", ".bash") or (first_line.startswith(b"#!") and b"python" not in first_line)
        hint = ("run a launch script with bash, or give the Python training script it calls" if shell
                else "give the Python training script, e.g. pretrain_gpt.py")
        raise NotAPythonScriptError(f"{script} is not a Python script{where}: {type(error).__name__}", hint) from None


def plan_target(ns: argparse.Namespace, dry_run: bool) -> planned.Target | None:
    """The world and GPU a dry run plans for; these options mean nothing to a real launch."""
    given = [flag_of(name) for name in planned.OPTION_DESTS if getattr(ns, name) is not None]
    given += [] if ns.output is None else [f"--{ns.output}"]
    given += ["--fail-if-no-fit"] if ns.fail_if_no_fit else []
    if not dry_run:
        if given:
            raise PerfTogglesError(f"{given[0]} plans a dry run: add --dry-run",
                                   "a real launch takes its world from torchrun and its GPU from the machine")
        return None
    return planned.from_options(ns, entry="launcher")


@dataclass(slots=True)
class _Launch:
    """What a launch learns on its way, which the ways it can end read: whether it is a dry run,
    and the script's and Megatron's own output where a summary keeps it (quiet)."""

    dry_run: bool = False
    chatter: io.StringIO | None = None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse our options, install the hooks, run SCRIPT as ``__main__``; 2 on a usage error. Each
    way it can end (usage error, fail-fast check, the script's own exit, a dry run's report) is
    mapped here; the launch itself is :func:`_launch`."""
    try:
        ns = build_launcher_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as done:  # --help
        return int(done.code or 0)
    except PerfTogglesError as error:
        return report(error)
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    state = _Launch()
    try:
        return _launch(ns, state)
    except SystemExit as done:
        from .dry_run import ReportedExit

        if state.chatter is not None and done.code not in (0, None) and not isinstance(done, ReportedExit):
            # Megatron's parser said why (its last line): show it
            said = [line for line in state.chatter.getvalue().splitlines() if line.strip()]
            print(said[-1] if said else "", file=sys.stderr, flush=True)
        raise
    except PerfTogglesError as error:
        return report(error)
    except Exception as error:
        if not state.dry_run:
            raise  # a real run's failure keeps its traceback
        from .import_shims import import_failure

        what, hint = import_failure(error)  # e.g. a tree that builds GPU code at import, on a GPU-less torch
        return report(PerfTogglesError(f"{ns.script} failed before Megatron parsed its arguments: {what}", hint))
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def _launch(ns: argparse.Namespace, state: _Launch) -> int:
    """The launch in the order it happens: every check before torch and Megatron are imported,
    then the script run as ``__main__`` with the hooks in its parse path."""
    state.dry_run = dry_run = ns.dry_run or hooks.dry_run_requested()
    more, script_args = hooks.pull_provider_specs(ns.script_args)
    script = Path(ns.script)
    if not script.is_file():
        raise ScriptNotFoundError(f"script not found: {ns.script}",
                                  "give the path of the training script, e.g. /path/to/Megatron-LM/pretrain_gpt.py")
    check_python_script(script)
    # As under `python SCRIPT`: the script's directory comes first. The directory `python -m`
    # put there stays importable after it, for provider modules.
    sys.path.insert(0, str(script.resolve().parent))
    # Every variable, the profile, each provider spec and the planned job are checked before
    # torch and Megatron are imported (in a patched script's order too).
    settings = hooks.preflight(os.environ)
    for spec in [*ns.providers, *more]:
        hooks.check_provider_spec(spec)
    target = plan_target(ns, dry_run)
    output = ns.output or settings.dry_run_output or "summary"
    sys.argv = [str(script), *script_args]
    # A summary keeps the script's and Megatron's own output for its log file (quiet); in a
    # dry run stdout carries the report alone, so the script's own output goes to stderr.
    state.chatter = chatter = io.StringIO() if dry_run and output == "summary" else None
    stdout, stderr = sys.stdout, sys.stderr
    # Stand-ins for GPU-only imports (triton) only for a dry run, which stops before any kernel.
    # The dry run ends the process: Megatron's compile decorators stay uncompiled (import_shims).
    # A plan for another machine takes a Transformer Engine of this one's that does not import as absent.
    elsewhere = dry_run and planned.elsewhere(target)
    with contextlib.redirect_stdout(chatter or sys.stderr) if dry_run else contextlib.nullcontext(), \
            contextlib.redirect_stderr(chatter) if chatter is not None else contextlib.nullcontext(), \
            megatron_importable(stand_ins=dry_run, uncompiled=dry_run, elsewhere=elsewhere):
        providers = [hooks.resolve_provider(spec) for spec in [*ns.providers, *more]]
        # The launcher's entry point: one run context for the process, which the script runs in.
        ctx = new_context("launcher", mode="dry-run" if dry_run else "run", target=target, controller=False).install()
        hooks.hook_parse_path([*providers, extra_args_provider], dry_run=dry_run, target=target, output=output,
                              out=stdout, err=stderr, chatter=chatter, context=ctx,
                              fail_if_no_fit=ns.fail_if_no_fit or settings.fail_if_no_fit)
        runpy.run_path(str(script), run_name="__main__")
    if dry_run:  # a dry run ends in its report; a script that never parsed ran without a plan
        raise PerfTogglesError(f"{script} ended before Megatron parsed its arguments: nothing was planned",
                               "a dry run plans a script that calls Megatron's initialize_megatron or "
                               "parse_and_validate_args, as pretrain_gpt.py does")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
