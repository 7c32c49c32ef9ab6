"""Resume safety: warn when a resumed run's toggles differ from the checkpointed run's.

The toggles change numerics, not the checkpoint layout, so a difference is worth a warning that
names it, never a refusal.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from .decide import Message
from .provenance import RECORD_NAME, format_value


def compare_with_checkpoint(load_dir: str | None, decisions: Mapping[str, Mapping[str, Any]]) -> list[Message]:
    if not load_dir:
        return []
    path = os.path.join(load_dir, RECORD_NAME)
    try:
        with open(path) as fh:
            previous = json.load(fh).get("decisions", {})
    except (OSError, ValueError):
        return []
    diffs = []
    for dest, now in decisions.items():
        before = previous.get(dest)
        if before is not None and before.get("value") != now.get("value"):
            diffs.append(f"{dest} {format_value(before.get('value'))} -> {format_value(now.get('value'))}")
    if not diffs:
        return []
    return [Message("warning", f"resuming from {load_dir} with different toggles than the checkpointed run: "
                    + ", ".join(diffs) + " (numerics change; checkpoint layout does not)")]
