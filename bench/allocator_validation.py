"""The memory plan's verdicts against what the GPU did: layouts near the edge of the card, each run as
stock Megatron and with the plugin's defaults, with and without expandable segments.

    python bench/allocator_validation.py run --megatron PATH --out DIR [--layouts a,b] [--iters 3]   # on the GPU
    python bench/allocator_validation.py report --megatron PATH --results DIR [--write]               # anywhere

``run`` starts one process per (layout, arm, allocator setting), one after another on one GPU:
stock is the tree's own ``pretrain_gpt.py`` (with ``--no-gradient-accumulation-fusion``: stock
cannot run fusion without APEX), the defaults arm is the same command line through the plugin's
launcher. Each process runs under ``bench/peak_probe.py``, which writes torch's peak allocated and
peak reserved memory, the card's size and whether it ran out of memory, however the process ends.

``report`` plans each run as the plugin would (the tree's parser through ``explain``'s planning,
the allocator setting of that run, the card size the run saw) and compares the plan's verdict and
peaks with what happened. ``--write`` writes docs/benchmarks/allocator_validation.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from h200_ablate import MODEL  # noqa: E402

from megatron_perf_toggles.tools.ablate.runs import set_args  # noqa: E402

SMALL_LOGITS = {"--hidden-size": "1024", "--ffn-hidden-size": "3584", "--num-attention-heads": "16",
                "--num-query-groups": "4", "--vocab-size": "256000", "--seq-length": "4096",
                "--max-position-embeddings": "4096"}
DEEP = {"--seq-length": "8192", "--max-position-embeddings": "8192", "--micro-batch-size": "1",
        "--global-batch-size": "2"}
# Each layout near the H200's edge, two micro-batches per step; one varies the tokens per
# micro-batch, one the vocabulary's share, one the layers (see docs/memory.md for the choice).
LAYOUTS: dict[str, dict[str, str]] = {
    "logits-57k": {**SMALL_LOGITS, "--micro-batch-size": "14", "--global-batch-size": "28"},
    "logits-41k": {**SMALL_LOGITS, "--micro-batch-size": "10", "--global-batch-size": "20"},
    "deep-20l": {**DEEP, "--num-layers": "20"},
    # Not run yet: a layout that does not fit at all, and one just past the fixed-segment rule's edge.
    "deep-28l": {**DEEP, "--num-layers": "28"},
    "logits-49k": {**SMALL_LOGITS, "--micro-batch-size": "12", "--global-batch-size": "24"},
}
ARMS = ("stock", "defaults")
ALLOC = {"fixed": None, "expandable": "expandable_segments:True"}
RESULTS = REPO / "docs" / "benchmarks"


def argv_of(layout: str, iters: int) -> list[str]:
    return set_args(MODEL, {**LAYOUTS[layout], "--train-iters": str(iters), "--lr-warmup-iters": "0"})


def _env(alloc: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "MEGATRON_PERF_TOGGLES"))}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561",
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    if alloc:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc
    return env


def run_one(tree: Path, layout: str, arm: str, alloc: str, iters: int, out: Path) -> dict[str, Any]:
    """One process; its probe record, the command and the tail of its output."""
    name = f"{layout}.{arm}.{alloc}"
    probe = out / f"{name}.probe.json"
    argv = argv_of(layout, iters)
    if arm == "stock":
        cmd = [sys.executable, str(REPO / "bench" / "peak_probe.py"), str(probe), str(tree / "pretrain_gpt.py"),
               *argv, "--no-gradient-accumulation-fusion"]
    else:
        cmd = [sys.executable, str(REPO / "bench" / "peak_probe.py"), str(probe), "-m", "megatron_perf_toggles.run",
               str(tree / "pretrain_gpt.py"), *argv]
    env = _env(ALLOC[alloc])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), str(REPO), env.get("PYTHONPATH", "")) if p)
    start = time.time()
    done = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    record = json.loads(probe.read_text()) if probe.exists() else {"status": "no probe record"}
    probe.unlink(missing_ok=True)
    record.update(layout=layout, arm=arm, alloc=alloc, exit=done.returncode, seconds=round(time.time() - start, 1),
                  argv=argv, plugin_lines=[ln for ln in text.splitlines() if "perf-toggles" in ln][-40:],
                  memory_lines=[ln for ln in text.splitlines() if "memory (MB)" in ln][-4:], tail=text[-3000:])
    print(f"{name}: {record.get('status')} exit {done.returncode}, max allocated "
          f"{record.get('max_allocated_mb')}, max reserved {record.get('max_reserved_mb')} ({record['seconds']} s)",
          flush=True)
    return record


def cmd_run(ns: argparse.Namespace) -> int:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    layouts = ns.layouts.split(",") if ns.layouts else list(LAYOUTS)
    path = out / "runs.json"
    records = json.loads(path.read_text()) if path.exists() else []
    for layout in layouts:
        for alloc in ns.allocs.split(","):
            for arm in ns.arms.split(","):
                records.append(run_one(Path(ns.megatron).resolve(), layout, arm, alloc, ns.iters, out))
                path.write_text(json.dumps(records, indent=1))  # one file: what a run left so far
    return 0


def predict(tree: str, argv: list[str], arm: str, alloc: str) -> dict[str, Any]:
    """The plan for one run, as the plugin makes it: the tree's parser, the run's allocator setting
    and the H200's size from the package's GPU table; stock is planned with every toggle at
    Megatron's value (the plugin off)."""
    from megatron_perf_toggles.runtime.machine import target as planned
    from megatron_perf_toggles.tools.planning import plan_command_line

    env = _env(ALLOC[alloc])
    if arm == "stock":
        env["MEGATRON_PERF_TOGGLES"] = "0"
        argv = [*argv, "--no-gradient-accumulation-fusion"]
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        plan = plan_command_line(argv, tree=tree, target=planned.make_target(1, gpu="h200"))[0]
    finally:
        os.environ.clear()
        os.environ.update(saved)
    memory = plan.memory or {}
    need = memory.get("allocator_need_mb") or {}
    return {"verdict": (memory.get("verdict") or {}).get("plan"), "planned_peak_mb": memory.get("planned_peak_mb"),
            "largest_allocation_mb": memory.get("largest_allocation_mb"), "limit_mb": memory.get("limit_mb"),
            "need_mb": need.get("expandable_segments" if alloc == "expandable" else "fixed_segments"),
            "decisions": {d: x.value for d, x in plan.decisions.items()}}


def gpu_oom(rec: dict[str, Any]) -> bool:
    """Whether the caching allocator gave up on GPU memory (torch's OutOfMemoryError, nothing else)."""
    return str(rec.get("error") or "").startswith("OutOfMemoryError")


def outcome(rec: dict[str, Any]) -> str:
    if rec.get("exit") == 0 and not rec.get("error"):
        return "ran"
    return "out of memory" if gpu_oom(rec) else f"failed: {str(rec.get('error')).split(':')[0]}"


def expected(verdict: str | None, alloc: str) -> str:
    """What the plan's verdict says the GPU will do with this allocator setting."""
    if verdict == "fits" or (verdict == "fits_with_expandable_segments" and alloc == "expandable"):
        return "ran"
    return "out of memory"


def held(row: dict[str, Any]) -> bool:
    """The verdict held: the GPU ran out of memory exactly where the plan said it would (a job that
    failed for another reason holds where the plan said it fits and the GPU did not run out)."""
    return (row["expected"] == "out of memory") == (row["outcome"] == "out of memory")


def cmd_report(ns: argparse.Namespace) -> int:
    rows = []
    records = [r for path in sorted(Path(ns.results).glob("*.json")) for r in json.loads(path.read_text())]
    for rec in records:
        plan = predict(ns.megatron, rec["argv"], rec["arm"], rec["alloc"])
        rows.append({**{k: rec.get(k) for k in ("layout", "arm", "alloc", "max_allocated_mb", "max_reserved_mb",
                                                 "total_mb", "error", "failed_in")},
                     "outcome": outcome(rec), "plan": plan, "expected": expected(plan["verdict"], rec["alloc"])})
    rows.sort(key=lambda r: (r["layout"], r["alloc"], r["arm"]))
    ok, ran = sum(map(held, rows)), sum(r["outcome"] == "ran" for r in rows)
    lines = [f"Allocator verdicts against the H200: in {ok} of {len(rows)} runs the GPU ran out of memory exactly "
             f"where the plan said it would; {ran} ran to the end.", "",
             "| layout | arm | allocator | plan's verdict | happened | planned peak MB | measured peak allocated MB "
             "| allocator's need MB (plan) | measured peak reserved MB | largest allocation MB |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["plan"]
        lines.append(f"| {r['layout']} | {r['arm']} | {r['alloc']} | {p['verdict']} | {r['outcome']} | "
                     f"{p['planned_peak_mb']} | {r['max_allocated_mb'] and round(r['max_allocated_mb'])} | "
                     f"{p['need_mb']} | {r['max_reserved_mb'] and round(r['max_reserved_mb'])} | "
                     f"{p['largest_allocation_mb']} |")
    lines += [f"\n{r['layout']} {r['arm']} {r['alloc']} failed in {r['failed_in']}." for r in rows if r.get("failed_in")]
    print("\n".join(lines))
    if ns.write:
        (RESULTS / "allocator_validation.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        (RESULTS / "allocator_validation.md").write_text("\n".join(lines) + "\n")
    return 0 if ok == len(rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every layout on this machine's GPU")
    run.add_argument("--megatron", required=True, help="a Megatron-LM checkout")
    run.add_argument("--out", required=True, help="directory for the records and logs")
    run.add_argument("--layouts", help=f"comma list of {', '.join(LAYOUTS)} (default: all)")
    run.add_argument("--arms", default=",".join(ARMS), help="comma list of stock, defaults (default: both)")
    run.add_argument("--allocs", default=",".join(ALLOC), help="comma list of fixed, expandable (default: both)")
    run.add_argument("--iters", type=int, default=3, help="training iterations per run (default 3)")
    run.set_defaults(func=cmd_run)
    rep = sub.add_parser("report", help="the plan of each run against what happened")
    rep.add_argument("--megatron", required=True, help="the Megatron-LM checkout the runs used")
    rep.add_argument("--results", required=True, help="a directory of `run`'s runs.json files (any names)")
    rep.add_argument("--write", action="store_true", help="write docs/benchmarks/allocator_validation.*")
    rep.set_defaults(func=cmd_report)
    ns = parser.parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
