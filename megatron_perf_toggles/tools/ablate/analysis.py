"""Stage 6 of an experiment, measurements to analysis: each arm against the baseline block by
block (speed intervals and their verdicts, the loss ratio, peak memory), sizing, and the loss test.

Per arm: the median of its runs' medians with their range; against the baseline, per block, the
speedup with its paired interval and verdict and the loss ratio at the last iteration both logged
(stats.py holds the statistics); the blocks that would resolve ``--effect``; the loss test over
seeds (loss/loss_test.py). Runs at once timed the sharing, not the arms: their analysis keeps
losses and memory alone. The analysis is the results as ``results.json`` holds them (report.py
adds the versions and the environment). :func:`analysed` is the stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import stats
from .design import Arm, baseline_of
from .execution import Measurements
from .loss.loss_test import losses_compared
from .spec import ExperimentSpec

SPEED_KEYS = ("ms_per_iter", "tflops_per_gpu", "tokens_per_s_per_gpu", "speedup", "blocks_to_resolve")


def compare(arms: Sequence[Arm], runs: Sequence[Mapping[str, Any]], done: Mapping[str, Sequence[Mapping[str, Any] | None]],
            seq_length: int | None, gpus: int | None, confidence: float = 0.95, effect: float = 0.01,
            base: Arm | None = None) -> list[dict[str, Any]]:
    """Per arm: the median of its runs' medians with their range; against the baseline, block by
    block (``done``: each arm's finished run in each block): the speedup with its interval and
    verdict, the loss ratio at the last common iteration (the loss test, with its verdict, is
    loss_test.py's), and sizing."""
    # One row per arm, built in the order the report reads it; the statistics live in stats.py.
    base = base or baseline_of(arms)
    last = {(r["arm"], r["block"]): r for r in runs if r.get("block", -1) >= 0}  # a block's last run of each arm
    rows: list[dict[str, Any]] = []
    for arm in arms:
        ok = [r for r in done[arm.name] if r is not None]
        row: dict[str, Any] = {"arm": arm.name, "baseline": arm is base, "intended": arm.intended, "env": arm.env,
                               "runs_done": len(ok), "runs_failed": sum(
                                   1 for b in range(len(done[arm.name]))
                                   if last.get((arm.name, b), {}).get("status") == "failed")}
        ms = [stats.median_of(r, "ms_per_iter") for r in done[arm.name]]
        row["ms_per_iter"] = stats.spread([v for v in ms if v is not None])
        row["tflops_per_gpu"] = stats.spread([v for r in ok if (v := stats.median_of(r, "tflops_per_gpu")) is not None])
        mems = [m for r in ok if r.get("summary", {}).get("memory_mb")
                if (m := r["summary"]["memory_mb"].get("max_allocated")) is not None]  # else no peak
        if mems:
            row["max_allocated_mb"] = max(mems)
        gbs = next((it["global_batch_size"] for r in ok for it in r.get("iterations", [])
                    if "global_batch_size" in it), None)
        med = (row["ms_per_iter"] or {}).get("median")
        if gbs and med and seq_length and gpus:  # an unknown world size gives no per-GPU figure
            row["tokens_per_s_per_gpu"] = gbs * seq_length / (med / 1000) / gpus
        if arm is not base:
            row["speedup"] = stats.paired_speedup([stats.median_of(r, "ms_per_iter") for r in done[base.name]], ms,
                                                  confidence)
            sd = row["speedup"].get("sd_log")
            if sd is not None:
                row["blocks_to_resolve"] = {"effect": effect, "power": 0.8,
                                            "blocks": stats.blocks_to_resolve(sd, effect, confidence)}
        common = stats.loss_iterations(done[arm.name]) & stats.loss_iterations(done[base.name])
        if common:  # finished runs only, as for the step times: a failed run's loss says nothing
            bl, al = stats.losses_at(done[base.name], max(common)), stats.losses_at(done[arm.name], max(common))
            cmp_ = stats.loss_comparison(bl, al)
            if cmp_:
                row["loss"] = {"iteration": max(common), "arm_losses": al, "baseline_losses": bl, **cmp_}
        rows.append(row)
    base_mb = next((r.get("max_allocated_mb") for r in rows if r["baseline"]), None)
    for row in rows:  # the peak's change from the baseline, next to the speedup
        if base_mb is not None and row.get("max_allocated_mb") is not None:
            row["max_allocated_delta_mb"] = round(row["max_allocated_mb"] - base_mb, 2)
    return rows


def runs_world(logged: int | None, spec: ExperimentSpec) -> int | None:
    """The processes (GPUs) the runs had, which per-GPU figures divide by: the runs' own word where
    they logged it, else the user's (``--world-size``), else what the launcher plainly starts, else
    None (unknown: no per-GPU figure rather than a guess). tune records the same number."""
    return logged if logged is not None else spec.stated_or_launched


def speed_note(asked: int, at_once: int) -> str:
    """Why runs at once carry no speed figures."""
    if at_once > 1:
        return f"not measured: {at_once} runs shared the GPU at once, so their step times measure the sharing, not the arms"
    return (f"not measured: --concurrent {asked} asks for losses alone, and only one run at a time fits the GPU's "
            "memory, so the runs ran one at a time with no warm-up run")


# --- the stage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Analysis:
    """The stage's value: the results (as results.json holds them, less the versions and the
    environment), the arms' dry-run records, the output directory and what to say besides."""

    result: dict[str, Any]
    records: list[dict[str, Any]]
    out: Path
    notes: list[str]


def analysed(measurements: Measurements) -> Analysis:
    """The stage: the results of the runs measured."""
    m, runs = measurements, measurements.schedule.runs
    spec, design, together = runs.spec, runs.design, measurements.schedule.together
    notes = [] if m.logged_world in (None, spec.planned_world) else [
        f"warning: the runs had a world of {m.logged_world}, the dry runs planned for {spec.planned_world}: "
        f"say --world-size {m.logged_world}"]
    gpus = runs_world(m.logged_world, spec)
    seeds = None if spec.block_seeds is None else [spec.block_seeds + b for b in range(m.blocks)]
    # "concurrent" is the K asked for (as before the memory check); how many ran at once is its own field
    shared = min(m.schedule.at_once, max(1, sum(len(block) for block in m.schedule.blocks)))
    speed = {"concurrent": spec.concurrent, "concurrent_ran": m.schedule.at_once,
             "speed_note": speed_note(spec.concurrent, shared)} if together else {}
    rows = compare(design.arms, m.runs, m.done, runs.records[0].get("effective_args", {}).get("seq_length"), gpus,
                   spec.confidence, spec.effect, design.baseline)
    size = None if together else stats.sizing(rows, spec.effect, spec.confidence)
    if together:  # runs that shared the GPU timed the sharing, not the arms: no speed figure
        rows = [{k: v for k, v in r.items() if k not in SPEED_KEYS} for r in rows]
    loss = losses_compared(design.arms, design.baseline, m.done, measure=spec.loss_measure, window=spec.loss_window,
                           margin=spec.loss_margin, alpha=spec.loss_alpha, seeds=seeds,
                           common_start=spec.common_start) if spec.loss_test else None
    if loss:
        rows = [{**r, "loss_test": loss["arms"][r["arm"]]} for r in rows]
    result = {"design": spec.design, "seed": spec.seed, "repeats": spec.repeats, "blocks_run": m.blocks,
              "block_seeds": seeds, "loss_window": spec.loss_window,
              "common_start": {str(b): s for b, s in m.starts.items()} if spec.common_start else None,
              "compile_warmup": dict(m.warmups) or None,
              "loss_test": None if loss is None else loss["settings"], **speed,
              "blocks_across_calls": m.across_calls,
              "block_order": m.orders, "world_size": gpus, "planned_world_size": spec.planned_world,
              "warmup_run": m.warmed, "iters": runs.iters, "warmup": spec.warmup,
              "confidence": spec.confidence, "target_ci": spec.target_ci, "budget_min": spec.budget,
              "stop_reason": m.stop_reason, "derived": {n: sorted(k) for n, k in runs.derived.items()},
              "rows": rows, "sizing": size, "runs": m.runs, "commands": runs.commands, "seconds": m.seconds}
    return Analysis(result, runs.records, Path(spec.out), notes)
