"""The MoE benchmark's report: docs/benchmarks/moe_h200.{json,md} (and .png where matplotlib is at
hand) from the ablate results of bench/moe_h200.py's parts, kept in docs/benchmarks/raw/moe/.

  loss     per arm, ablate's loss test against stock, computed again from the part's runs (so a
           part run by an earlier ablate gets today's test): each seed's loss measure, the paired
           differences in % of stock's loss, their 90 % interval, the verdict against the margin
           (equivalent, different or inconclusive), the smallest margin shown and the seeds a
           margin needs at the spread measured
  speed-*  per arm, ms/iter and the ratio against stock (stock ms / arm ms: above 1 is faster) with
           its interval; "no detectable difference" where the interval holds 1.0
  memory   every part's peak allocated memory per arm, and its change from stock

    python bench/report_moe.py --add loss=OUT/loss --add speed-a=OUT/speed-a --add speed-b=OUT/speed-b
    python bench/report_moe.py            # rebuild from docs/benchmarks/raw/moe/
    python bench/report_moe.py --check    # also fail where the committed files differ

--add copies a part's results.json (a directory or the file) into raw/moe/PART.json with generic
paths (the Megatron tree, python, the output directory; any other absolute path keeps its last part
only, and is named) and only what the report reads (each iteration's loss and step time).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from memory_validation import generic_paths  # bench/ is on the path (run as a script, or by the tests)

from megatron_perf_toggles.errors import PerfTogglesError
from megatron_perf_toggles.tools.ablate import report
from megatron_perf_toggles.tools.ablate.reanalyse import loss_test_of

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "benchmarks"
RAW = DOCS / "raw" / "moe"
PARTS = ("loss", "speed-a", "speed-b")
SHAPES = {"speed-a": "Mixtral-style: 8 experts, top-2, expert FFN 4096",
          "speed-b": "fine-grained: 64 experts, top-8, expert FFN 768",
          "loss": "small MoE on real text: 8 experts, top-2, hidden 512"}
GENERIC = ("/path/to/",)
KEPT_ITERATION = ("iteration", "lm_loss", "ms_per_iter")
NO_DIFFERENCE = "no detectable difference"


# --- importing a part's results -----------------------------------------------------------------


def slim(data: dict[str, Any]) -> dict[str, Any]:
    """What the report reads: each run's summary, status, command and env, and per iteration only
    the loss and the step time (the rest of the results is in the run's own directory)."""
    runs = [{**{k: v for k, v in r.items() if k not in ("iterations", "error_tail")},
             "iterations": [{k: it[k] for k in KEPT_ITERATION if k in it} for it in r.get("iterations", [])]}
            for r in data.get("runs", [])]
    return {**data, "runs": runs}


def refuse(line: str) -> NoReturn:
    """Bad input: one line, exit 2."""
    print(f"report_moe: error: {line}", file=sys.stderr)
    raise SystemExit(2)


def import_results(name: str, path: Path, raw: Path = RAW) -> Path:
    """Copy a part's results.json to raw/NAME.json with generic paths (see the module's docstring)."""
    source = path / "results.json" if path.is_dir() else path
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as error:
        refuse(f"--add {name}={path}: no readable results.json ({error})")
    megatron = ((data.get("versions") or {}).get("megatron") or {}).get("path") or ""
    first = (data.get("runs") or [{}])[0]
    python = (first.get("command") or ["python3"])[0]
    out_dir = str(first.get("log", "")).split("/runs/")[0]
    prefixes = [(megatron, "/path/to/Megatron-LM"), (python, "python3"), (str(REPO), "/path/to/megatron-perf-toggles")]
    if out_dir.startswith("/"):
        prefixes.append((out_dir.rsplit("/", 1)[0], "/path/to/out"))
    text = json.dumps(generic_paths(slim(data), prefixes), indent=1) + "\n"
    # any other absolute path (an environment variable's, a library's): its last part only
    left = sorted({m for m in re.findall(r'"(/[^"]*)"', text) if not m.startswith(GENERIC)}, key=len, reverse=True)
    for path in left:
        text = text.replace(f'"{path}', f'"/path/to/{path.rstrip("/").rsplit("/", 1)[-1]}')
    if left:
        print(f"--add {name}: {len(left)} other machine path(s) kept as /path/to/<last part>: {', '.join(left[:3])}")
    raw.mkdir(parents=True, exist_ok=True)
    target = raw / f"{name}.json"
    target.write_text(text)
    return target


# --- the summary --------------------------------------------------------------------------------


def label(arm: str) -> str:
    """An arm as a reader says it: stock, a toggle alone, a flag added, the defaults."""
    if arm in ("all-off", "baseline"):
        return "stock"
    if arm == "defaults":
        return "defaults (every toggle on)"
    if arm.startswith("only:"):
        return f"{arm[5:]} alone"
    return f"{arm.lstrip('+')} (flags added to stock)" if arm.startswith("+") else arm


def loss_summary(data: dict[str, Any]) -> dict[str, Any]:
    """ablate's loss test over the part's runs (reanalyse.loss_test_of), each arm with its label and peak."""
    try:
        loss = loss_test_of(data)
    except PerfTogglesError as error:
        refuse(f"the loss part: {error}")
    peaks = {r["arm"]: r.get("max_allocated_mb") for r in data["rows"]}
    arms = [{"arm": name, "label": label(name), **entry, "max_allocated_mb": peaks.get(name)}
            for name, entry in loss["arms"].items()]
    return {**loss["settings"], "iters": data.get("iters"), "concurrent": data.get("concurrent"), "arms": arms}


def speed_summary(data: dict[str, Any]) -> dict[str, Any]:
    arms = []
    for r in data["rows"]:
        sp = r.get("speedup") or {}
        arms.append({"arm": r["arm"], "label": label(r["arm"]), "ms_per_iter": (r.get("ms_per_iter") or {}).get("median"),
                     "ratio": 1.0 if r["baseline"] else sp.get("estimate"), "low": sp.get("low"), "high": sp.get("high"),
                     "verdict": "baseline" if r["baseline"] else sp.get("verdict"),
                     "max_allocated_mb": r.get("max_allocated_mb"), "delta_mb": r.get("max_allocated_delta_mb")})
    return {"blocks": data.get("blocks_run"), "iters": data.get("iters"), "warmup": data.get("warmup"),
            "warmup_run": data.get("warmup_run", True), "batch": batch_of(data),
            "confidence": data.get("confidence"), "arms": arms}


def batch_of(data: dict[str, Any]) -> str:
    """The runs' micro-batch and global batch, as their command lines gave them (the same in every arm)."""
    argv = next(iter((data.get("commands") or {}).values()), {}).get("argv") or []
    value = {flag: argv[argv.index(flag) + 1] for flag in ("--micro-batch-size", "--global-batch-size")
             if flag in argv[:-1]}
    return f"micro-batch {value.get('--micro-batch-size', '?')}, global batch {value.get('--global-batch-size', '?')}"


def memory_summary(parts: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    return {name: [{"arm": r["arm"], "label": label(r["arm"]), "max_allocated_mb": r.get("max_allocated_mb"),
                    "delta_mb": r.get("max_allocated_delta_mb")} for r in data["rows"]]
            for name, data in parts.items()}


def summarize(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": "bench/moe_h200.py on one H200; written by bench/report_moe.py"}
    if "loss" in parts:
        out["loss"] = loss_summary(parts["loss"])
    out["speed"] = {name: {"shape": SHAPES.get(name, name), **speed_summary(data)}
                    for name, data in parts.items() if name != "loss"}
    out["memory"] = memory_summary(parts)
    return out


# --- the page -----------------------------------------------------------------------------------


def _n(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def loss_lines(loss: dict[str, Any]) -> list[str]:
    """The loss test's table (first cell: the toggle's registry name), then each seed's measure per arm."""
    seeds = loss.get("seeds") or []
    table = report.loss_markdown_lines({"settings": loss, "arms": {a["arm"]: a for a in loss["arms"]}})
    heads = " | ".join(f"seed {s}" for s in seeds) or "runs"
    lines = [*table[1:], "", f"{len(seeds)} seeds per arm, {loss['iters']} iterations per run, all "
             f"{loss.get('concurrent') or '-'} runs at once on the one GPU. Each seed's measure:", "",
             f"| arm | {heads} |", f"|---|{'---|' * max(len(seeds), 1)}"]
    lines += [f"| {a['label']} | {' | '.join(_n(v, '.4f') for v in a['values'])} |" for a in loss["arms"]]
    return [*lines, ""]


def speed_lines(name: str, part: dict[str, Any]) -> list[str]:
    pct = f"{(part.get('confidence') or 0.95) * 100:g} %"
    lines = [f"## Speed: {name} ({part['shape']})", "",
             f"{part['blocks']} interleaved blocks" + (" after a warm-up run" if part.get("warmup_run", True) else
                                                        ", no warm-up run") +
             f", {part.get('batch', '')}, {part['iters']} iterations per run "
             f"({part['warmup']} left out). Ratio: stock ms / arm ms per block, geometric mean with its {pct} "
             "interval (above 1: faster).", "",
             "| arm | ms/iter | ratio vs stock [interval] | verdict | peak allocated MB | vs stock MB |",
             "|---|---|---|---|---|---|"]
    for a in part["arms"]:
        ratio = "1 (stock)" if a["verdict"] == "baseline" else (
            f"{_n(a['ratio'], '.3f')} [{_n(a['low'], '.3f')}, {_n(a['high'], '.3f')}]")
        lines.append(f"| {a['label']} | {_n(a['ms_per_iter'], '.1f')} | {ratio} | {a['verdict'] or '-'} "
                     f"| {_n(a['max_allocated_mb'], '.0f')} | {_n(a['delta_mb'], '+.0f')} |")
    return [*lines, ""]


def memory_lines(memory: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["## Peak memory", "", "Megatron's max allocated per run (the highest of an arm's runs), every part: "
             "the MoE memory model's validation data.", "", "| part | arm | peak allocated MB | vs stock MB |",
             "|---|---|---|---|"]
    for name, arms in memory.items():
        lines += [f"| {name} | {a['label']} | {_n(a['max_allocated_mb'], '.0f')} | {_n(a['delta_mb'], '+.0f')} |"
                  for a in arms]
    return [*lines, ""]


def markdown(summary: dict[str, Any]) -> str:
    lines = ["# Mixture-of-experts toggles on one H200", "",
             "Stock (every plugin toggle off), each MoE toggle alone and the plugin defaults, in the same "
             "blocks of one experiment per part (`bench/moe_h200.py`, `megatron-perf-toggles ablate`). "
             "Written by `bench/report_moe.py` from `docs/benchmarks/raw/moe/`.", ""]
    if "loss" in summary:
        lines += loss_lines(summary["loss"])
    for name, part in summary["speed"].items():
        lines += speed_lines(name, part)
    lines += memory_lines(summary["memory"])
    return "\n".join(lines).rstrip() + "\n"


def _plot_losses(ax: Any, loss: dict[str, Any] | None, since: int, title: str) -> None:
    """Every run's loss curve from iteration ``since`` on, one colour per arm."""
    import matplotlib.pyplot as plt

    names = [r["arm"] for r in loss["rows"]] if loss else []
    for run in (loss or {}).get("runs", []):
        pts = [(it["iteration"], it["lm_loss"]) for it in run.get("iterations", [])
               if "lm_loss" in it and it["iteration"] >= since]
        if pts and run["arm"] in names:
            ax.plot(*zip(*pts, strict=True), lw=0.8, color=plt.get_cmap("tab10")(names.index(run["arm"]) % 10),
                    label=label(run["arm"]) if run["block"] == 0 else None)
    ax.set(xlabel="iteration", ylabel="lm loss", title=title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _plot_speed(ax: Any, summary: dict[str, Any]) -> None:
    """Each shape's ratios against stock with their intervals."""
    y = 0
    for name, part in summary["speed"].items():
        for a in part["arms"]:
            if a["verdict"] != "baseline" and a["ratio"] is not None:
                err = [[a["ratio"] - a["low"]], [a["high"] - a["ratio"]]] if a["low"] is not None else None
                ax.errorbar([a["ratio"]], [y], xerr=err, fmt="o", capsize=4)
                ax.annotate(f"{name}: {a['label']}", (a["ratio"], y), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")
                y += 1
    ax.axvline(1.0, color="#999", ls="--", lw=1)
    ax.set(xlabel="ratio vs stock (stock ms / arm ms), with interval", yticks=[], title="speed")
    ax.invert_yaxis()


def plot(parts: dict[str, dict[str, Any]], summary: dict[str, Any], path: Path) -> str | None:
    """Loss curves per arm and seed (whole runs, and the compared window), and each shape's ratios
    with their intervals. A note where it cannot plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: the plot is not written"
    fig, (whole, window, speed) = plt.subplots(1, 3, figsize=(18, 5))
    loss = parts.get("loss")
    _plot_losses(whole, loss, 0, "loss, every arm and seed")
    n = (summary.get("loss") or {}).get("window") or 0  # a validation-loss measure has no window: whole runs
    last = (summary.get("loss") or {}).get("iters") or 0
    _plot_losses(window, loss, max(last - n + 1, 0), f"the last {n} iterations (compared)")
    _plot_speed(speed, summary)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def load_parts(raw: Path) -> dict[str, dict[str, Any]]:
    return {name: json.loads((raw / f"{name}.json").read_text()) for name in PARTS if (raw / f"{name}.json").is_file()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--add", action="append", default=[], metavar="PART=PATH",
                    help=f"copy a part's results (directory or results.json) in first; PART: {', '.join(PARTS)}")
    ap.add_argument("--raw", type=Path, default=RAW, help="where the parts' results are kept (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DOCS, help="where moe_h200.{json,md,png} go (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="fail where the written files differ from those there")
    ns = ap.parse_args(argv)
    for item in ns.add:
        name, sep, path = item.partition("=")
        if not sep or name not in PARTS or not path:
            ap.error(f"--add {item!r}: expected PART=PATH with PART one of {', '.join(PARTS)}")
        print(f"added {import_results(name, Path(path), ns.raw)}")
    parts = load_parts(ns.raw)
    if not parts:
        print(f"no MoE results in {ns.raw}: run bench/moe_h200.py, then --add PART=OUT/PART", file=sys.stderr)
        return 1
    summary = summarize(parts)
    targets = {ns.out / "moe_h200.json": json.dumps(summary, indent=1) + "\n", ns.out / "moe_h200.md": markdown(summary)}
    stale = [p.name for p, text in targets.items() if not p.is_file() or p.read_text() != text]
    ns.out.mkdir(parents=True, exist_ok=True)
    for path, text in targets.items():
        path.write_text(text)
    note = plot(parts, summary, ns.out / "moe_h200.png")
    print(f"wrote {', '.join(str(p) for p in targets)}" + (f"; {note}" if note else f", {ns.out / 'moe_h200.png'}"))
    if ns.check and stale:
        print(f"stale: {', '.join(stale)} (run python bench/report_moe.py)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
