"""What MEGATRON_PERF_TOGGLES_ASSUME plans for, read on its own.

Both capability detection (``capabilities``) and the planned machine of a dry run (``target``)
ask it, so it sits below both: neither has to import the other for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ...core.env import read_text_setting
from ...core.facts import parse_assume
from ...errors import AssumeError


def assumed(key: str, environ: Mapping[str, str] | None = None) -> str | None:
    """One fact MEGATRON_PERF_TOGGLES_ASSUME plans for (``device``, ``te_version``), read through the
    registry. A bad spelling gives None here: the provider reports it as its one line."""
    spec = read_text_setting("MEGATRON_PERF_TOGGLES_ASSUME", os.environ if environ is None else environ)
    try:
        return parse_assume(spec).get(key) if spec else None
    except AssumeError:
        return None


def assumed_device() -> str | None:
    """``cuda`` or ``rocm`` where MEGATRON_PERF_TOGGLES_ASSUME names one."""
    return assumed("device")
