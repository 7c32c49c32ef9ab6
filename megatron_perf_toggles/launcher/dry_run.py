"""The dry run's report: parse and validate exactly as Megatron would, then print what was decided.

The hooks (``megatron_hooks``) call :func:`dry_run` in place of Megatron's ``initialize_megatron`` /
``parse_and_validate_args`` when a dry run is asked for. Nothing after validation runs: no global
state, no distributed init, no CUDA. Parse and validate see the planned world and GPU
(``runtime.target``), and every stand-in is undone before the record is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core.env import rank_of
from ..core.registry import TOGGLES
from ..errors import PerfTogglesError
from ..runtime import provenance
from ..runtime import target as planned
from ..runtime.capabilities import assumed, gpu_name_here
from ..runtime.provenance import jsonable

if TYPE_CHECKING:  # types only: the hooks call the dry run, so it never imports them when it runs
    from .megatron_hooks import Hooks, Provider


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
                   notes: list[str]) -> dict[str, Any]:
    """The decisions (provenance.record) plus where they were made and what Megatron kept."""
    chain = hooks.last_chain
    outcome, controller = hooks.outcome(), hooks.controller
    if outcome is not None and controller is not None:
        payload = provenance.build_record(outcome.plan, outcome.capabilities,
                                          controller.env.raw_for_record(controller.environ), list(sys.argv))
    else:
        payload = {"precision": None, "decisions": {}, "log_dirs": {}, "messages": [], "command": list(sys.argv)}
        notes.append("megatron_perf_toggles.extra_args_provider is not in the provider chain: no decisions")
    names = vars(args)
    payload.update({
        "dry_run": True,
        "megatron": {"version": _megatron_version(), "path": hooks.root, "parse_path": via},
        "providers": [
            {"name": run.name, "added": {dest: jsonable(names.get(dest)) for dest in run.added}}
            for run in (chain.runs if chain is not None else [])
        ],
        "args_defaults": {k: jsonable(v) for k, v in args_defaults.items()},
        "after_validate": {t.dest: jsonable(names[t.dest]) for t in TOGGLES if t.dest in names},
        # Every argument as validate_args left it: what `ablate` compares between arms.
        "effective_args": {k: jsonable(v) for k, v in sorted(names.items()) if not k.startswith("_")},
        "notes": notes,
        # The GPU this process sees (not the planned one): what `tune` writes into a profile.
        "gpu_visible": gpu_name_here(),
    })
    return payload


class DryRunDone(Exception):
    """A captured dry run's result: the record and the plan (``hook_parse_path(..., capture=True)``)."""

    def __init__(self, payload: dict[str, Any], plan: Any) -> None:
        super().__init__("dry run done")
        self.payload = payload
        self.plan = plan


def dry_run(hooks: Hooks, caller: Provider | None, ignore_unknown_args: bool, args_defaults: dict[str, Any],
            parsed_args: argparse.Namespace | None, via: str) -> None:
    """Parse and validate as Megatron's ``via`` would, print the record as JSON, exit 0.

    Megatron's own output goes to stderr so stdout is the JSON alone. Nothing after validation
    runs: no global state, no distributed init, no CUDA. Parse and validate see the planned world
    and GPU (``hooks.target``); every stand-in is undone before the record is printed.
    """
    out = hooks.out or sys.stdout
    notes: list[str] = []
    arguments = sys.modules["megatron.training.arguments"]
    with contextlib.redirect_stdout(sys.stderr), planned.stand_ins(hooks.target, assumed("te_version")):
        if parsed_args is None:
            # Chain explicitly: a provider-less parse that ignores unknown arguments looks like one
            # of Megatron's peeks to the parse_args wrapper, which would leave our providers out.
            chain = hooks.chain(caller)
            hooks.last_chain = chain
            args = hooks.originals["parse_args"](chain, ignore_unknown_args)
        else:
            args = parsed_args
            notes.append(f"{via} was given parsed_args: they were validated, not parsed again")
        if getattr(args, "use_checkpoint_args", False) or args_defaults.get("use_checkpoint_args"):
            notes.append("--use-checkpoint-args: a dry run does not load arguments from the checkpoint")
        try:
            if getattr(args, "yaml_cfg", None) is not None:
                from megatron.training.yaml_arguments import validate_yaml

                args = validate_yaml(args, args_defaults)
            else:
                arguments.validate_args(args, args_defaults)
        except (AssertionError, ValueError, RuntimeError, TypeError, KeyError) as error:
            # Megatron refusing the command line is the answer a dry run exists to give: one line.
            raise MegatronRejectedError(f"Megatron's validate_args rejects this command line for "
                                        f"{planned.describe(hooks.target)}: {type(error).__name__}: "
                                        f"{' '.join(str(error).split())}") from None
    payload = dry_run_record(hooks, args, args_defaults, via, notes)
    payload["target"] = {**(hooks.target or planned.Target()).to_record(),
                         "summary": planned.describe(hooks.target)}
    outcome = hooks.outcome()
    plan = outcome.plan if outcome is not None else None
    if hooks.capture:
        raise DryRunDone(payload, plan)
    if rank_of(os.environ) == 0:  # one report per job, from rank 0
        for line in provenance.lines(plan) if plan is not None else []:
            print(line, file=sys.stderr, flush=True)  # the table for people; the JSON for tools
        print(json.dumps(payload, indent=1, sort_keys=True, default=str), file=out, flush=True)
    raise SystemExit(0)
