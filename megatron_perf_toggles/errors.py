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


UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
ARGUMENT = r"argument ([^:]+): "


def unknown_flags(message: str) -> list[str]:
    """The flags argparse's "unrecognized arguments: ..." names (each without its ``=value``)."""
    match = UNRECOGNIZED.search(message)
    words = match.group(1).split() if match else []
    return [word.split("=", 1)[0] for word in words if word.startswith("-")]


def closest_flag(flag: str, options: Sequence[str]) -> str:
    """:func:`did_you_mean` for a flag, judged by its name without the dashes (every flag shares
    them, which made ``--bogus`` look near ``--gpu``)."""
    names = {option.lstrip("-"): option for option in options if option.startswith("-")}
    close = did_you_mean(flag.lstrip("-"), list(names))
    return f"did you mean {names[close.split(chr(39))[1]]!r}? " if close else ""


def _choices(listed: str) -> list[str]:
    return re.findall(r"'([^']*)'", listed) or [c.strip() for c in listed.split(",")]


def argparse_fix(message: str, options: Sequence[str] = (), whose: str = "this Megatron version") -> tuple[str, bool]:
    """The fix for argparse's refusal ``message``, and whether it is the whole hint (False: the
    caller adds where to look). ``options``: the parser's option strings, for the closest flag;
    ``whose``: whose flags they are, for a flag with none near it.
    The one reading of argparse's words, for every parser the package answers for: its own,
    a recorded Megatron surface in ``explain``, and Megatron's own in a dry run."""
    flags = unknown_flags(message)
    if flags:
        close = closest_flag(flags[0], options).strip()
        return (close, True) if close else (f"{flags[0]} is not a flag of {whose}", False)
    patterns: list[tuple[str, Any]] = [
        (r"invalid choice: '([^']*)' \(choose from (.*)\)",
         lambda m: did_you_mean(m.group(2), _choices(m.group(3))).strip() or
         f"choose one of {', '.join(_choices(m.group(3)))}"),
        (r"invalid (\w+) value: ", lambda m: f"give {m.group(1)} a value of type {m.group(2)}"),
        (r"expected one argument", lambda m: f"give {m.group(1)} a value"),
        (r"expected (\d+) arguments?", lambda m: f"give {m.group(1)} {m.group(2)} values"),
        (r"ignored explicit argument", lambda m: f"{m.group(1)} takes no value"),
        (r"not allowed with argument (.*)", lambda m: f"give {m.group(1)} or {m.group(2)}, not both"),
    ]
    for pattern, fix in patterns:
        match = re.search(ARGUMENT + pattern, message)
        if match:
            return fix(match), True
    required = re.search(r"the following arguments are required: (.*)", message)
    if required:
        return f"add {required.group(1)}", False
    ambiguous = re.search(r"ambiguous option: (\S+) could match (.*)", message)
    if ambiguous:
        return f"spell {ambiguous.group(1)} out: {ambiguous.group(2)}", True
    return "", False


def with_fix(message: str, options: Sequence[str], usage: str, whose: str = "this Megatron version") -> str:
    """The hint for argparse's refusal ``message``: its fix (:func:`argparse_fix`), with ``usage``
    (where to look) where the fix alone does not say what to type."""
    fix, whole = argparse_fix(message, options, whose)
    if whole:
        return fix
    return f"{fix}; {usage}" if fix else usage


class OneLineArgumentParser(argparse.ArgumentParser):
    """The package's one argparse class: a usage error raises PerfTogglesError instead of printing a
    usage block, so it reaches :func:`report` like every other error, with its fix
    (:func:`with_fix`: the closest flag or choice, the value a flag wants). Subparsers inherit
    the class.

    ``usage_hint`` replaces the default "see PROG --help"; ``message_prefix`` (default: the prog)
    starts the message, or nothing where the caller's own error line names the program;
    ``flags_of`` says whose flags an unknown one is not one of (default: the prog)."""

    flags_of: str | None = None

    def __init__(self, *args: Any, usage_hint: str | None = None, message_prefix: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.usage_hint = usage_hint
        self.message_prefix = message_prefix

    def option_strings(self) -> list[str]:
        """Every option this parser takes (a subcommand's are its own parser's)."""
        return [option for action in self._actions for option in action.option_strings]

    def error(self, message: str) -> NoReturn:
        hint = with_fix(message, self.option_strings(), self.usage_hint or f"see {self.prog} --help",
                        self.flags_of or self.prog)
        prefix = self.prog if self.message_prefix is None else self.message_prefix
        raise PerfTogglesError(f"{prefix}: {message}" if prefix else message, hint)
