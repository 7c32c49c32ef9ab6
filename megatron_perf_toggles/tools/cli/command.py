"""The ``megatron-perf-toggles`` command: one parser with a subparser per command, and ``main``.

Every error, a usage error included, is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ..._version import __version__
from ...core.registry import SETTINGS, TOGGLES
from ...errors import OneLineArgumentParser, PerfTogglesError, fail
from .. import megatron_usage
from .doctor import _add_doctor
from .explain import _add_explain
from .flags import _add_flags


def _env_epilog() -> str:
    lines = ["environment variables:"]
    for t in TOGGLES:
        lines.append(f"  {t.env:<34} {t.help}")
    for s in SETTINGS:
        lines.append(f"  {s.env:<34} {s.help}")
    return "\n".join(lines)


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


def _add_tools(sub: Any) -> None:
    """patch, ablate, tune, layers, surface: each tool declares its options once, for its own module's parser too."""
    from .. import patching
    from ..ablate import command as ablate
    from ..surfaces import record

    pa = sub.add_parser("patch", help="apply the matching patch from patches/ to a Megatron-LM checkout",
                        description=patching.DESCRIPTION, allow_abbrev=False, message_prefix="")
    patching.add_arguments(pa)
    pa.set_defaults(func=patching.run)
    ab = sub.add_parser("ablate", help="controlled toggle experiments that cannot be confounded",
                        description=ablate.DESCRIPTION, epilog=ablate.EPILOG)
    ablate.add_arguments(ab)
    ab.set_defaults(func=ablate.run_ablation)
    from ..tune import command as tune

    tu = sub.add_parser("tune", help="measure the toggles on your command line and write a profile",
                        description=tune.DESCRIPTION, epilog=tune.EPILOG)
    tune.add_arguments(tu)
    tu.set_defaults(func=tune.run_tune)
    from ..layers import command as layers

    la = sub.add_parser("layers", help="time each toggle where it acts (its module), on one GPU",
                        description=layers.DESCRIPTION, epilog=layers.EPILOG)
    layers.add_arguments(la)
    la.set_defaults(func=layers.run_layers)
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

