"""The ablation's measurements and report: medians from Megatron's log, each arm against the
baseline block by block, and results.json, results.md and a plot in the output directory."""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._version import __version__
from . import stats
from .design import Arm, baseline_of
from .loss.loss_test import by_block as done_by_block  # the arm's finished run in each block: what comparisons pair
from .loss.loss_test import markdown_lines as loss_test_lines
from .loss.loss_test import verdict_lines
from .megatron_log import parse_file

RAW_KEYS = ("ms_per_iter", "tflops_per_gpu", "lm_loss", "grad_norm", "global_batch_size")


def measure_run(status: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One run's numbers: every iteration's raw values and the steady-state summary."""
    out = dict(status)
    path = status.get("log")
    if not path or not os.path.exists(path):
        return out
    log = parse_file(path)
    out["iterations"] = [{"iteration": it.iteration, **{k: it.values[k] for k in RAW_KEYS if k in it.values}}
                         for it in log.iterations]
    out["summary"] = log.summary(skip_first=warmup)
    if log.validation:
        out["validation"] = [{"iteration": i, "lm_loss": v} for i, v in log.validation]
    return out


def _median_of(run: Mapping[str, Any], key: str) -> float | None:
    return (run.get("summary", {}).get(key) or {}).get("median")


def _loss_at(run: Mapping[str, Any], iteration: int) -> float | None:
    return next((it["lm_loss"] for it in run.get("iterations", []) if it["iteration"] == iteration
                 and "lm_loss" in it), None)


def loss_iterations(runs: Sequence[Mapping[str, Any] | None]) -> set[int]:
    """Iterations that logged a loss in any of these runs (None: a block without a finished run)."""
    return {it["iteration"] for r in runs if r for it in r.get("iterations", []) if "lm_loss" in it}


def losses_at(runs: Sequence[Mapping[str, Any] | None], iteration: int) -> list[float | None]:
    """Each block's loss at ``iteration`` (None where the block has no finished run or no such loss)."""
    return [_loss_at(r, iteration) if r else None for r in runs]


def compare(arms: Sequence[Arm], runs: Sequence[dict[str, Any]], blocks: int, seq_length: int | None, gpus: int | None,
            confidence: float = 0.95, effect: float = 0.01) -> list[dict[str, Any]]:
    """Per arm: the median of its runs' medians with their range; against the baseline, block by
    block: the speedup with its interval and verdict, the loss ratio at the last common iteration
    (the loss test, with its verdict, is loss_test.py's), and sizing."""
    # One row per arm, built in the order the report reads it; the statistics live in stats.py.
    measured = [r for r in runs if r.get("block", -1) >= 0]
    by: dict[tuple[str, int], dict[str, Any]] = {(r["arm"], r["block"]): r for r in measured}
    base = baseline_of(arms)
    done = {arm.name: done_by_block(runs, arm.name, blocks) for arm in arms}

    def per_block(arm: Arm, key: str) -> list[float | None]:
        return [_median_of(r, key) if r else None for r in done[arm.name]]

    base_ms = per_block(base, "ms_per_iter")
    rows: list[dict[str, Any]] = []
    for arm in arms:
        ok = [r for r in done[arm.name] if r is not None]
        row: dict[str, Any] = {"arm": arm.name, "baseline": arm is base, "intended": arm.intended(),
                               "env": arm.env(), "runs_done": len(ok), "runs_failed": sum(
                                   1 for b in range(blocks) if by.get((arm.name, b), {}).get("status") == "failed")}
        ms = per_block(arm, "ms_per_iter")
        row["ms_per_iter"] = stats.spread([v for v in ms if v is not None])
        row["tflops_per_gpu"] = stats.spread([v for v in per_block(arm, "tflops_per_gpu") if v is not None])
        mems = [r["summary"]["memory_mb"].get("max_allocated") for r in ok if r.get("summary", {}).get("memory_mb")]
        mems = [m for m in mems if m is not None]  # a report without "max allocated" gives no peak
        if mems:
            row["max_allocated_mb"] = max(mems)
        gbs = next((it["global_batch_size"] for r in ok for it in r.get("iterations", [])
                    if "global_batch_size" in it), None)
        med = (row["ms_per_iter"] or {}).get("median")
        if gbs and med and seq_length and gpus:  # an unknown world size gives no per-GPU figure
            row["tokens_per_s_per_gpu"] = gbs * seq_length / (med / 1000) / gpus
        if arm is not base:
            row["speedup"] = stats.paired_speedup(base_ms, ms, confidence)
            sd = row["speedup"].get("sd_log")
            if sd is not None:
                row["blocks_to_resolve"] = {"effect": effect, "power": 0.8,
                                            "blocks": stats.blocks_to_resolve(sd, effect, confidence)}
        common = loss_iterations(done[arm.name]) & loss_iterations(done[base.name])
        if common:  # finished runs only, as for the step times: a failed run's loss says nothing
            last = max(common)
            bl, al = losses_at(done[base.name], last), losses_at(done[arm.name], last)
            cmp_ = stats.loss_comparison(bl, al)
            if cmp_:
                row["loss"] = {"iteration": last, "arm_losses": al, "baseline_losses": bl, **cmp_}
        rows.append(row)
    base_mb = next((r.get("max_allocated_mb") for r in rows if r["baseline"]), None)
    for row in rows:  # the peak's change from the baseline, next to the speedup
        if base_mb is not None and row.get("max_allocated_mb") is not None:
            row["max_allocated_delta_mb"] = round(row["max_allocated_mb"] - base_mb, 2)
    return rows


SPEED_KEYS = ("ms_per_iter", "tflops_per_gpu", "tokens_per_s_per_gpu", "speedup", "blocks_to_resolve")


def without_speed(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows less every speed figure: runs that shared the GPU timed the sharing, not the arms."""
    return [{k: v for k, v in r.items() if k not in SPEED_KEYS} for r in rows]


def sizing(rows: Sequence[dict[str, Any]], effect: float, confidence: float) -> dict[str, Any] | None:
    """Blocks needed to resolve ``effect`` on the noise measured: pooled over the arms' per-block
    log-ratio spreads (each arm's own is in its row)."""
    sds = [r["speedup"]["sd_log"] for r in rows if r.get("speedup", {}).get("sd_log") is not None]
    if not sds:
        return None
    pooled = math.sqrt(statistics.fmean(s * s for s in sds))
    return {"effect": effect, "confidence": confidence, "power": 0.8, "pooled_sd_log": pooled,
            "blocks_to_resolve": stats.blocks_to_resolve(pooled, effect, confidence),
            "blocks_for_half_width": stats.blocks_for_half_width(pooled, effect, confidence)}


def widest_interval(rows: Sequence[dict[str, Any]]) -> float:
    widths = [stats.relative_half_width(r["speedup"]) for r in rows if "speedup" in r]
    return max((w if w is not None else math.inf for w in widths), default=math.inf)


# --- reporting ----------------------------------------------------------------------------------


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _signed(mb: Any) -> str:
    """A change in MB with its sign (the baseline's own row shows 0)."""
    return "-" if not isinstance(mb, (int, float)) else ("0" if abs(mb) < 0.5 else f"{mb:+.0f}")


RECORDED_ENV = ("MEGATRON_PERF_TOGGLES", "CUDA", "NCCL", "NVTE", "PYTORCH_", "TORCH_NCCL")


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    conf = result["confidence"]
    pct = f"{conf * 100:g} %"
    lines = [f"# Ablation ({result['design']})", "",
             f"{result['blocks_run']} block(s) of {len(rows)} arms, each block in its own order (seed "
             f"{result['seed']}), " + ("after 1 unmeasured warm-up run. " if result.get("warmup_run") else
                                        "with no warm-up run. ") +
             f"{result['iters']} iterations per run; medians over iterations after the first {result['warmup']}. "
             f"Speedup: baseline ms / arm ms per block, geometric mean with a paired {pct} t-interval.", "",
             f"| arm | runs | ms/iter (median of run medians) | range of run medians | TFLOP/s/GPU | tokens/s/GPU "
             f"| speedup [{pct} CI] | verdict | loss ratio [range] (it) | max alloc MB | vs baseline MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r.get("ms_per_iter") or {}
        sp = r.get("speedup") or {}
        loss = r.get("loss") or {}
        if r["baseline"]:
            speed, verdict = "1 (baseline)", "-"
        else:
            speed = f"{_f(sp.get('estimate'), '.3f')} [{_f(sp.get('low'), '.3f')}, {_f(sp.get('high'), '.3f')}]"
            verdict = sp.get("verdict", "-")
        runs = f"{r['runs_done']}" + (f" ({r['runs_failed']} failed)" if r.get("runs_failed") else "")
        loss_txt = (f"{_f(loss.get('ratio'), '.4f')} [{_f(loss.get('min'), '.4f')}, {_f(loss.get('max'), '.4f')}] "
                    f"(it {loss.get('iteration', '-')})") if loss else "-"
        lines.append(f"| {r['arm']} | {runs} | {_f(ms.get('median'), '.1f')} | {_f(ms.get('min'), '.1f')}–"
                     f"{_f(ms.get('max'), '.1f')} | {_f((r.get('tflops_per_gpu') or {}).get('median'), '.1f')} "
                     f"| {_f(r.get('tokens_per_s_per_gpu'), '.0f')} | {speed} | {verdict} | {loss_txt} "
                     f"| {_f(r.get('max_allocated_mb'), '.0f')} | {_signed(r.get('max_allocated_delta_mb'))} |")
    if result.get("speed_note"):
        lines += ["", f"Speed: {result['speed_note']}"]
    lines += loss_test_lines(loss_of(result))
    adds = {name: c for name, c in result.get("commands", {}).items() if "candidate_args" in c}
    if adds:  # what each candidate arm adds, so that a reader can run it again
        lines += ["", "Candidates (added to the baseline's command):", ""]
        lines += [f"- {name}: `{shlex.join([f'{k}={v}' for k, v in c.get('candidate_env', {}).items()] + c['candidate_args'])}`"
                  for name, c in adds.items()]
    size = result.get("sizing")
    if size:
        lines += ["", f"Sizing: per-block noise (sd of ln ratio) {size['pooled_sd_log'] * 100:.2f} %. Resolving a "
                  f"{size['effect'] * 100:g} % effect at {pct} with 80 % power needs about "
                  f"{size['blocks_to_resolve']} blocks; an interval of +-{size['effect'] * 100:g} % needs about "
                  f"{size['blocks_for_half_width']}. This run had {result['blocks_run']}."]
    if result.get("stop_reason"):
        lines += ["", f"Stopped: {result['stop_reason']}."]
    if result.get("blocks_across_calls"):
        lines += ["", "Blocks whose runs ran in two calls (--split-blocks): "
                  + ", ".join(str(b) for b in result["blocks_across_calls"]) + "."]
    failed = [r for r in result["runs"] if r.get("status") == "failed"]
    if failed:
        lines += ["", "## Failed runs", ""]
        for r in failed:
            lines += [f"**{r['label']}**: exit code {r['returncode']}, log `{r['log']}`", "", "```",
                      *r.get("error_tail", []), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def plot(result: dict[str, Any], path: Path) -> str | None:
    """Speedup intervals against the baseline, and every run's loss curve. Returns a note when it cannot plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'megatron-perf-toggles[plot]'): results.png not written"
    rows = [r for r in result["rows"] if not r["baseline"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.45 * max(len(rows), 4)))
    colors: dict[str | None, str] = {"faster": "#2a7", "slower": "#c33"}  # others (None too): grey
    for y, r in enumerate(rows):
        sp = r.get("speedup") or {}
        est, lo, hi = sp.get("estimate"), sp.get("low"), sp.get("high")
        if est is None:
            continue
        color = colors.get(sp.get("verdict"), "#777")
        if lo is not None and hi is not None:
            ax1.errorbar([est], [y], xerr=[[est - lo], [hi - est]], fmt="o", color=color, capsize=4)
        else:
            ax1.plot([est], [y], "o", color=color)
        for v in sp.get("per_block", []):
            ax1.plot([v], [y], "|", color="#333", ms=8)
    ax1.axvline(1.0, color="#999", lw=1, ls="--")
    ax1.set_yticks(range(len(rows)), [r["arm"] for r in rows], fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel(f"speedup vs {next(r['arm'] for r in result['rows'] if r['baseline'])} "
                   f"({result['confidence'] * 100:g} % CI; ticks: blocks)")
    ax1.set_title(f"throughput, {result['blocks_run']} blocks")
    names = [r["arm"] for r in result["rows"]]
    cmap = plt.get_cmap("tab10")
    for run in result["runs"]:
        if run.get("block", -1) < 0 or run["arm"] not in names:
            continue
        pts = [(it["iteration"], it["lm_loss"]) for it in run.get("iterations", []) if "lm_loss" in it]
        if pts:
            i = names.index(run["arm"])
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, color=cmap(i % 10),
                     label=run["arm"] if run["block"] == 0 else None)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("lm loss")
    ax2.set_title("loss, every run")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_results(out: Path, result: dict[str, Any], records: Sequence[dict[str, Any]]) -> None:
    import platform

    result = {**result, "versions": {
        "megatron_perf_toggles": __version__, "python": platform.python_version(),
        "megatron": records[0].get("megatron") if records else None,
        "capabilities": records[0].get("capabilities") if records else None},
        # the caller's values of what can change the speed of every arm alike (the allocator and
        # torch's NCCL settings among them), and of every variable a candidate sets (unset: null)
        "environment": {**{k: v for k, v in os.environ.items() if k.startswith(RECORDED_ENV)},
                        **{k: os.environ.get(k) for c in result.get("commands", {}).values()
                           for k in c.get("candidate_env", {})}}}
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = markdown(result)
    (out / "results.md").write_text(text)
    note = plot(result, out / "results.png")
    if note:
        print(f"[ablate] note: {note}", file=sys.stderr)
    print(text)
    for line in verdict_lines(loss_of(result)):
        print(f"loss: {line}")


def loss_of(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The loss test as loss_test.py builds it, from the results (None: the results carry none)."""
    if not result.get("loss_test"):
        return None
    return {"settings": result["loss_test"],
            "arms": {r["arm"]: r["loss_test"] for r in result["rows"] if r.get("loss_test")}}


# --- command ----------------------------------------------------------------------------------
