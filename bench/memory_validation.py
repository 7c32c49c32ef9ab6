"""Check the memory model (megatron_perf_toggles/core/memory/model.py) against measured peak memory.

Reads every ``ablate`` / ``tune`` results file under docs/benchmarks/raw/ (ablate/, tune/, memory/):
for each arm that differs from its part's baseline only in the plugin's toggles, the predicted change
in peak allocated memory (the model, from the arm's own command line and the machine the results
record) is set against the measured one (``max_allocated_mb`` of the arm minus the baseline's).
A prediction passes within max(15 % of the measured change, 300 MB).

Writes docs/benchmarks/memory_validation.{json,md}; exits 1 when a prediction misses.

    python bench/memory_validation.py            # write
    python bench/memory_validation.py --check    # also fail if the committed files differ
    python bench/memory_validation.py --add NAME=DIR/results.json ...   # copy new results in first

``--add`` copies an ablate results.json to docs/benchmarks/raw/memory/NAME.json with the machine's
paths made generic (the Megatron checkout becomes /path/to/Megatron-LM, the interpreter python3,
the output directory out/), as the other raw results are committed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_perf_toggles.core.memory.model import layout_from_args, stock_peak, toggle_delta_mb  # noqa: E402
from megatron_perf_toggles.core.registry import TOGGLES  # noqa: E402

RAW = REPO / "docs" / "benchmarks" / "raw"
OUT = REPO / "docs" / "benchmarks"
FOLDERS = ("ablate", "tune", "memory")
REL_TOL, ABS_TOL_MB = 0.15, 300.0
TOGGLE_DESTS = {t.dest for t in TOGGLES}
TOGGLE_ENVS = {t.env for t in TOGGLES}
GENERIC_PATHS = ("/path/to/", "/usr/local/cuda")  # what a committed result may name
RUN_ONLY = ("--tensorboard-dir", "--wandb-save-dir", "--save", "--load", "--train-iters")  # not the shape


def generic_paths(value: Any, prefixes: list[tuple[str, str]]) -> Any:
    """``value`` (a JSON-like tree) with every string under one of the machine paths of ``prefixes``
    rewritten under its generic stand-in (an empty prefix stands for nothing)."""
    if isinstance(value, dict):
        return {k: generic_paths(v, prefixes) for k, v in value.items()}
    if isinstance(value, list):
        return [generic_paths(v, prefixes) for v in value]
    if isinstance(value, str):
        for prefix, generic in prefixes:
            if prefix and (value == prefix or value.startswith(prefix.rstrip("/") + "/")):
                return generic + value[len(prefix.rstrip("/")):]
    return value


def import_results(name: str, path: Path, raw: Path = RAW) -> Path:
    """Copy ``path`` (an ablate results.json) to raw/memory/NAME.json with generic paths; refuses a
    file that still names a machine path afterwards."""
    data = json.loads(path.read_text())
    megatron = ((data.get("versions") or {}).get("megatron") or {}).get("path") or "/nonexistent"
    first = (data.get("runs") or [{}])[0]
    python = (first.get("command") or ["python3"])[0]
    out_dir = str(first.get("log", "")).split("/runs/")[0]
    prefixes = [(megatron, "/path/to/Megatron-LM"), (python, "python3")]
    if out_dir.startswith("/"):
        prefixes.append((out_dir.rsplit("/", 1)[0], "out"))
    cxx = (data.get("environment") or {}).get("CUDAHOSTCXX")
    if cxx:
        prefixes.append((cxx, "/path/to/g++"))
    text = json.dumps(generic_paths(data, prefixes), indent=1) + "\n"
    left = sorted({m for m in re.findall(r'"(/[^"]*)"', text) if not m.startswith(GENERIC_PATHS)})
    if left:
        raise SystemExit(f"{path}: machine paths are left after making paths generic: {', '.join(left[:5])}")
    target = raw / "memory" / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def args_of(argv: list[str]) -> dict[str, Any]:
    """The namespace a Megatron command line describes, for the fields the model reads: ``--x-y V``
    is ``x_y = V`` (a number where it is one), a flag alone is True."""
    out: dict[str, Any] = {}
    words = [w for w in argv if not w.endswith(".py")]
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        nxt = words[i + 1] if i + 1 < len(words) else None
        dest = word[2:].replace("-", "_")
        if nxt is None or nxt.startswith("--"):
            out[dest] = True
        else:
            out[dest] = int(nxt) if nxt.lstrip("-").isdigit() else nxt
    return out


def shape_of(argv: list[str]) -> str:
    a = args_of(argv)
    precision = f"fp8 {a.get('fp8_recipe', '')}".strip() if a.get("fp8_format") else "bf16"
    return (f"hidden {a.get('hidden_size')}, ffn {a.get('ffn_hidden_size')}, {a.get('num_layers')} layers, "
            f"seq {a.get('seq_length')}, mbs {a.get('micro_batch_size')}, vocab {a.get('vocab_size')}, "
            f"TP {a.get('tensor_model_parallel_size', 1)}, {precision}")


def _shape_argv(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in RUN_ONLY:
            skip = True
            continue
        out.append(word)
    return out


def _values(row: dict[str, Any], impl: str, cmd: dict[str, Any]) -> dict[str, Any]:
    """What the arm ran with: the plugin's defaults (an arm's environment sets every toggle it
    varies; a candidates baseline sets none), the implementation the guards leave, and the toggle
    flags a candidate arm adds."""
    values: dict[str, Any] = {t.dest: t.default for t in TOGGLES}
    values.update({d: v for d, v in (row.get("intended") or {}).items() if d in TOGGLE_DESTS})
    values["cross_entropy_fusion_impl"] = (row.get("env") or {}).get("CROSS_ENTROPY_FUSION_IMPL", impl)
    values.update(_toggle_flags(cmd.get("candidate_args") or [])[0])
    return values


def _toggle_flags(words: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The toggle values a list of Megatron flags sets, and the words that are not toggle flags."""
    values: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        toggle = next((t for t in TOGGLES if word in t.flags), None)
        if toggle is None:
            rest.append(word)
        elif toggle.kind == "choice":
            values[toggle.dest] = words[i + 1] if i + 1 < len(words) else None
            i += 1
        else:
            values[toggle.dest] = word == toggle.flag
        i += 1
    return values, rest


def validate_file(name: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per arm that differs from the baseline only in toggles and has a measured peak."""
    rows = results.get("rows") or []
    base = next((r for r in rows if r.get("baseline")), None)
    commands = results.get("commands") or {}
    if base is None or base.get("max_allocated_mb") is None or base["arm"] not in commands:
        return []
    caps = (results.get("versions") or {}).get("capabilities") or {}
    te = caps.get("te_version") is not None
    # Where Megatron rejects the te impl (0.19 on), the plugin runs the native one.
    impl = "native" if (caps.get("megatron") or {}).get("asserts_te_cross_entropy") or not te else "te"
    base_argv = commands[base["arm"]]["argv"]
    layout = layout_from_args(args_of(base_argv))
    base_values = _values(base, impl, commands[base["arm"]])
    out = []
    for row in rows:
        cmd = commands.get(row["arm"])
        if row is base or cmd is None or row.get("max_allocated_mb") is None:
            continue
        added, other_words = _toggle_flags(cmd.get("candidate_args") or [])
        toggles_only = set(cmd.get("env") or {}) <= TOGGLE_ENVS and not other_words and (
            set(row.get("intended") or {}) <= TOGGLE_DESTS or added)
        same_shape = _shape_argv(_toggle_flags(cmd["argv"])[1]) == _shape_argv(_toggle_flags(base_argv)[1])
        if not same_shape or not toggles_only or not (row.get("intended") or added):
            continue  # a candidate arm that changes something other than the toggles
        values = _values(row, impl, cmd)
        terms = {t.dest: toggle_delta_mb(t.dest, values, base_values, layout, te) for t in TOGGLES}
        predicted = None if any(v is None for v in terms.values()) else round(sum(terms.values()), 1)
        measured = round(row["max_allocated_mb"] - base["max_allocated_mb"], 1)
        tolerance = round(max(REL_TOL * abs(measured), ABS_TOL_MB), 1)
        out.append({"results": name, "shape": shape_of(base_argv), "baseline": base["arm"], "arm": row["arm"],
                    "predicted_mb": predicted, "measured_mb": measured, "tolerance_mb": tolerance,
                    "within": predicted is not None and abs(predicted - measured) <= tolerance})
    return out


def validate(raw: Path = RAW) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for folder in FOLDERS:
        for path in sorted((raw / folder).glob("*.json")):
            out.extend(validate_file(f"{folder}/{path.name}", json.loads(path.read_text())))
    return out


def stock_rows(raw: Path = RAW) -> list[dict[str, Any]]:
    """Stock's estimated peak (core.memory.stock_peak) against each measured all-off arm, one per
    shape: on a machine without APEX, all off is stock. Reported, not gated: the guard's headroom
    is there for this error."""
    seen: dict[str, dict[str, Any]] = {}
    for folder in FOLDERS:
        for path in sorted((raw / folder).glob("*.json")):
            results = json.loads(path.read_text())
            caps = (results.get("versions") or {}).get("capabilities") or {}
            for row in results.get("rows") or []:
                cmd = (results.get("commands") or {}).get(row["arm"])
                intended = row.get("intended") or {}
                if cmd is None or row.get("max_allocated_mb") is None or caps.get("apex_fused_wgrad") \
                        or not intended or not set(intended) <= TOGGLE_DESTS or any(intended.values()):
                    continue
                shape = shape_of(cmd["argv"])
                est = stock_peak(layout_from_args(args_of(cmd["argv"])), False, caps.get("te_version") is not None)
                seen.setdefault(shape, {"results": f"{folder}/{path.name}", "shape": shape,
                                        "estimated_mb": est.peak_mb, "measured_mb": row["max_allocated_mb"],
                                        "error": round(est.peak_mb / row["max_allocated_mb"] - 1, 4),
                                        "source": est.source})
    return list(seen.values())


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| results | shape | arm (vs baseline) | predicted MB | measured MB | tolerance MB | within |",
             "|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        predicted = "unknown" if r["predicted_mb"] is None else f"{r['predicted_mb']:+.1f}"
        lines.append(f"| {r['results']} | {r['shape']} | {r['arm']} (vs {r['baseline']}) | {predicted} | "
                     f"{r['measured_mb']:+.1f} | {r['tolerance_mb']:.0f} | {'yes' if r['within'] else 'NO'} |")
    shapes = len({r["shape"] for r in rows})
    ok = sum(r["within"] for r in rows)
    head = (f"Memory model against measured peak allocated memory (H200): {ok} of {len(rows)} arm changes over "
            f"{shapes} shapes within max(15 %, 300 MB). Written by bench/memory_validation.py from "
            "docs/benchmarks/raw/.\n\n")
    return head + "\n".join(lines) + "\n"


def stock_table(rows: list[dict[str, Any]]) -> str:
    lines = ["", "Stock's estimated peak (the memory guard's starting point) against the measured all-off arm "
             "(stock on a machine without APEX):", "",
             "| results | shape | estimated MB | measured MB | error |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['results']} | {r['shape']} | {r['estimated_mb']:.0f} | {r['measured_mb']:.0f} | "
              f"{r['error'] * 100:+.1f} % |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files are not what this writes")
    parser.add_argument("--add", action="append", default=[], metavar="NAME=RESULTS_JSON",
                        help="copy an ablate results.json into docs/benchmarks/raw/memory/NAME.json first")
    ns = parser.parse_args(argv)
    for item in ns.add:
        name, _, path = item.partition("=")
        print(f"added {import_results(name, Path(path)).relative_to(REPO)}")
    rows, stock = validate(), stock_rows()
    payload = json.dumps({"tolerance": {"relative": REL_TOL, "absolute_mb": ABS_TOL_MB}, "rows": rows,
                          "stock_estimate": stock}, indent=1) + "\n"
    text = table(rows) + stock_table(stock)
    targets = {OUT / "memory_validation.json": payload, OUT / "memory_validation.md": text}
    if ns.check:
        stale = [p.name for p, body in targets.items() if not p.is_file() or p.read_text() != body]
        if stale:
            print(f"stale: {', '.join(stale)} (run python bench/memory_validation.py)")
            return 1
    else:
        for path, body in targets.items():
            path.write_text(body)
    missed = [r for r in rows if not r["within"]]
    for r in missed:
        print(f"MISS {r['results']} {r['arm']}: predicted {r['predicted_mb']} MB, measured {r['measured_mb']} MB")
    print(f"{len(rows) - len(missed)} of {len(rows)} within tolerance")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
