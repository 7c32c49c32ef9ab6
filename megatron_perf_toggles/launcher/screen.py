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


def table(rows: list[list[str]], header: list[str], size: int | None = None, *, rule: bool = False,
          narrowest: int = MIN_LAST_COLUMN) -> list[str]:
    """The one table renderer (the dry run's summary, ``explain``, ``doctor``): columns padded to
    their widest cell, a rule of dashes under the header where ``rule``. With ``size``, the last
    column (the reason, the longest) wraps beside the others, or, where that would leave it narrower
    than ``narrowest`` (or its widest cell), on lines of its own under each row (``_under``)."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)  # where the last column starts
    if size is not None and size - indent < min(widths[-1], narrowest):
        return _under(cells, header, widths, indent, size, rule)
    widths[-1] = widths[-1] if size is None else max(min(widths[-1], size - indent), 1)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip()]
    if rule:
        out.append(fmt.format(*("-" * w for w in widths)))
    for row in cells:
        parts = [row[-1]] if size is None else _wrap(row[-1], widths[-1])
        out.append(fmt.format(*row[:-1], parts[0]).rstrip())
        out += [" " * indent + more for more in parts[1:]]
    return out


def _under(cells: list[list[str]], header: list[str], widths: list[int], indent: int, size: int,
           rule: bool) -> list[str]:
    """The table with its last column on lines of its own under each row (``indent``: where it would
    have started beside them); the other columns stay on one line where they fit ``size``, else wrap."""
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1])

    def head(row: list[str]) -> list[str]:
        line = fmt.format(*row).rstrip()
        return [line] if len(line) <= size else _wrap("  ".join(row), size)

    out = [*head(header[:-1]), UNDER + header[-1]]
    if rule:
        out.append("-" * min(indent, size))
    for row in cells:
        out += head(row[:-1])
        out += [UNDER + part for part in _wrap(row[-1], size - len(UNDER))]
    return [line.rstrip() for line in out]


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
