"""Record the argparse surface of a real Megatron-LM tree as JSON facts.

The contract tests replay these facts as a parser, so the plugin's registration is checked
against every supported version on any machine. Only facts are recorded: option strings, dest,
action kind, default, choices (enum members by name), nargs and the group they live in; never
help text or code.
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from pathlib import Path
from typing import Any

from ...errors import OneLineArgumentParser, PerfTogglesError, fail
from ...runtime.provenance import jsonable

SCHEMA = 1

_ACTION_KINDS = {
    argparse._StoreAction: "store",
    argparse._StoreConstAction: "store_const",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._AppendAction: "append",
    argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
    argparse._HelpAction: "help",
    argparse._VersionAction: "version",
    argparse._ExtendAction: "extend",
    argparse.BooleanOptionalAction: "boolean_optional",
}


def _jsonable(value: Any) -> Any:
    """A JSON fact for an argparse value. Enum members become their names: that is what the
    command line spells (Megatron's enum flags convert ``Enum[name]``), e.g. ``--attention-backend
    fused``; the enum class is recorded once per action (``enum``). A value with no JSON form is
    recorded by its type."""
    if isinstance(value, dict):  # no argparse default is a dict; keep the recorded facts as they were
        return {"repr_of_type": "dict"}
    return jsonable(value, enum_name=True, other=lambda v: {"repr_of_type": type(v).__name__})


def _enum_name(action: argparse.Action) -> str | None:
    """The enum class whose members are this action's choices or default, if any."""
    for value in [*(action.choices or []), action.default]:
        if isinstance(value, enum.Enum):
            return type(value).__name__
    return None


def action_kind(action: argparse.Action) -> str:
    for cls in type(action).__mro__:
        if cls in _ACTION_KINDS:
            return _ACTION_KINDS[cls]
    return "custom"


def describe_parser(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """Every optional action with the title of the group that shows it in ``--help``."""
    out: list[dict[str, Any]] = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if not action.option_strings:
                continue
            fact: dict[str, Any] = {
                "group": group.title,
                "flags": list(action.option_strings),
                "dest": action.dest,
                "action": action_kind(action),
                "default": _jsonable(action.default),
                "choices": _jsonable(list(action.choices)) if action.choices else None,
                "nargs": _jsonable(action.nargs),
                "type": getattr(action.type, "__name__", None) if action.type else None,
                "const": _jsonable(action.const),
            }
            enum_name = _enum_name(action)
            if enum_name:
                fact["enum"] = enum_name
            out.append(fact)
    return out


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _capture(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    raise _Captured(parser)


def megatron_parser() -> argparse.ArgumentParser:
    """The parser Megatron's own ``parse_args`` builds (Megatron must already be importable)."""
    from megatron.training import arguments

    try:
        arguments.parse_args(extra_args_provider=_capture)
    except _Captured as captured:
        return captured.parser
    raise RuntimeError("Megatron's parse_args never called extra_args_provider")


def code_facts() -> dict[str, Any]:
    """The Megatron facts that decide guards (which asserts and hooks exist), as detected."""
    from dataclasses import asdict

    from ...runtime.machine.capabilities import megatron_facts

    facts = asdict(megatron_facts())
    facts.pop("path", None)
    return facts


def record_surface(tree: str) -> dict[str, Any]:
    from ...launcher.import_shims import megatron_importable
    from ...runtime.process_changes import PROCESS_CHANGES

    with PROCESS_CHANGES.scope(), megatron_importable(tree):  # recording leaves the process as it was
        parser = megatron_parser()
        facts = code_facts()
    return {"schema": SCHEMA, "source": "NVIDIA/Megatron-LM", "facts": facts, "actions": describe_parser(parser)}


def dumps_record(rec: dict[str, Any]) -> str:
    """One action per line: small diffs when a Megatron release adds or changes a flag."""
    head = {k: v for k, v in rec.items() if k != "actions"}
    lines = [json.dumps(a, sort_keys=True) for a in rec.get("actions", [])]
    body = ",\n  ".join(lines)
    return json.dumps(head, indent=1, sort_keys=True)[:-2] + ',\n "actions": [\n  ' + body + "\n ]\n}\n"


DESCRIPTION = "Write the argparse surface facts of one Megatron-LM tree as JSON."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options, for this module's own parser and the ``megatron-perf-toggles surface`` subcommand."""
    parser.add_argument("tree", help="a Megatron-LM checkout (holds megatron/training/arguments.py)")
    parser.add_argument("--name", help="the version label stored in the record (default: the tree's folder name)")
    parser.add_argument("--out", help="write here instead of standard output")
    parser.add_argument("--commit", metavar="SHA", help="the tree is this commit between releases (e.g. the one a "
                        "framework pins): its detected rules stand, and --release names the release whose rules "
                        "no phrase detects it carries")
    parser.add_argument("--release", metavar="NAME", help="with --commit: that release (e.g. core_v0.17.0)")


def run(ns: argparse.Namespace) -> int:
    """Record ``ns.tree``; a problem is a PerfTogglesError (one line, exit 2, where reported)."""
    from ...launcher.import_shims import import_failure

    if not (Path(ns.tree) / "megatron" / "training" / "arguments.py").is_file():
        raise PerfTogglesError(f"{ns.tree} is not a Megatron-LM checkout (no megatron/training/arguments.py)")
    if bool(ns.commit) != bool(ns.release):
        raise PerfTogglesError("--commit and --release go together: a commit's surface names the release "
                               "whose undetectable rules it carries")
    pinned = {"commit": ns.commit, "release": ns.release} if ns.commit else {}
    try:
        rec = {"name": ns.name or Path(ns.tree).resolve().name, **pinned, **record_surface(ns.tree)}
    except Exception as error:  # noqa: BLE001 - a tree that does not import is one line
        what, hint = import_failure(error)
        raise PerfTogglesError(f"cannot record {ns.tree}: {what}", hint) from None
    text = dumps_record(rec)
    if ns.out:
        try:
            Path(ns.out).write_text(text)
        except OSError as error:
            raise PerfTogglesError(f"--out {ns.out}: {error.strerror or error}") from None
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m megatron_perf_toggles.tools.surfaces.record") -> int:
    """Record one tree; errors are one ``[perf-toggles]`` line and exit 2."""
    parser = OneLineArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except PerfTogglesError as error:
        fail(error)


if __name__ == "__main__":
    raise SystemExit(main())
