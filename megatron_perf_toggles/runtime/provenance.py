"""The startup table (one line per decision, rank 0) and the atomic JSON record."""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable
from typing import Any

from .._version import __version__
from ..core.decision.decide import Plan
from ..core.facts import Capabilities
from ..core.precision import LOG_DIR_DESTS
from ..core.registry import format_value
from ..errors import PREFIX

RECORD_NAME = "perf_toggles.json"


def jsonable(value: Any, *, enum_name: bool = False, other: Callable[[Any], Any] = str) -> Any:
    """``value`` as JSON data, for the records a dry run prints and the surfaces we record:
    scalars as they are, sequences and mappings element by element, anything else through
    ``other``. ``enum_name`` writes an enum member as its name (what a command line spells)."""
    if enum_name and isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v, enum_name=enum_name, other=other) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, enum_name=enum_name, other=other) for k, v in value.items()}
    return other(value)


def memory_words(plan: Plan, dest: str) -> str:
    """A decision's share of the change in the planned peak as the tables show it, with where it
    moves the peak or why it changes nothing there ('' where the plan has no memory record)."""
    from ..core.memory.memory_words import delta_words

    memory = plan.memory or {}
    if memory.get("stock_peak_mb") is None:  # no estimate for this layout: the summary line says why
        return ""
    deltas = memory.get("peak_memory_delta_mb") or {}
    if dest not in deltas:
        return ""
    note = (memory.get("peak_memory_notes") or {}).get(dest)
    return delta_words(deltas.get(dest)) + (f" ({note})" if note else "")


def lines(plan: Plan, original_dirs: dict[str, str] | None = None) -> list[str]:
    out = []
    for dest, d in plan.shown().items():  # what applies to this model (no MoE toggle on a dense one)
        memory = memory_words(plan, dest)
        out.append(f"{PREFIX} {dest}: {format_value(d.value)} ({d.source}; {d.reason}{'; ' + memory if memory else ''})")
    if plan.memory is not None:
        from ..core.memory.memory_words import summary

        out.append(f"{PREFIX} {summary(plan.memory)}")
    for dest, path in plan.log_dirs.items():
        before = (original_dirs or {}).get(dest)
        note = "already tagged" if before == path else f"tagged by precision {plan.precision}"
        out.append(f"{PREFIX} {dest}: {path} ({note})")
    out.extend(f"{PREFIX} {m.level}: {m.text}" for m in plan.messages)
    return out


def build_record(plan: Plan | None, caps: Capabilities | None, environ: dict[str, str] | None,
                 command: list[str] | None = None, **fields: Any) -> dict[str, Any]:
    """The one record of a plan (``perf_toggles.json``, the dry run's report, ``explain --json``):
    the decisions and what they rest on, then ``fields``, what the caller knows besides (the dry
    run's parse, the planned target, the launch environment), in the order given. Built whole here,
    so that every record has the same core and no caller edits one afterwards. ``plan`` None: a dry
    run whose provider chain left the plugin out, with no decisions to record."""
    if plan is None or caps is None:
        return {"precision": None, "decisions": {}, "log_dirs": {}, "messages": [], "command": command, **fields}
    record = {
        "package": "megatron-perf-toggles",
        "version": __version__,
        "precision": plan.precision,
        "decisions": decision_records(plan),
        "log_dirs": plan.log_dirs,
        "wgrad_path": plan.wgrad_path,
        "messages": [{"level": m.level, "text": m.text} for m in plan.messages],
        "capabilities": caps.to_record(),
        "environment": environ,
        "command": command,
    }
    if plan.memory is not None:
        record["memory"] = plan.memory  # stock's estimated peak, the GPU, the limit and the total change
    if plan.profile is not None:
        record["profile"] = plan.profile  # the file, what it was measured on, and how this run differs
    record.update(fields)
    return record


def decision_records(plan: Plan) -> dict[str, dict[str, Any]]:
    """Each decision as the record and ``args.perf_toggles`` hold it; a toggle's gains its
    peak_memory_delta_mb (per GPU against stock; None where unknown)."""
    deltas = (plan.memory or {}).get("peak_memory_delta_mb") or {}
    out = {}
    for dest, d in plan.decisions.items():
        out[dest] = d.to_record()
        if dest in deltas:
            out[dest]["peak_memory_delta_mb"] = deltas[dest]
    return out


def record_dir(plan: Plan, args: dict[str, Any]) -> str | None:
    """The tagged tensorboard dir, else the tagged wandb dir, else the untagged ones."""
    for dest in LOG_DIR_DESTS:
        path = plan.log_dirs.get(dest) or args.get(dest)
        if path:
            return str(path)
    return None


def write_atomic(directory: str, payload: dict[str, Any], name: str = RECORD_NAME) -> str:
    """Temp file in the same directory + rename: readers never see a half-written record."""
    import tempfile

    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1, sort_keys=True, default=str)
            fh.write("\n")
        target = os.path.join(directory, name)
        os.replace(tmp, target)
        return target
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
