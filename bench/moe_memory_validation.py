"""The mixture-of-experts memory model against the H200: each arm's planned peak against its measured one.

    python bench/moe_memory_validation.py report RESULTS [RESULTS ...] [--write] [--out-dir DIR]
    python bench/moe_memory_validation.py run --megatron PATH --out DIR [--shapes a,b] [--iters 3] [--smoke]

``report`` needs no GPU and no runs of its own: it reads ``ablate`` results (a results.json, or a
directory searched for them; the MoE speed parts of bench/moe_h200.py are such results), plans each
arm's peak allocated memory with the package's own model (core.memory: the arm's own arguments, one
GPU, the toggle values the arm ran with) and compares it with the arm's measured peak (Megatron's
max allocated, ``max_allocated_mb`` of the arm's row). A plan passes within 15 % or 300 MB of the
measured peak, the larger. Where the results have a baseline arm, each arm's planned change against
it is compared with the measured change too, within 25 % of the measured change or 16 MB, the
larger (a change of the wrong sign beyond that says so). It prints a markdown table; ``--write``
writes docs/benchmarks/moe_memory_validation.{json,md} (``--out-dir`` elsewhere). Exits 1 on a
miss (a peak's, not a change's), 2 on input that is not ablate results (one line on stderr).

The toggle values of an arm: the plugin's defaults where the arm runs through its launcher
(``megatron_perf_toggles.run``), Megatron's where it does not, then the arm's environment (each
toggle's variable, the MoE toggles' too before the registry has them), its intended values and the
toggle flags on its command line.

``run`` is for a few short dedicated runs where no ablate results exist: stock Megatron (the tree's
pretrain_gpt.py under bench/peak_probe.py, no plugin) on two MoE shapes, once with no MoE toggle and
once with each, writing DIR/results.json in the layout ``report`` reads. ``--smoke`` runs a stand-in
script instead of Megatron (CPU, for tests): the records then carry no peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from memory_validation import ABS_TOL_MB, REL_TOL, _toggle_flags, args_of  # noqa: E402

from megatron_perf_toggles.core.memory import model as memory  # noqa: E402
from megatron_perf_toggles.core.memory.memory_moe import MOE_DESTS  # noqa: E402
from megatron_perf_toggles.core.memory.peaks import stage_peaks  # noqa: E402
from megatron_perf_toggles.core.registry import TOGGLES  # noqa: E402

OUT = REPO / "docs" / "benchmarks"
# The MoE toggles' variables and flags, for results made before the registry has them (the registry
# wins where it has them).
MOE_ENV = {"MOE_GROUPED_GEMM": "moe_grouped_gemm", "MOE_PERMUTE_FUSION": "moe_permute_fusion",
           "MOE_ROUTER_FUSION": "moe_router_fusion"}
MOE_FLAGS = {"--" + d.replace("_", "-"): d for d in MOE_DESTS}
REGISTRY = {t.dest for t in TOGGLES}
PLUGIN_LAUNCH = "megatron_perf_toggles.run"
# a toggle's change against the baseline is a few MB to a few hundred: a tolerance of its own size
CHANGE_REL_TOL, CHANGE_ABS_TOL_MB = 0.25, 16.0


class BadInput(ValueError):
    """What ``report`` was given is not ablate results; the message says why (one line)."""


# --- the values each arm ran with ------------------------------------------------------------------


def megatron_values(apex: bool) -> dict[str, Any]:
    """Stock Megatron's toggle values (gradient accumulation fusion only with APEX's kernel, which
    stock needs for it; the MoE toggles off, Megatron's defaults)."""
    out: dict[str, Any] = {t.dest: t.stock_default for t in TOGGLES}
    out["gradient_accumulation_fusion"] = bool(out["gradient_accumulation_fusion"]) and apex
    return {**out, **dict.fromkeys(MOE_DESTS, False)}


def arm_values(argv: list[str], env: Mapping[str, str], intended: Mapping[str, Any], apex: bool,
               impl: str) -> dict[str, Any]:
    """The toggle values one arm ran with (see the module's docstring)."""
    plugin = PLUGIN_LAUNCH in argv and env.get("MEGATRON_PERF_TOGGLES", "1") != "0"
    values = megatron_values(apex)
    if plugin:
        values.update({t.dest: t.default for t in TOGGLES})
        values["cross_entropy_fusion_impl"] = impl
    env_names = {**MOE_ENV, **{t.env: t.dest for t in TOGGLES}}
    for var, dest in env_names.items():
        if var in env:
            values[dest] = env[var] not in ("0", "false", "False", "")
    values.update({d: v for d, v in intended.items() if d in values})
    flags, rest = _toggle_flags(argv)
    values.update(flags)
    values.update({MOE_FLAGS[w]: True for w in rest if w in MOE_FLAGS})
    return values


# --- planning one arm ------------------------------------------------------------------------------


def plan_peak(argv: list[str], values: Mapping[str, Any], te: bool, apex: bool) -> dict[str, Any]:
    """The arm's planned peak on one GPU, as the memory guard plans it (core.memory.peaks.stage_peaks:
    stock's peak per stage plus every toggle's change against stock's value, or the optimizer
    step's peak where larger), over the registry's toggles and the MoE toggles alike."""
    args = {k: v for k, v in args_of(argv).items() if k not in ("world_size", "data_parallel_size")}
    layout = memory.layout_from_args(args)
    base = megatron_values(apex)
    estimate = memory.stock_peak(layout, bool(base["gradient_accumulation_fusion"]), te,
                                 {d: base[d] for d in MOE_DESTS})
    dests = sorted(REGISTRY | set(MOE_DESTS))
    stages = stage_peaks(estimate, values, base, layout, te, dests)
    terms = {d: memory.toggle_delta_mb(d, values, base, layout, te) for d in dests}
    step = memory.step_peak(estimate, terms, layout, values, "last")
    training = estimate.stages.get("last", estimate.peak_mb) + sum(v for v in terms.values() if v is not None)
    return {"planned_mb": round(max(stages.values()), 1), "stock_planned_mb": estimate.peak_mb,
            "peak_in": "optimizer step" if step is not None and step > training else "forward and backward",
            "stock_parts_mb": estimate.parts, "deltas_mb": {d: None if v is None else round(v, 1) for d, v in terms.items()
                                                           if v is None or abs(v) >= 0.05}}


def shape_words(argv: list[str]) -> str:
    a = args_of(argv)
    return (f"hidden {a.get('hidden_size')}, {a.get('num_layers')} layers, {a.get('num_experts')} experts "
            f"top-{a.get('moe_router_topk', 2)}, expert FFN {a.get('moe_ffn_hidden_size', a.get('ffn_hidden_size'))}, "
            f"{a.get('moe_token_dispatcher_type', 'allgather')}, EP {a.get('expert_model_parallel_size', 1)}, "
            f"seq {a.get('seq_length')}, mbs {a.get('micro_batch_size')}, vocab {a.get('vocab_size')}")


def within(planned: float, measured: float, rel: float = REL_TOL, absolute: float = ABS_TOL_MB) -> tuple[float, bool]:
    tolerance = max(rel * abs(measured), absolute)
    return round(tolerance, 1), abs(planned - measured) <= tolerance


def _capabilities(results: Mapping[str, Any]) -> tuple[bool, bool, str]:
    caps = (results.get("versions") or {}).get("capabilities") or {}
    te = caps.get("te_version") is not None
    # where Megatron rejects the te cross entropy (0.19 on), the plugin runs the native one
    impl = "native" if (caps.get("megatron") or {}).get("asserts_te_cross_entropy") or not te else "te"
    return te, bool(caps.get("apex_fused_wgrad")), impl


def report_file(name: str, results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per arm with a measured peak: planned against measured, and against the baseline."""
    te, apex, impl = _capabilities(results)
    commands = results.get("commands") or {}
    rows = []
    for row in results.get("rows") or []:
        cmd = commands.get(row.get("arm"))
        if cmd is None or row.get("max_allocated_mb") is None:
            continue
        argv = list(cmd.get("argv") or [])
        values = arm_values(argv, cmd.get("env") or {}, row.get("intended") or {}, apex, impl)
        try:
            plan = plan_peak(argv, values, te, apex)
        except memory.Unknown as why:
            rows.append({"results": name, "arm": row["arm"], "shape": shape_words(argv), "note": str(why)})
            continue
        measured = round(float(row["max_allocated_mb"]), 1)
        tolerance, ok = within(plan["planned_mb"], measured)
        rows.append({"results": name, "arm": row["arm"], "baseline": bool(row.get("baseline")), "shape": shape_words(argv),
                     "moe_values": {d: bool(values.get(d)) for d in MOE_DESTS}, **plan, "measured_mb": measured,
                     "error_mb": round(plan["planned_mb"] - measured, 1),
                     "error_pct": round(100 * (plan["planned_mb"] / measured - 1), 2) if measured else None,
                     "tolerance_mb": tolerance, "within": ok})
    _against_baseline(rows)
    return rows


def _against_baseline(rows: list[dict[str, Any]]) -> None:
    """Each arm's planned and measured change against the baseline arm of its results."""
    base = next((r for r in rows if r.get("baseline") and "planned_mb" in r), None)
    if base is None:
        return
    for r in rows:
        if r is base or "planned_mb" not in r:
            continue
        planned, measured = round(r["planned_mb"] - base["planned_mb"], 1), round(r["measured_mb"] - base["measured_mb"], 1)
        tolerance, ok = within(planned, measured, CHANGE_REL_TOL, CHANGE_ABS_TOL_MB)
        r["change"] = {"against": base["arm"], "planned_mb": planned, "measured_mb": measured,
                       "tolerance_mb": tolerance, "within": ok, "wrong_sign": not ok and planned * measured < 0}


def results_files(paths: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Each results.json named or found under a directory named, with a name free of machine paths
    (the file's last two path parts)."""
    out = []
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise BadInput(f"{given}: no such file or directory")
        found = sorted(path.rglob("results.json")) if path.is_dir() else [path]
        if not found:
            raise BadInput(f"{given}: no results.json there")
        for f in found:
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError) as error:
                raise BadInput(f"{f}: not an ablate results file ({error})") from None
            rows = data.get("rows") if isinstance(data, dict) else None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise BadInput(f"{f}: not an ablate results file (not a JSON object with a list of rows)")
            if not data["rows"]:
                raise BadInput(f"{f}: an empty results set (no rows)")
            out.append(("/".join(f.parts[-2:]), data))
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    planned = [r for r in rows if "planned_mb" in r]
    ok = sum(r["within"] for r in planned)
    lines = [f"MoE memory model against measured peak allocated memory: {ok} of {len(planned)} arms within "
             "15 % or 300 MB of the measured peak; each arm's change against the baseline within 25 % of the "
             "measured change or 16 MB. Written by bench/moe_memory_validation.py from ablate results.", "",
             "| results | shape | arm | MoE toggles on | planned MB | measured MB | error MB | error | within "
             "| change vs baseline: planned / measured MB |", "|---|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "planned_mb" not in r:
            lines.append(f"| {r['results']} | {r['shape']} | {r['arm']} | | | | | | no plan | {r['note']} |")
            continue
        on = ", ".join(d.removeprefix("moe_") for d, v in r["moe_values"].items() if v) or "none"
        change = r.get("change")
        verdict = "yes" if change and change["within"] else "NO, wrong sign" if change and change["wrong_sign"] else "NO"
        words = "baseline" if r.get("baseline") else "-" if change is None else (
            f"{change['planned_mb']:+.0f} / {change['measured_mb']:+.0f} ({verdict})")
        lines.append(f"| {r['results']} | {r['shape']} | {r['arm']} | {on} | {r['planned_mb']:.0f} | {r['measured_mb']:.0f} "
                     f"| {r['error_mb']:+.0f} | {r['error_pct']:+.1f} % | {'yes' if r['within'] else 'NO'} | {words} |")
    return "\n".join(lines) + "\n"


def cmd_report(ns: argparse.Namespace) -> int:
    rows = [r for name, results in results_files(ns.results) for r in report_file(name, results)]
    text = markdown(rows)
    print(text)
    if ns.write:
        out = Path(ns.out_dir) if ns.out_dir else OUT
        out.mkdir(parents=True, exist_ok=True)
        payload = {"tolerance": {"relative": REL_TOL, "absolute_mb": ABS_TOL_MB},
                   "change_tolerance": {"relative": CHANGE_REL_TOL, "absolute_mb": CHANGE_ABS_TOL_MB}, "rows": rows}
        (out / "moe_memory_validation.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        (out / "moe_memory_validation.md").write_text(text)
    missed = [r for r in rows if "planned_mb" in r and not r["within"]]
    return 1 if missed or not any("planned_mb" in r for r in rows) else 0


# --- run: a few short dedicated runs ---------------------------------------------------------------

COMMON = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
          "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings", "4096",
          "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
          "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0.0",
          "--hidden-dropout", "0.0", "--transformer-impl", "transformer_engine", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--lr", "3e-4", "--lr-warmup-iters", "0", "--bf16", "--use-distributed-optimizer",
          "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--mock-data", "--seed", "1234",
          "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000", "--no-gradient-accumulation-fusion",
          "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
          "--moe-aux-loss-coeff", "1e-2"]
SHAPES = {"mixtral-a": ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "4096"],
          "fine-b": ["--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768"]}
ARMS = {"none": [], **{d.removeprefix("moe_"): [f"--{d.replace('_', '-')}"] for d in MOE_DESTS}}
STAND_IN = "import sys; print('stand-in run:', len(sys.argv) - 1, 'arguments')\n"


def _run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "MEGATRON_PERF_TOGGLES"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29563",
               CUDA_DEVICE_MAX_CONNECTIONS="1", NO_VCS_VERSION="1")
    return env


def run_one(script: Path, argv: list[str], probe: Path, cwd: Path) -> dict[str, Any]:
    """One process under bench/peak_probe.py; its probe record (peak allocated, status)."""
    cmd = [sys.executable, str(REPO / "bench" / "peak_probe.py"), str(probe), str(script), *argv]
    env = _run_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), str(REPO), env.get("PYTHONPATH", "")) if p)
    start = time.time()
    done = subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True, timeout=600)
    record = json.loads(probe.read_text()) if probe.exists() else {"status": "no probe record"}
    record.update(exit=done.returncode, seconds=round(time.time() - start, 1), tail=(done.stdout + done.stderr)[-2000:])
    return record


def cmd_run(ns: argparse.Namespace) -> int:
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if ns.smoke:
        script, cwd = out / "stand_in.py", out
        script.write_text(STAND_IN)
    else:
        cwd = Path(ns.megatron).resolve()
        script = cwd / "pretrain_gpt.py"
    for shape in ns.shapes.split(","):
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: {shape} is not one of {', '.join(SHAPES)}")
        rows, commands = [], {}
        for arm, flags in ARMS.items():
            argv = [*COMMON, *SHAPES[shape], *flags, "--train-iters", str(ns.iters)]
            rec = run_one(script, argv, out / f"{shape}.{arm}.probe.json", cwd)
            print(f"{shape} {arm}: {rec.get('status')} exit {rec['exit']}, max allocated {rec.get('max_allocated_mb')}",
                  flush=True)
            rows.append({"arm": arm, "baseline": arm == "none", "max_allocated_mb": rec.get("max_allocated_mb"),
                         "probe": {k: rec.get(k) for k in ("status", "error", "exit", "seconds", "max_reserved_mb")}})
            commands[arm] = {"argv": ["python3", "pretrain_gpt.py", *argv], "env": {}}
        caps = {"te_version": ns.te_version, "apex_fused_wgrad": False}
        result = {"rows": rows, "commands": commands, "versions": {"capabilities": caps}}
        (out / shape).mkdir(exist_ok=True)
        (out / shape / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="each arm's planned peak against its measured one")
    rep.add_argument("results", nargs="+", help="ablate results.json files, or directories holding them")
    rep.add_argument("--write", action="store_true", help="write moe_memory_validation.{json,md}")
    rep.add_argument("--out-dir", help="where --write writes (default docs/benchmarks)")
    rep.set_defaults(func=cmd_report)
    run = sub.add_parser("run", help="short dedicated runs of stock Megatron on two MoE shapes")
    run.add_argument("--megatron", help="a Megatron-LM checkout (not needed with --smoke)")
    run.add_argument("--out", required=True, help="directory for the results")
    run.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    run.add_argument("--iters", type=int, default=3, help="training iterations per run (default 3)")
    run.add_argument("--te-version", default="2.20.2", help="the Transformer Engine the runs use (for the plan)")
    run.add_argument("--smoke", action="store_true", help="a stand-in script instead of Megatron (CPU)")
    run.set_defaults(func=cmd_run)
    ns = parser.parse_args(argv)
    if ns.command == "run" and not ns.smoke and not ns.megatron:
        parser.error("run needs --megatron PATH (or --smoke)")
    try:
        return int(ns.func(ns))
    except BadInput as why:
        print(f"moe_memory_validation: {' '.join(str(why).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
