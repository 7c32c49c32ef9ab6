"""What explain and doctor print with: the width to fit, the table, a wrapped line, an ``export`` line.

Both commands fit their text to ``COLUMNS`` (else the terminal's width) and give a pipe each line
whole, so they share these helpers rather than each keeping a copy.
"""

from __future__ import annotations

import sys
import textwrap

from ...core.facts import Capabilities
from ...core.profile import ENVIRONMENT_WORDS, Profile
from ...launcher import screen

WGRAD_WORDS = {
    "apex": "APEX fused_weight_gradient_mlp_cuda",
    "fallback": "torch fallback (addmm, fp32 accumulation) in place of APEX",
    "off": "off (gradient accumulation fusion is off)",
    "missing": "none: fusion is on as Megatron's own default (MEGATRON_PERF_TOGGLES=0), and Megatron will need "
               "APEX's fused_weight_gradient_mlp_cuda at the first backward",
}


# The narrowest the last column of a table may be beside the others; narrower, it goes under them.
MIN_LAST_COLUMN = 50
UNDER_INDENT = "    "


def _width() -> int | None:
    """The columns to fit the text to: ``COLUMNS`` where set (a pipe too), else the terminal's.
    None when the output goes to a pipe or a file: tools and grep get each line whole."""
    return screen.width(sys.stdout)


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(width, 1), break_long_words=False, break_on_hyphens=False) or [""]


def _table(rows: list[list[str]], header: list[str], width: int | None = None) -> str:
    """Columns padded to their widest cell. With ``width``, the last column (the reason, the
    longest) is wrapped to fit beside the others, or, where that would leave it narrower than
    MIN_LAST_COLUMN, wrapped on lines of its own under each row."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    indent = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if width is not None and width - indent < min(widths[-1], MIN_LAST_COLUMN):
        fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1])

        def head(cells: list[str]) -> list[str]:  # the other columns, on one line where it fits
            line = fmt.format(*cells).rstrip()
            return [line] if len(line) <= width else _wrap("  ".join(cells), width)

        lines = [*head(header[:-1]), UNDER_INDENT + header[-1], "-" * min(indent, width)]
        for row in rows:
            lines += head([str(cell) for cell in row[:-1]])
            lines += [UNDER_INDENT + part for part in _wrap(str(row[-1]), width - len(UNDER_INDENT))]
        return "\n".join(line.rstrip() for line in lines)
    if width is not None:
        widths[-1] = min(widths[-1], width - indent)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    for row in rows:
        last = _wrap(str(row[-1]), widths[-1])
        lines.append(fmt.format(*row[:-1], last[0]))
        lines += [" " * indent + more for more in last[1:]]
    return "\n".join(line.rstrip() for line in lines)


def _say(text: str, width: int | None, more: str = UNDER_INDENT) -> None:
    """A line of prose, wrapped to ``width`` where there is one, its continuation lines starting
    with ``more``. Long words (paths) are not broken: they stay whole, to copy."""
    print(textwrap.fill(text, width, subsequent_indent=more, break_long_words=False, break_on_hyphens=False)
          if width else text)


def _say_export(name: str, value: str, why: str, width: int | None) -> None:
    """``export NAME=VALUE  # why``; where that does not fit, the why wraps on comment lines of
    its own, so that the lines still paste into a shell."""
    export = f"launch environment: export {name}={value}"
    if width is None or len(export) + len(why) + 4 <= width:
        print(f"{export}  # {why}")
    else:
        print(export)
        _say(f"{UNDER_INDENT}# {why}", width, more=UNDER_INDENT + "# ")


def _caps_summary(caps: Capabilities) -> str:
    bits = [
        f"TE {caps.te_version}" if caps.te_version else "no TE",
        "APEX fused wgrad" if caps.apex_fused_wgrad else "no APEX fused wgrad",
        f"aiter {caps.aiter_version}" if caps.aiter_version else "no aiter",
        f"torch {caps.torch_version}" if caps.torch_version else "no torch",
        f"{caps.device} {caps.gpu_arch}" if caps.gpu_arch else (caps.device or "no device"),
    ]
    return ", ".join(bits)


def _profile_summary(profile: Profile) -> str:
    env = profile.environment
    facts = ", ".join(f"{ENVIRONMENT_WORDS[k]} {getattr(env, k)}" for k in ENVIRONMENT_WORDS
                      if getattr(env, k) is not None)
    when = f" on {profile.created}" if profile.created else ""
    return (f"{profile.source}: {len(profile.toggles)} toggle(s), measured{when}"
            + (f" with {facts}" if facts else " (no environment recorded)"))

