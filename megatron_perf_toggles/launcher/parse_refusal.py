"""A dry run's command line that Megatron's own argparse refuses, said in one line.

Argparse answers an unknown or malformed argument with Megatron's whole usage block and exit
status 2. In a dry run that block either vanished into the held output (a patched checkout's dry
run exited 2 saying nothing) or filled the screen (``--json``). Here the parse's own stderr is
held, and a refusal becomes one ``[perf-toggles] error:`` line with argparse's own message, on the
stderr the dry run was started with; a parse that passes hands its stderr on unchanged.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import PREFIX, PerfTogglesError, report

OWN = f"{PREFIX} error: "  # how the plugin's own refusals start (errors.report)

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


@contextlib.contextmanager
def said_in_one_line(hooks: Hooks, exit_type: type[SystemExit]) -> Iterator[None]:
    """Hold the parse's stderr; on argparse's exit with an error, print one line and raise
    ``exit_type(2)`` (the dry run's "already reported" exit). A planning run (``hooks.capture``)
    reads the parse's output itself, so it is left alone."""
    if hooks.capture:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except SystemExit as done:
        if done.code in (0, None):  # --help: its text, where it was going
            sys.stderr.write(held.getvalue())
            raise
        said = argparse_message(held.getvalue())
        with contextlib.redirect_stderr(hooks.err or sys.__stderr__):
            if said.startswith(OWN):  # the plugin's own refusal inside the parse: already its one line
                print(said, file=sys.stderr, flush=True)
                raise exit_type(done.code) from None
            refused = PerfTogglesError(f"Megatron's parser: {said}", "the script's --help lists Megatron's flags")
            raise exit_type(report(refused)) from None
    sys.stderr.write(held.getvalue())
