"""A dry run's command line that Megatron's own argparse refuses, said in one line with its fix.

Argparse answers an unknown or malformed argument with Megatron's whole usage block and exit
status 2. In a dry run that block either vanished into the held output (a patched checkout's dry
run exited 2 saying nothing) or filled the screen (``--json``). Here the parse's own stderr is
held, and a refusal becomes one ``[perf-toggles] error:`` line with argparse's own message and
the fix (``errors.with_fix``: the closest flag of the parser Megatron built, the closest choice,
the value a flag wants), the same fix ``explain`` names for the same mistake. A planning run
(``explain --megatron``) gets the same error raised; a parse that passes hands its stderr on
unchanged.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from ..errors import PREFIX, PerfTogglesError, report, with_fix

OWN = f"{PREFIX} error: "  # how the plugin's own refusals start (errors.report)
USAGE = "the script's --help lists Megatron's flags"

if TYPE_CHECKING:  # types only: the hooks call the dry run, which calls this
    from .parse_hooks import Hooks


def argparse_message(held: str) -> str:
    """Argparse's own message: the last line it printed (``prog: error: ...``), without the prog;
    a refusal of the plugin's own (``[perf-toggles] error: ...``) as it is."""
    said = [line.strip() for line in held.splitlines() if line.strip()]
    last = said[-1] if said else "the command line was refused"
    if last.startswith(OWN):
        return last
    return last.split(": error: ", 1)[1] if ": error: " in last else last


def refusal(held: str, options: Sequence[str] = ()) -> PerfTogglesError:
    """The error for a parse that stopped with ``held`` on its stderr: the plugin's own one line
    as it was said, else argparse's message with its fix (``options``: the parser's flags)."""
    said = argparse_message(held)
    if said.startswith(OWN):
        return PerfTogglesError(said.removeprefix(OWN))
    return PerfTogglesError(f"Megatron's parser: {said}", with_fix(said, options, USAGE))


@contextlib.contextmanager
def said_in_one_line(hooks: Hooks, exit_type: type[SystemExit],
                     options: Callable[[], Sequence[str]] = tuple) -> Iterator[None]:
    """Hold the parse's stderr; on argparse's exit with an error, print one line and raise
    ``exit_type(2)`` (the dry run's "already reported" exit); a planning run (``hooks.capture``)
    gets the error raised instead, for its caller to report. ``options`` gives the option strings
    of the parser that refused, once it has."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except SystemExit as done:
        if done.code in (0, None):  # --help: its text, where it was going
            sys.stderr.write(held.getvalue())
            raise
        refused = refusal(held.getvalue(), options())
        if hooks.capture:
            raise refused from None
        with contextlib.redirect_stderr(hooks.err or sys.__stderr__):
            raise exit_type(report(refused)) from None
    sys.stderr.write(held.getvalue())
