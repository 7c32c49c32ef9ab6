"""The confound check of stage 3 (runs.py): every arm resolved through Megatron's own parser before any run.

Every arm's full effective Megatron arguments come from the plugin's dry run (Megatron's real
parser and validate_args; runs.py's ``resolve_arm``). What each variable derives (settings Megatron
changes along with it) is learnt on the live tree from a pair of dry runs that differ in that
variable alone (the design's probes). An arm that differs from the baseline in anything its
changed variables do not explain, or that does not get its intended value (a guard forced it),
stops the experiment before its first run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...errors import PerfTogglesError
from .design import Arm, Design

# Arguments that legitimately differ between arms, or are bookkeeping, not the experiment.
NOT_COMPARED = {"perf_toggles", "perf_toggles_precision", "rank", "local_rank", "world_size"}


class ConfoundError(PerfTogglesError):
    """Arms differ in more than the intended variables, or do not get their intended values."""


def resolve_all(resolver: Callable[..., dict[str, Any]], script: str, megatron_args: Sequence[str],
                arms: Sequence[Arm], environ: dict[str, str]) -> list[dict[str, Any]]:
    """Dry-run the arms a few at a time (each is one Megatron import, CPU-bound: 2, or one per two
    cores, at most 8, so a GPU machine's cores shorten the minute of dry runs before the first run)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(len(arms), max(2, (os.cpu_count() or 2) // 2), 8))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda arm: resolver(script, megatron_args, arm, environ), arms))


def _diff(base: dict[str, Any], other: dict[str, Any], ignore: set[str]) -> dict[str, tuple[Any, Any]]:
    keys = (set(base) | set(other)) - ignore
    return {k: (base.get(k), other.get(k)) for k in sorted(keys) if base.get(k) != other.get(k)}


def derived_settings(base_record: dict[str, Any], probe_records: Mapping[str, Sequence[dict[str, Any]]]
                     ) -> dict[str, set[str]]:
    """What each variable derives: the arguments in which its single-change dry runs differ from
    the baseline's, besides the variable itself (e.g. grad_reduce_in_bf16 ->
    accumulate_allreduce_grads_in_fp32, and megatron_fsdp_grad_comm_dtype on core 0.17-0.18)."""
    base = base_record.get("effective_args", {})
    return {name: {k for rec in recs for k in _diff(base, rec.get("effective_args", {}), NOT_COMPARED | {name})}
            for name, recs in probe_records.items()}


def check_confounds(design: Design, records: Sequence[dict[str, Any]],
                    derived: Mapping[str, set[str]] | None = None, environ: Mapping[str, str] | None = None) -> None:
    """Raise ConfoundError naming every problem; return quietly when the design's arms (``records``:
    their dry runs, in order) are clean.

    An arm may differ from the baseline only in the variables it changes and in what those
    variables derive (``derived``, from single-change dry runs): a difference that none of its
    changed variables produces alone is a confound, even if it arises only from their combination.
    """
    arms = design.arms
    problems = [*_not_intended(arms, records), *_beyond_intended(arms, design.baseline, records, derived or {})]
    if not problems:
        problems = _indistinguishable(arms, records, environ or {})
    if problems:
        raise ConfoundError("confound check failed, nothing was run:\n  " + "\n  ".join(problems))


def _not_intended(arms: Sequence[Arm], records: Sequence[dict[str, Any]]) -> list[str]:
    """Arms that do not get a value they ask for: a guard forced a toggle, Megatron a setting."""
    problems: list[str] = []
    for arm, rec in zip(arms, records, strict=True):
        decisions = rec.get("decisions", {})
        effective = rec.get("effective_args", {})
        for dest, want in arm.pinned.items():
            got = decisions.get(dest, {})
            if got.get("value") != want:
                problems.append(f"arm {arm.name}: {dest} should be {want} but is {got.get('value')} "
                                f"({got.get('source')}; {got.get('reason')})")
        for name, text in arm.settings.items():
            if name in effective and str(effective[name]) != text and _as_float(effective[name]) != _as_float(text):
                problems.append(f"arm {arm.name}: {name} should be {text} but Megatron resolved {effective[name]}")
    return problems


def _beyond_intended(arms: Sequence[Arm], base_arm: Arm, records: Sequence[dict[str, Any]],
                     derived: Mapping[str, set[str]]) -> list[str]:
    """Arms whose effective arguments differ from the baseline's in more than their changed
    variables and what each derives alone (shown as a diff)."""
    base = records[list(arms).index(base_arm)].get("effective_args", {})
    problems: list[str] = []
    for arm, rec in zip(arms, records, strict=True):
        if arm is base_arm:
            continue
        changed = {n for n, v in arm.intended.items() if base_arm.intended.get(n) != v}
        allowed = NOT_COMPARED | changed | {k for n in changed for k in derived.get(n, ())}
        diff = _diff(base, rec.get("effective_args", {}), allowed)
        if diff:
            lines = [f"    {k}: {base_arm.name}={a!r}  {arm.name}={b!r}" for k, (a, b) in diff.items()]
            problems.append(f"arm {arm.name} differs from {base_arm.name} beyond the intended variables "
                            f"({', '.join(sorted(changed)) or 'none'}) and what each derives alone:\n"
                            + "\n".join(lines))
    return problems


def _indistinguishable(arms: Sequence[Arm], records: Sequence[dict[str, Any]], environ: Mapping[str, str]
                       ) -> list[str]:
    """Arms that resolve to the same arguments and environment: they cannot measure a difference.
    A candidate's environment (an allocator or NCCL setting) is part of what its run gets, on top
    of the caller's: a candidate that sets what the caller's environment already holds changes nothing."""
    keys = {k for a in arms for k in a.added_env}
    same: dict[str, list[str]] = {}
    for a, r in zip(arms, records, strict=True):
        env = {k: a.added_env.get(k, environ.get(k)) for k in keys}
        same.setdefault(json.dumps([r.get("effective_args", {}), env], sort_keys=True, default=str), []).append(a.name)
    problems: list[str] = []
    for names in same.values():
        if len(names) > 1 and not problems:
            caller = sorted(f"{k}={v}" for a in arms if a.name in names for k, v in a.added_env.items()
                            if environ.get(k) == v)
            problems.append(f"arms {', '.join(names)} resolve to identical Megatron arguments and environment: "
                            "they cannot measure a difference"
                            + (f" ({', '.join(caller)} is already set here)" if caller else ""))
    return problems


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def resolve_and_check(resolver: Callable[..., dict[str, Any]], script: str, megatron_args: Sequence[str],
                      design: Design, environ: dict[str, str]) -> tuple[list[dict[str, Any]], dict[str, set[str]]]:
    """Dry-run the design's arms and its single-change probes (each distinct run once), then check:
    each arm's record, in order, and what each variable derives."""
    unique: dict[Any, Arm] = {}
    for arm in [*design.arms, *(p for ps in design.probes.values() for p in ps)]:
        unique.setdefault(arm.signature, arm)
    resolved = dict(zip(unique, resolve_all(resolver, script, megatron_args, list(unique.values()), environ),
                        strict=True))
    records = [resolved[a.signature] for a in design.arms]
    derived = derived_settings(resolved[design.baseline.signature],
                               {n: [resolved[p.signature] for p in ps] for n, ps in design.probes.items()})
    check_confounds(design, records, derived, environ)
    return records, derived
