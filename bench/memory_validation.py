"""Check the memory model (megatron_perf_toggles/core/memory.py) against measured peak memory.

Reads every ``ablate`` / ``tune`` results file under docs/benchmarks/raw/ (ablate/, tune/, memory/):
for each arm that differs from its part's baseline only in the plugin's toggles, the predicted change
in peak allocated memory (the model, from the arm's own command line and the machine the results
record) is set against the measured one (``max_allocated_mb`` of the arm minus the baseline's).
A prediction passes within max(15 % of the measured change, 300 MB).

Writes docs/benchmarks/memory_validation.{json,md}; exits 1 when a prediction misses.

    python bench/memory_validation.py            # write
    python bench/memory_validation.py --check    # also fail if the committed files differ
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_perf_toggles.core.memory import layout_from_args, stock_peak, toggle_delta_mb  # noqa: E402
from megatron_perf_toggles.core.registry import TOGGLES  # noqa: E402

RAW = REPO / "docs" / "benchmarks" / "raw"
OUT = REPO / "docs" / "benchmarks"
FOLDERS = ("ablate", "tune", "memory")
REL_TOL, ABS_TOL_MB = 0.15, 300.0
TOGGLE_DESTS = {t.dest for t in TOGGLES}
TOGGLE_ENVS = {t.env for t in TOGGLES}
RUN_ONLY = ("--tensorboard-dir", "--wandb-save-dir", "--save", "--load", "--train-iters")  # not the shape


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


def _values(row: dict[str, Any], impl: str) -> dict[str, Any]:
    values = {t.dest: t.stock_default for t in TOGGLES}
    values.update(row.get("intended") or {})
    values["cross_entropy_fusion_impl"] = (row.get("env") or {}).get("CROSS_ENTROPY_FUSION_IMPL", impl)
    return values


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
    base_values = _values(base, impl)
    out = []
    for row in rows:
        cmd = commands.get(row["arm"])
        if row is base or cmd is None or row.get("max_allocated_mb") is None:
            continue
        toggles_only = set(row.get("intended") or {}) <= TOGGLE_DESTS and set(cmd.get("env") or {}) <= TOGGLE_ENVS
        if _shape_argv(cmd["argv"]) != _shape_argv(base_argv) or not toggles_only or not row.get("intended"):
            continue  # a candidate arm that changes something other than the toggles
        values = _values(row, impl)
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
    ns = parser.parse_args(argv)
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
