"""The memory record in words: a decision's share of the peak's change for the tables' column, and
the summary line (stock's peak, the plan's change and its peak, where each is, the largest
allocation, the limit and the verdicts), as ``explain``, the dry run and the start-up table print them.

The words follow the record (``core.memory.memory_guard.MemoryPlan.to_record``), so a line built from
an older record (without the places) still reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import DoesNotFitError
from .allocator import VERDICT_WORDS
from .peaks import PHASE_WORDS, is_stage, stage_words

PLAIN = PHASE_WORDS["training"]  # one stage peaking in forward and backward, as stock's does: not said


def size_words(mb: float) -> str:
    """A peak or a change as people read it: GB (of 1024 MB) from 1 GB up, else MB."""
    return f"{mb / 1024:.1f} GB" if abs(mb) >= 1024 else f"{mb:.0f} MB"


def delta_words(mb: float | None) -> str:
    """A decision's memory change for the tables: ``+4.0 GB peak per GPU``."""
    if mb is None:
        return "peak memory change unknown"
    if abs(mb) < 0.5:
        return "no change in peak memory"
    return f"{'+' if mb > 0 else '-'}{size_words(abs(mb))} peak per GPU"


def signed(mb: float) -> str:
    return f"{'+' if mb >= 0 else '-'}{size_words(abs(mb))}"


def change_words(memory: Mapping[str, Any], total: float) -> str:
    """The plan's change and its peak, worded so that the screen adds up: the change is the planned
    peak less stock's, which the table's rows (each toggle's share of it) add up to, and the peak
    says where it is (a pipeline stage, the optimizer step)."""
    unknown = [d for d, mb in (memory.get("peak_memory_delta_mb") or {}).items() if mb is None]
    counting = f" (not counting {', '.join(unknown)}: unknown)" if unknown else ""
    planned, where = memory.get("planned_peak_mb"), memory.get("planned_peak_at")
    if planned is None:
        return f", this plan {signed(total)}{counting}"
    said = where and (where != PLAIN or memory.get("stock_peak_at", where) != where)  # the usual place goes unsaid
    return f", this plan {signed(total)}{counting}, planned peak {size_words(planned)}" + (f" {where}" if said else "")


def largest_words(memory: Mapping[str, Any]) -> str:
    """``; largest allocation 224 MB on the first pipeline stage (the first MLP projection's output)``:
    with pipeline parallelism, which stage's and what it is (a stage's own rows and peak are not the
    other's); with one stage the record says what it is."""
    if memory.get("largest_allocation_mb") is None:
        return ""
    stage = memory.get("largest_allocation_stage")
    staged = is_stage(stage) and memory.get("pipeline_stages", 1) > 1
    on = f" on {stage_words(str(stage))}" if staged else ""
    what = f" ({memory['largest_allocation']})" if staged and memory.get("largest_allocation") else ""
    return f"; largest allocation {size_words(memory['largest_allocation_mb'])}{on}{what}"


def summary(memory: Mapping[str, Any]) -> str:
    """One line for the tables: stock's estimated peak, the plan's change, its largest allocation,
    the limit and the verdicts, or why there is no estimate."""
    stock, total = memory.get("stock_peak_mb"), memory.get("total_peak_memory_delta_mb")
    if stock is None:
        return f"memory: {memory.get('note') or 'no estimate'}"
    stock_at = memory.get("stock_peak_at")
    elsewhere = f" {stock_at}" if stock_at and stock_at != memory.get("planned_peak_at", stock_at) else ""
    line = f"memory: stock's estimated peak {size_words(stock)} per GPU{elsewhere} ({memory.get('stock_estimate_source')})"
    if total is not None:
        line += change_words(memory, total)
    line += largest_words(memory)
    limit = memory.get("limit_mb")
    line += f"; limit {size_words(limit)}" if limit else ""
    verdicts = memory.get("verdict") or {}
    if verdicts:
        said = ", ".join(f"{who} {VERDICT_WORDS[v]}" for who, v in verdicts.items())
        line += f": {said}" + (" (expandable segments set)" if memory.get("expandable_segments_set") else "")
    note = memory.get("note")
    return line + (f"; {note}" if note else "")


FAIL_IF_NO_FIT_HELP = ("after the plan, exit with status 3 (and one line on stderr) where it does not fit the GPU's "
                       "memory (the memory line's 'plan does not fit'; one that fits only with expandable segments "
                       "passes: its launch environment says how); also MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT=1")


def fit_failure(memory: Mapping[str, Any] | None) -> DoesNotFitError | None:
    """The one line for a plan whose verdict is that it does not fit (``--fail-if-no-fit``); None
    where it fits (with expandable segments too: the launch environment says how), or where there is
    no verdict (no estimate, or the GPU's memory unknown: the memory line says why)."""
    verdicts = (memory or {}).get("verdict") or {}
    if verdicts.get("plan") != "does_not_fit" or memory is None:
        return None
    need = (memory.get("allocator_need_mb") or {}).get("expandable_segments" if memory.get("expandable_segments_set")
                                                        else "fixed_segments")
    needs = f", allocator's need {size_words(need)}" if need is not None else ""
    return DoesNotFitError(f"the plan does not fit: planned peak {size_words(memory.get('planned_peak_mb') or 0.0)}"
                           f"{needs}, limit {size_words(memory.get('limit_mb') or 0.0)} (stock: "
                           f"{VERDICT_WORDS[verdicts.get('stock', 'does_not_fit')]})",
                           "exit status 3, as --fail-if-no-fit or MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT=1 asks; "
                           "the plan above says what takes the memory")
