"""Stage 7 of an experiment, the analysis to the report: results.json, results.md and a plot in
the output directory, the table printed, and one ``loss:`` line per arm. :func:`reported` is the stage."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..._version import __version__
from .analysis import Analysis
from .loss import equivalence
from .loss.loss_test import VALIDATION


def _f(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _signed(mb: Any) -> str:
    """A change in MB with its sign (the baseline's own row shows 0)."""
    return "-" if not isinstance(mb, (int, float)) else ("0" if abs(mb) < 0.5 else f"{mb:+.0f}")


RECORDED_ENV = ("MEGATRON_PERF_TOGGLES", "CUDA", "NCCL", "NVTE", "PYTORCH_", "TORCH_NCCL")


def warmup_text(result: Mapping[str, Any]) -> str:
    """What came before the blocks, in the report's first sentence: the warm-up run, or (runs at
    once) this call's compile warm-up, "after" it only where every one finished, or neither."""
    compiled = result.get("compile_warmup") or {}
    if compiled:
        failed = [arm for arm, s in compiled.items() if s.get("status") != "done"]
        if failed:
            return f"with a compile warm-up that failed for {', '.join(failed)}, whose runs compiled for themselves. "
        took = max((s.get("seconds") or 0.0 for s in compiled.values()), default=0.0)
        return f"after a compile warm-up ({len(compiled)} short unmeasured run(s) at once with the common starts, {took:.0f} s). "
    return "after 1 unmeasured warm-up run. " if result.get("warmup_run") else "with no warm-up run. "


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    conf = result["confidence"]
    pct = f"{conf * 100:g} %"
    lines = [f"# Ablation ({result['design']})", "",
             f"{result['blocks_run']} block(s) of {len(rows)} arms, each block in its own order (seed "
             f"{result['seed']}), " + warmup_text(result) +
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
    lines += loss_markdown_lines(loss_of(result))
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
        "gpu": records[0].get("gpu_visible") if records else None,  # the card's name: where a pooled part ran
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


def reported(analysis: Analysis) -> dict[str, Any]:
    """The stage: what the analysis says besides (a warning), then results.json, results.md and
    results.png under the output directory, the table and the loss verdicts printed; the results."""
    for line in analysis.notes:
        print(f"[ablate] {line}", file=sys.stderr, flush=True)
    write_results(analysis.out, analysis.result, analysis.records)
    return analysis.result


def loss_of(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The loss test as loss_test.py builds it, from the results (None: the results carry none)."""
    if not result.get("loss_test"):
        return None
    return {"settings": result["loss_test"],
            "arms": {r["arm"]: r["loss_test"] for r in result["rows"] if r.get("loss_test")}}


# --- the loss test, in words ----------------------------------------------------------------------


def _pct(v: Any, fmt: str = "+.2f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) else "-"


def interval_text(e: Mapping[str, Any]) -> str:
    """``+0.12 % [-0.30, +0.54]`` (the estimate alone where there is no interval)."""
    if e.get("estimate") is None:
        return "-"
    if e.get("low") is None:
        return f"{_pct(e['estimate'])} %"
    return f"{_pct(e['estimate'])} % [{_pct(e['low'])}, {_pct(e['high'])}]"


def advice(e: Mapping[str, Any]) -> str:
    """What an inconclusive or too-wide result would need: seeds at the spread measured."""
    need = e.get("seeds_needed")
    if need is None:
        return "2 or more seeds give an interval"
    per = " per arm" if not e.get("paired") else ""
    return f"+-{e['margin']:g} % needs about {need} seeds{per} at this spread"


def verdict_line(name: str, e: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """One arm's verdict in a line, as ablate prints it."""
    how = "paired" if e.get("paired") else "unpaired"
    unit = "seeds" if settings.get("seeded_blocks", True) else "blocks of one seed"
    words = f"{e['toggle']} ({name}): {interval_text(e)}, {e.get('seeds_compared', 0)} {unit}, {how}, " \
            f"{settings['measure']}: {e['verdict']}"
    if not settings.get("seeded_blocks", True):
        words += " (one seed: run-to-run only, no claim across seeds)"
    if e["verdict"] == equivalence.INCONCLUSIVE and e.get("smallest_margin_shown") is not None:
        words += f" (smallest margin shown +-{e['smallest_margin_shown']:.2f} %; {advice(e)})"
    return words


def verdict_lines(loss: Mapping[str, Any] | None) -> list[str]:
    if not loss:
        return []
    return [verdict_line(n, e, loss["settings"]) for n, e in loss["arms"].items() if "verdict" in e]


def loss_markdown_lines(loss: Mapping[str, Any] | None) -> list[str]:
    """The report's loss section: one row per arm, first cell the toggle's registry name."""
    if not loss:
        return []
    s = loss["settings"]
    what = ("the last held-out validation loss" if s["measure"] == VALIDATION else
            f"the mean training loss over the last {s['window'] or 'tenth of the'} iterations")
    unit = ("seeds (--block-seeds --common-start: every arm of a seed starts from one saved state and sees the "
            "same data)" if s.get("common_start") else
            "seeds (--block-seeds: every arm of a seed shares its initial weights and data order)"
            if s["seeded_blocks"] else "blocks that repeat one seed: the interval measures run-to-run "
            "nondeterminism on that seed alone, not the change across seeds")
    conf = f"{s['interval'] * 100:g} %"
    lines = ["", f"## Loss: equivalence within +-{s['margin']:g} %", "",
             f"Measure: {what}. Unit: {unit}. Difference: arm less baseline, same seed, in % of the baseline's "
             f"mean; {conf} t-interval (two one-sided tests at {s['alpha']:g}); unpaired (Welch) where the arm "
             "draws its initial weights another way. Verdicts: equivalent (the interval inside the margin), "
             "different (it excludes 0 and reaches past the margin), else inconclusive.", "",
             f"| toggle | arm | seeds | difference [{conf} CI] | smallest margin shown | seeds for +-{s['margin']:g} % "
             "| pairing | verdict |", "|---|---|---|---|---|---|---|---|"]
    for name, e in loss["arms"].items():
        if "verdict" not in e:
            continue
        small = e.get("smallest_margin_shown")
        pairing = "paired" if e.get("paired") else f"unpaired: {e.get('unpaired_because')}"
        lines.append(f"| {e['toggle']} | {name} | {e.get('seeds_compared', 0)} | {interval_text(e)} "
                     f"| {'-' if small is None else f'+-{small:.2f} %'} | {e.get('seeds_needed') or '-'} "
                     f"| {pairing} | {e['verdict']} |")
    return lines
