"""Fitting a dry run's summary to the screen it is printed on.

``explain`` wraps its output to ``COLUMNS`` (else the terminal's width); the dry run printed
lines of any length. The same rule here: ``COLUMNS`` where set, else the terminal's when the
report goes to one, else no wrapping (a pipe or a file gets each line whole, for grep). The
decision table wraps its last column (the reason) beside the others, or under each row where it
would be too narrow there; an ``export`` line keeps its command whole and puts its comment on
comment lines of its own, so that the lines still paste into a shell.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from typing import TextIO

MIN_LAST_COLUMN = 40  # narrower than this beside the others, the reason goes under its row
UNDER = "    "


def width(out: TextIO | None) -> int | None:
    """``COLUMNS`` where set to a positive number; else the terminal's width when ``out`` is one."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns > 0:
        return columns
    try:
        tty = bool(out is not None and out.isatty())
    except (AttributeError, ValueError):
        tty = False
    return shutil.get_terminal_size().columns if tty else None


def _wrap(text: str, size: int) -> list[str]:
    return textwrap.wrap(text, max(size, 1), break_long_words=False, break_on_hyphens=False) or [""]


def table(rows: list[list[str]], header: list[str], size: int | None) -> list[str]:
    """Columns padded to their widest cell; with ``size``, the last column wrapped to fit."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1])
    if size is not None and size - indent < min(widths[-1], MIN_LAST_COLUMN):
        out = [fmt.format(*header[:-1]).rstrip(), UNDER + header[-1]]
        for row in rows:
            out.append(fmt.format(*row[:-1]).rstrip())
            out += [UNDER + part for part in _wrap(row[-1], size - len(UNDER))]
        return out
    last = widths[-1] if size is None else max(min(widths[-1], size - indent), 1)
    out = []
    for row in [header, *rows]:
        parts = [row[-1]] if size is None else _wrap(row[-1], last)
        out.append(f"{fmt.format(*row[:-1])}  {parts[0]}".rstrip())
        out += [" " * (indent + 2) + more for more in parts[1:]]
    return out


def fit(lines: list[str], size: int | None) -> list[str]:
    """Each line wrapped to ``size`` (kept as it is without one), continuing under its own indent;
    an ``export NAME=VALUE  # why`` line keeps the command whole and wraps the comment."""
    if size is None:
        return lines
    out: list[str] = []
    for line in lines:
        if len(line) <= size:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip())]
        command, sep, why = line.partition("    # ")
        if sep and command.strip().startswith("export "):
            out.append(command.rstrip())
            out += _wrap_with(f"{lead}# {why}", size, lead + "# ")
        else:
            out += _wrap_with(line, size, lead + UNDER)
    return out


def _wrap_with(text: str, size: int, more: str) -> list[str]:
    return textwrap.wrap(text, size, subsequent_indent=more, break_long_words=False, break_on_hyphens=False,
                         drop_whitespace=True) or [text]
