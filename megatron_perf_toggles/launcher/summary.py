"""A dry run's report for people: the plan on one screen.

The planned machine, layout and software stack, the decision table (once, after Megatron's validation,
so a run-time back-off shows as the final value), the launch environment the layout needs, and
the warnings; then where the full record and Megatron's own output went. Everything longer (the
argument dump, the JSON record) is a file or ``--verbose`` / ``--json``.
"""

from __future__ import annotations

import os
from typing import Any

from ..core import layout
from ..core.decision.decide import Plan
from ..core.facts import STACK_HINT, Capabilities
from ..core.launch_env import LaunchVar
from ..core.memory.memory_words import summary as memory_summary
from ..core.registry import format_value
from ..runtime import provenance
from . import screen

WGRAD_WORDS = {"apex": "APEX", "fallback": "torch fallback in place of APEX", "off": "off",
               "missing": "none (Megatron will need APEX at the first backward)"}


def _stack(caps: Capabilities | None) -> str:
    if caps is None:
        return "unknown"
    if caps.stack:
        return f"planned, {caps.stack}{STACK_HINT}"
    te = f"Transformer Engine {caps.te_version}" if caps.te_version else "no Transformer Engine"
    apex = "APEX fused wgrad" if caps.apex_fused_wgrad else "no APEX"
    return f"detected on this machine: {te}, {apex}" + (" (MEGATRON_PERF_TOGGLES_ASSUME applied)" if caps.assumed else "")


def lines(payload: dict[str, Any], plan: Plan | None, caps: Capabilities | None, launch: list[LaunchVar],
          set_here: list[LaunchVar], record: str | None, log: str | None, output: str,
          width: int | None = None) -> list[str]:
    """The summary, line by line (about 20 lines for a plain job), fitted to ``width`` columns
    where one is given (``screen.width``: COLUMNS, else the terminal's). Every reason is whole:
    wrapped to the width, never cut (without one, each row is one line, for grep)."""
    megatron = payload.get("megatron") or {}
    out = [f"dry run: Megatron-LM {megatron.get('version') or '?'} at {megatron.get('path') or '?'} "
           f"(parse and validate_args passed)",
           f"planned for: {payload.get('target', {}).get('summary', '?')}",
           *([f"layout:      {layout.words(payload['layout'])}"] if payload.get("layout") else []),
           f"stack:       {_stack(caps)}", ""]
    if plan is None:
        out.append("no decisions: megatron_perf_toggles.extra_args_provider is not in the provider chain")
    else:
        out.append("decisions (final, after Megatron's validate_args):")
        rows = [[dest, format_value(d.value), d.source, provenance.memory_words(plan, dest) or "-", d.reason]
                for dest, d in plan.shown().items()]
        header = ["toggle", "value", "source", "peak memory", "reason"]
        shown = screen.table(rows, header, width - 2 if width is not None else None)
        out.extend("  " + line for line in shown)
        out.append(f"  precision tag: {plan.precision}; fused wgrad: {WGRAD_WORDS.get(plan.wgrad_path, plan.wgrad_path)}")
        if plan.memory is not None:
            out.append(f"  {memory_summary(plan.memory)}")
        for dest, path in plan.log_dirs.items():
            out.append(f"  {dest}: {path}")
    out.append("")
    if launch:
        out.append("launch environment (Megatron checks these for this layout, or the memory plan needs them; "
                   "export them in the launch):")
        for var in launch:
            here = os.environ.get(var.name)
            note = "set for this plan" if var in set_here else (
                "already set here" if here == var.value else "not set here" if here is None else
                "set here to another value")
            out.append(f"  export {var.name}={var.value}    # {var.why} ({note})")
    else:
        out.append("launch environment: nothing this layout needs")
    messages = plan.messages if plan is not None else []
    notes = list(payload.get("notes") or [])
    if messages or notes:
        out.append("")
        out.append("warnings and notes:")
        out.extend(f"  {m.level}: {m.text}" for m in messages)
        out.extend(f"  note: {n}" for n in notes)
    out.append("")
    if record:
        out.append(f"full record (JSON): {record}")
    if log:
        out.append(f"Megatron's output (argument dump): {log}")
    if output == "summary":
        out.append("(--json prints the record on stdout, --verbose prints everything)")
    return screen.fit(out, width)
