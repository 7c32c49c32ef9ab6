"""Typed errors with a hint, and the one place that turns them into exit codes."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3  # a plan printed whole, whose job does not fit the GPU's memory (--fail-if-no-fit)
PREFIX = "[perf-toggles]"


class PerfTogglesError(Exception):
    """Base class: a user-facing problem that ends the run with one clear line, no traceback."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class EnvValueError(PerfTogglesError):
    """An environment variable holds a value outside its accepted set."""

    def __init__(self, var: str, value: str, accepted: str) -> None:
        super().__init__(f"{var}={value!r} is not valid; accepted values: {accepted}")
        self.var = var
        self.value = value
        self.accepted = accepted


class AssumeError(PerfTogglesError):
    """MEGATRON_PERF_TOGGLES_ASSUME names something we cannot plan for."""


class CannotHonourError(PerfTogglesError):
    """An explicit command-line request that this Megatron, TE or machine cannot honour."""

    def __init__(self, dest: str, flag: str, reason: str, hint: str) -> None:
        super().__init__(f"{flag} was requested, but {reason}", hint)
        self.dest = dest
        self.flag = flag


class DependencyError(PerfTogglesError):
    """A guard would take a toggle away from a feature the user asked for, which needs it."""

    def __init__(self, dest: str, feature: str, reason: str, hint: str) -> None:
        # Not the guard's own hint: "turn the toggle off" is exactly what the feature cannot take.
        super().__init__(f"{feature} needs {dest} on, but it cannot stay on: {reason}",
                         f"fix what keeps {dest} off, or drop {feature.split()[0]}")
        self.dest = dest
        self.feature = feature


class ProfileError(PerfTogglesError):
    """The file MEGATRON_PERF_TOGGLES_PROFILE names cannot be used: unreadable, not JSON, another
    format or schema, an unknown toggle, or a value the toggle does not take."""


class DoesNotFitError(PerfTogglesError):
    """The plan does not fit the GPU's memory, and the caller asked to fail on that (``explain`` and the
    dry run's ``--fail-if-no-fit``). Not a usage error: the command line is fine and the plan was
    printed; its own status lets a script tell the two apart."""

    exit_code = EXIT_DOES_NOT_FIT


class RegistryError(PerfTogglesError):
    """A toggle declaration is inconsistent: a bug in this package, caught at import."""


def report(error: PerfTogglesError) -> int:
    """Print the error as one ``[perf-toggles] error:`` line on stderr; return its exit code."""
    print(f"{PREFIX} error: {error}", file=sys.stderr, flush=True)
    return error.exit_code


def fail(error: PerfTogglesError) -> NoReturn:
    """:func:`report`, then exit with the error's code (argparse's convention: 2 for usage)."""
    raise SystemExit(report(error))


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of ``choices``, else ``""``: the start of a hint."""
    import difflib  # only on the error path: it costs a millisecond at import

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


class OneLineArgumentParser(argparse.ArgumentParser):
    """The package's one argparse class: a usage error raises PerfTogglesError instead of printing a
    usage block, so it reaches :func:`report` like every other error; an invalid choice gets a
    "did you mean". Subparsers inherit the class.

    ``usage_hint`` replaces the default "see PROG --help"; ``message_prefix`` (default: the prog)
    starts the message, or nothing where the caller's own error line names the program."""

    def __init__(self, *args: Any, usage_hint: str | None = None, message_prefix: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.usage_hint = usage_hint
        self.message_prefix = message_prefix

    def error(self, message: str) -> NoReturn:
        hint = self.usage_hint or f"see {self.prog} --help"
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            choices = re.findall(r"'([^']*)'", match.group(2)) or [c.strip() for c in match.group(2).split(",")]
            hint = f"{did_you_mean(match.group(1), choices)}{hint}"
        prefix = self.prog if self.message_prefix is None else self.message_prefix
        raise PerfTogglesError(f"{prefix}: {message}" if prefix else message, hint)
