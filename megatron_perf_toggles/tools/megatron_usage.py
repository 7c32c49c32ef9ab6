"""Mistakes with Megatron's arguments in ``explain`` and ``flags``, each said in one line.

A recorded Megatron surface is replayed as a plain argparse parser, which answers a misspelt flag
with Megatron's whole usage block (hundreds of lines). :class:`SurfaceParser` raises the package's
one-line error instead, with the closest real flag (the fix a dry run's refusal names too);
:func:`dash_hint` adds the hint a newcomer needs when Megatron's arguments were given without the
``--`` that separates them from ours.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ..errors import OneLineArgumentParser, PerfTogglesError, closest_flag, unknown_flags


class SurfaceParser(OneLineArgumentParser):
    """The parser a recorded surface is replayed into: a usage error is one line, with its fix
    (``errors.with_fix``: the closest flag this Megatron has, as a dry run's refusal names it)."""

    flags_of = "this Megatron version"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("message_prefix", "Megatron's parser (recorded surface)")
        kwargs.setdefault("usage_hint", "--megatron PATH plans with a checkout's own parser")
        super().__init__(*args, **kwargs)


def named(surface: str) -> type[SurfaceParser]:
    """A :class:`SurfaceParser` whose messages name the recorded surface ``surface``."""

    class Named(SurfaceParser):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("message_prefix", f"Megatron's parser (recorded surface {surface!r})")
            super().__init__(*args, **kwargs)

    return Named


def own_options(parser: argparse.ArgumentParser, command: str) -> list[str]:
    """The option strings of ``parser``'s subcommand ``command`` (none where it has no such one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return [option for a in action.choices[command]._actions for option in a.option_strings]
    return []


def dash_hint(error: PerfTogglesError, argv: Sequence[str], parser: argparse.ArgumentParser) -> PerfTogglesError:
    """A flag the command line's subcommand does not know (argparse reports it at the top, where
    only the top's options are known): the hint names the subcommand's own option it most likely
    meant; for ``explain --tensor-model-parallel-size 2`` (Megatron's flag, given to a command that
    takes Megatron's arguments without the ``--`` before them), where they go. Any other error is
    returned as it was."""
    words = list(argv)
    command = next((w for w in words if not w.startswith("-")), None)
    flags = unknown_flags(error.message)
    own = own_options(parser, command) if command else []
    if not flags or not own or (command in ("explain", "flags") and "--" in words):
        return error
    close = closest_flag(flags[0], own)
    if close:
        return PerfTogglesError(error.message, f"{close}see megatron-perf-toggles {command} --help")
    if command in ("explain", "flags"):
        return PerfTogglesError(error.message, f"Megatron's arguments go after --: megatron-perf-toggles {command} "
                                f"[options] -- {flags[0]} ...")
    return PerfTogglesError(error.message, f"{flags[0]} is not an option of megatron-perf-toggles {command}; "
                            f"see megatron-perf-toggles {command} --help")
