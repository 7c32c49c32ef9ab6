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
    "missing": "none: fusion is on with neither APEX nor the torch fallback, and Megatron will need "
               "APEX's fused_weight_gradient_mlp_cuda at the first backward (the note says why)",
}


# The narrowest the last column of a table may be beside the others; narrower, it goes under them.
MIN_LAST_COLUMN = 50
UNDER_INDENT = screen.UNDER


def _width() -> int | None:
    """The columns to fit the text to: ``COLUMNS`` where set (a pipe too), else the terminal's.
    None when the output goes to a pipe or a file: tools and grep get each line whole."""
    return screen.width(sys.stdout)


def _table(rows: list[list[str]], header: list[str], width: int | None = None) -> str:
    """The table ``explain`` and ``doctor`` print: the dry run's renderer (``screen.table``) with a
    rule under the header; the reason goes under each row where it would be narrower than
    MIN_LAST_COLUMN beside the others."""
    return "\n".join(screen.table(rows, header, width, rule=True, narrowest=MIN_LAST_COLUMN))


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

