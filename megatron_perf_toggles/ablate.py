"""``megatron-perf-toggles ablate``: controlled toggle experiments that cannot be confounded.

1. Expand the design into arms (ablate_design).
2. Confound check: resolve every arm's full effective Megatron arguments through the plugin's dry
   run (Megatron's real parser and validate_args). Refuse to start when two arms differ in
   anything besides the intended variables (shown as a diff), or when an arm does not get its
   intended value (a guard forced it).
3. Run the arms one after another through the given launcher, each with its own log; resume
   skips finished arms; a crashed arm is recorded as failed and the others go on.
4. Measure from Megatron's own log lines and report against the design's baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import __version__
from .ablate_design import DESIGNS, Arm, DesignError, expand, parse_toggles, parse_vary
from .errors import PerfTogglesError, fail
from .megatron_log import parse_file

# Arguments that legitimately differ between arms, or are bookkeeping, not the experiment.
NOT_COMPARED = {"perf_toggles", "perf_toggles_precision", "rank", "local_rank", "world_size"}
DRY_RUN_TIMEOUT_S = 600
# Arguments Megatron's validate_args derives from a toggle, so they differ exactly when it does.
# Listed explicitly (read off real dry runs): a heuristic could excuse a real confound.
DERIVED: dict[str, tuple[str, ...]] = {
    "grad_reduce_in_bf16": ("accumulate_allreduce_grads_in_fp32",),
    # The impl only matters with the fusion on; the plugin's guard resolves it then.
    "cross_entropy_loss_fusion": ("cross_entropy_fusion_impl",),
}


class ConfoundError(PerfTogglesError):
    """Arms differ in more than the intended variables, or do not get their intended values."""


# --- confound check ---------------------------------------------------------------------------


def dry_run_command(script: str, megatron_args: Sequence[str], arm: Arm) -> list[str]:
    return [sys.executable, "-m", "megatron_perf_toggles.run", "--dry-run", script, *megatron_args,
            *arm.extra_args()]


def resolve_arm(script: str, megatron_args: Sequence[str], arm: Arm, environ: dict[str, str]) -> dict[str, Any]:
    """The arm's dry-run record (decisions + effective Megatron arguments after validate_args)."""
    cmd = dry_run_command(script, megatron_args, arm)
    # One process, as rank 0: a dry run under a job's RANK=3 would print no record.
    env = {k: v for k, v in environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**env, "RANK": "0", **arm.env()},
                              timeout=DRY_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ConfoundError(f"arm {arm.name}: the dry run took over {DRY_RUN_TIMEOUT_S}s and was stopped") from None
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ConfoundError(f"arm {arm.name}: the dry run failed (exit {proc.returncode}): {tail}")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise ConfoundError(f"arm {arm.name}: the dry run printed no JSON record") from None


def resolve_all(resolver: Callable[..., dict[str, Any]], script: str, megatron_args: Sequence[str],
                arms: Sequence[Arm], environ: dict[str, str]) -> list[dict[str, Any]]:
    """Dry-run the arms a few at a time (each is one Megatron import, CPU-bound)."""
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(len(arms), (os.cpu_count() or 2), 4))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda arm: resolver(script, megatron_args, arm, environ), arms))


def _diff(base: dict[str, Any], other: dict[str, Any], ignore: set[str]) -> dict[str, tuple[Any, Any]]:
    keys = (set(base) | set(other)) - ignore
    return {k: (base.get(k), other.get(k)) for k in sorted(keys) if base.get(k) != other.get(k)}


def check_confounds(arms: Sequence[Arm], records: Sequence[dict[str, Any]]) -> None:
    """Raise ConfoundError naming every problem; return quietly when the arms are clean."""
    problems: list[str] = []
    intended_names = {name for arm in arms for name in arm.intended()}
    for arm, rec in zip(arms, records, strict=True):
        decisions = rec.get("decisions", {})
        effective = rec.get("effective_args", {})
        for dest, want in arm.toggles.items():
            got = decisions.get(dest, {})
            if got.get("value") != want:
                problems.append(f"arm {arm.name}: {dest} should be {want} but is {got.get('value')} "
                                f"({got.get('source')}; {got.get('reason')})")
        for name, want in arm.settings.items():
            if name in effective and str(effective[name]) != str(want) and _as_float(effective[name]) != _as_float(want):
                problems.append(f"arm {arm.name}: {name} should be {want} but Megatron resolved {effective[name]}")
    base = records[0].get("effective_args", {})
    derived = _derived_keys(arms, records, intended_names)
    for arm, rec in zip(arms[1:], records[1:], strict=True):
        diff = _diff(base, rec.get("effective_args", {}), NOT_COMPARED | intended_names | derived)
        if diff:
            lines = [f"    {k}: {arms[0].name}={a!r}  {arm.name}={b!r}" for k, (a, b) in diff.items()]
            problems.append(f"arm {arm.name} differs from {arms[0].name} beyond the intended variables:\n"
                            + "\n".join(lines))
    fingerprints = {json.dumps(r.get("effective_args", {}), sort_keys=True) for r in records}
    if len(fingerprints) < len(records) and not problems:
        problems.append("two arms resolve to identical Megatron arguments: they cannot measure a difference")
    if problems:
        raise ConfoundError("confound check failed, nothing was run:\n  " + "\n  ".join(problems))


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _derived_keys(arms: Sequence[Arm], records: Sequence[dict[str, Any]], intended: set[str]) -> set[str]:
    """Arguments that Megatron's validate_args derives from an intended variable (see DERIVED)."""
    return {key for name in intended for key in DERIVED.get(name, ())}


# --- running ----------------------------------------------------------------------------------


def arm_command(launch: str | None, script: str, megatron_args: Sequence[str], arm: Arm,
                paths: Sequence[str] = ()) -> list[str]:
    prefix = shlex.split(launch) if launch else [sys.executable]
    return [*prefix, "-m", "megatron_perf_toggles.run", script, *megatron_args, *arm.extra_args(), *paths]


def arm_paths(effective: dict[str, Any], directory: Path) -> list[str]:
    """Each arm its own log directory and checkpoints, so no arm resumes from or overwrites another.
    A ``--load`` other than ``--save`` (a pretrained start) is shared: arms only read it."""
    out = ["--tensorboard-dir", str(directory / "tensorboard")]
    if effective.get("wandb_save_dir"):
        out += ["--wandb-save-dir", str(directory / "wandb")]
    if effective.get("save"):
        out += ["--save", str(directory / "checkpoints")]
        if effective.get("load") == effective.get("save"):
            out += ["--load", str(directory / "checkpoints")]
    return out


def arm_dir(out: Path, arm: Arm) -> Path:
    return out / "arms" / _slug(arm.name)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in name)


class Progress:
    """One status line on stderr: arm i/N, iteration, ETA."""

    def __init__(self, total_arms: int, stream: Any = None) -> None:
        self.total = total_arms
        self.stream = stream or sys.stderr
        self.arm_seconds: list[float] = []

    def update(self, index: int, name: str, iteration: int, total_iters: int, ms_per_iter: float | None,
               remaining_arms: int) -> None:
        eta = ""
        if ms_per_iter and total_iters:
            left = (total_iters - iteration) * ms_per_iter / 1000
            per_arm = statistics.median(self.arm_seconds) if self.arm_seconds else total_iters * ms_per_iter / 1000
            eta = f" ETA arm {left:5.0f}s, all {left + remaining_arms * per_arm:6.0f}s"
        width = 24
        done = int(width * iteration / total_iters) if total_iters else 0
        bar = "#" * done + "." * (width - done)
        self.stream.write(f"\r[arm {index}/{self.total}] {name[:28]:<28} [{bar}] it {iteration}/{total_iters}{eta}   ")
        self.stream.flush()

    def finish_arm(self, seconds: float, status: str) -> None:
        self.arm_seconds.append(seconds)
        self.stream.write(f" {status} in {seconds:.0f}s\n")
        self.stream.flush()


def run_arms(arms: Sequence[Arm], commands: Sequence[list[str]], out: Path, environ: dict[str, str],
             progress: Progress | None = None) -> list[dict[str, Any]]:
    """Run each arm unless its status says done; a failed arm is recorded and the rest go on."""
    from .megatron_log import ITERATION, parse_lines

    progress = progress or Progress(len(arms))
    statuses: list[dict[str, Any]] = []
    for i, (arm, cmd) in enumerate(zip(arms, commands, strict=True), start=1):
        here = arm_dir(out, arm)
        here.mkdir(parents=True, exist_ok=True)
        status_file = here / "status.json"
        if status_file.exists():
            try:
                previous = json.loads(status_file.read_text())
            except ValueError:
                previous = {}  # torn by a kill: run the arm again
            if previous.get("status") == "done" and previous.get("command") == cmd:
                progress.stream.write(f"[arm {i}/{len(arms)}] {arm.name}: done earlier, skipped\n")
                statuses.append(previous)
                continue
        log_path = here / "log.txt"
        start = time.monotonic()
        last_ms: float | None = None
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**environ, **arm.env()}, bufsize=1)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                if ITERATION.search(line):
                    it = parse_lines([line]).iterations[0]
                    last_ms = it.get("ms_per_iter") or last_ms
                    progress.update(i, arm.name, it.iteration, it.total, last_ms, len(arms) - i)
            code = proc.wait()
        seconds = time.monotonic() - start
        tail = log_path.read_text(errors="replace").strip().splitlines()[-15:]
        status = {"arm": arm.name, "status": "done" if code == 0 else "failed", "returncode": code,
                  "seconds": seconds, "command": cmd, "env": arm.env(), "log": str(log_path)}
        if code != 0:
            status["error_tail"] = tail
        status_file.write_text(json.dumps(status, indent=1) + "\n")
        progress.finish_arm(seconds, status["status"])
        statuses.append(status)
    return statuses


# --- measuring and reporting ------------------------------------------------------------------


def measure(arms: Sequence[Arm], statuses: Sequence[dict[str, Any]], warmup: int, seq_length: int | None,
            gpus: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for arm, status in zip(arms, statuses, strict=True):
        row: dict[str, Any] = {"arm": arm.name, "baseline": arm.baseline, "intended": arm.intended(),
                               "status": status.get("status"), "env": arm.env()}
        if status.get("error_tail"):
            row["error_tail"] = status["error_tail"]
        log = parse_file(status["log"]) if status.get("log") and os.path.exists(status["log"]) else None
        if log is not None:
            summary = log.summary(skip_first=warmup)
            row.update(summary)
            row["loss_curve"] = log.series("lm_loss")
            gbs = next((v for _, v in log.series("global_batch_size")), None)
            ms = summary.get("ms_per_iter", {}).get("median")
            if gbs and ms and seq_length:
                row["tokens_per_s_per_gpu"] = gbs * seq_length / (ms / 1000) / max(gpus, 1)
        rows.append(row)
    base = next((r for r in rows if r["baseline"]), rows[0])
    base_ms = base.get("ms_per_iter", {}).get("median")
    base_curve = dict(base.get("loss_curve") or [])
    for row in rows:
        ms = row.get("ms_per_iter", {}).get("median")
        if base_ms and ms:
            row["speedup_vs_baseline"] = base_ms / ms
        curve = dict(row.get("loss_curve") or [])
        common = sorted(set(curve) & set(base_curve))
        if common:
            last = common[-1]
            row["loss_at_last_common_iteration"] = {"iteration": last, "loss": curve[last],
                                                    "baseline_loss": base_curve[last],
                                                    "ratio": curve[last] / base_curve[last] if base_curve[last] else None}
    return rows


def markdown(rows: Sequence[dict[str, Any]], design: str) -> str:
    lines = [f"# Ablation ({design})", "",
             "| arm | status | ms/iter (median) | spread | TFLOP/s/GPU | tokens/s/GPU | speedup vs baseline "
             "| loss @ last common it | loss ratio | max alloc MB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = r.get("ms_per_iter", {})
        tf = r.get("tflops_per_gpu", {})
        loss = r.get("loss_at_last_common_iteration", {})
        mem = (r.get("memory_mb") or {}).get("max_allocated")

        def f(v: Any, fmt: str) -> str:
            return format(v, fmt) if isinstance(v, (int, float)) else "-"

        lines.append(
            f"| {r['arm']}{' (baseline)' if r['baseline'] else ''} | {r['status']} | {f(ms.get('median'), '.1f')} "
            f"| {f(ms.get('min'), '.1f')}–{f(ms.get('max'), '.1f')} | {f(tf.get('median'), '.1f')} "
            f"| {f(r.get('tokens_per_s_per_gpu'), '.0f')} | {f(r.get('speedup_vs_baseline'), '.3f')} "
            f"| {f(loss.get('loss'), '.4f')} (it {loss.get('iteration', '-')}) | {f(loss.get('ratio'), '.4f')} "
            f"| {f(mem, '.0f')} |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
    """Throughput bars with min-max spread, and loss curves. Returns a note when it cannot plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'megatron-perf-toggles[plot]'): results.png not written"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [r["arm"] for r in rows]
    med = [r.get("tflops_per_gpu", {}).get("median", 0) for r in rows]
    lo = [m - r.get("tflops_per_gpu", {}).get("min", m) for m, r in zip(med, rows, strict=True)]
    hi = [r.get("tflops_per_gpu", {}).get("max", m) - m for m, r in zip(med, rows, strict=True)]
    ax1.bar(range(len(rows)), med, yerr=[lo, hi], capsize=4,
            color=["#777" if r["baseline"] else "#3a7" for r in rows])
    ax1.set_xticks(range(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("TFLOP/s/GPU (median, min-max)")
    ax1.set_title("throughput")
    for r in rows:
        curve = r.get("loss_curve") or []
        if curve:
            ax2.plot([i for i, _ in curve], [v for _, v in curve], label=r["arm"], lw=1)
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("lm loss")
    ax2.set_title("loss")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --- command ----------------------------------------------------------------------------------


def _gpus(launch: str | None) -> int:
    if not launch:
        return 1
    words = shlex.split(launch)
    n = nodes = 1
    for i, w in enumerate(words):
        key, _, val = w.partition("=")
        nxt = val or (words[i + 1] if i + 1 < len(words) else "")
        if key in ("--nproc-per-node", "--nproc_per_node") and nxt.isdigit():
            n = int(nxt)
        if key == "--nnodes" and nxt.isdigit():
            nodes = int(nxt)
    return n * nodes


def _check_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise DesignError(f"--out {out}: not writable ({error.strerror or error})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-perf-toggles ablate",
        description="Run a controlled toggle experiment: every arm is resolved through Megatron's real "
        "parser first, and the run is refused if arms differ in anything but the intended variables.",
        epilog="example: megatron-perf-toggles ablate --design factorial --toggles grad_reduce_in_bf16 "
        "--vary adam_eps=1e-8,1e-5 --out runs/2x2 -- pretrain_gpt.py <megatron args>",
    )
    p.add_argument("--design", required=True, choices=DESIGNS,
                   help="one-at-a-time: all off, then each alone; leave-one-out: all on, then each off; "
                   "factorial: every combination (with --vary settings)")
    p.add_argument("--toggles", help="comma list of toggle dests taking part (default: all five on/off toggles)")
    p.add_argument("--vary", action="append", metavar="NAME=V1,V2", help="a Megatron setting to vary (factorial)")
    p.add_argument("--out", default="ablation", help="results directory (default: ./ablation)")
    p.add_argument("--launch", help="launcher prefix, e.g. 'torchrun --nproc-per-node 8' (default: this python)")
    p.add_argument("--warmup", type=int, default=3, help="iterations skipped before steady-state medians")
    p.add_argument("--dry-run", action="store_true", help="check confounds, print arms and commands, run nothing")
    p.add_argument("script", help="the Megatron training script, e.g. pretrain_gpt.py")
    p.add_argument("megatron_args", nargs=argparse.REMAINDER, help="Megatron arguments")
    return p


def main(argv: Sequence[str] | None = None, resolver: Callable[..., dict[str, Any]] = resolve_arm) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    args = [a for a in ns.megatron_args if a != "--"] if ns.megatron_args[:1] == ["--"] else list(ns.megatron_args)
    try:
        if not Path(ns.script).is_file():
            raise DesignError(f"script not found: {ns.script}")
        arms = expand(ns.design, parse_toggles(ns.toggles), parse_vary(ns.vary, _known_args()))
        out = Path(ns.out)
        _check_out(out)
        environ = dict(os.environ)
        print(f"[ablate] {len(arms)} arms ({ns.design}); resolving each through Megatron's parser and "
              "validate_args...", file=sys.stderr, flush=True)
        records = resolve_all(resolver, ns.script, args, arms, environ)
        check_confounds(arms, records)
        commands = [arm_command(ns.launch, ns.script, args, arm,
                                arm_paths(rec.get("effective_args", {}), arm_dir(out, arm)))
                    for arm, rec in zip(arms, records, strict=True)]
        launcher = commands[0][0]
        if shutil.which(launcher) is None and not Path(launcher).is_file():
            raise DesignError(f"--launch: {launcher!r} is not an executable on PATH")
        plan = {"design": ns.design, "arms": [
            {"name": a.name, "baseline": a.baseline, "env": a.env(), "command": c}
            for a, c in zip(arms, commands, strict=True)]}
        (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
        print("[ablate] confound check passed: arms differ only in " + ", ".join(
            sorted({n for a in arms for n in a.intended()})), file=sys.stderr)
        if ns.dry_run:
            for a, c in zip(arms, commands, strict=True):
                env = " ".join(f"{k}={v}" for k, v in a.env().items())
                print(f"{a.name}{' (baseline)' if a.baseline else ''}:\n  {env} {shlex.join(c)}")
            return 0
        statuses = run_arms(arms, commands, out, environ)
        seq = records[0].get("effective_args", {}).get("seq_length")
        rows = measure(arms, statuses, ns.warmup, seq, _gpus(ns.launch))
        write_results(out, ns.design, rows, records, commands, arms)
        failed = [r["arm"] for r in rows if r["status"] != "done"]
        return 1 if failed else 0
    except PerfTogglesError as error:
        fail(error)
    return 2


def write_results(out: Path, design: str, rows: list[dict[str, Any]], records: Sequence[dict[str, Any]],
                  commands: Sequence[list[str]], arms: Sequence[Arm]) -> None:
    import platform

    versions = {"megatron_perf_toggles": __version__, "python": platform.python_version(),
                "megatron": records[0].get("megatron") if records else None,
                "capabilities": records[0].get("capabilities") if records else None}
    payload = {"design": design, "rows": rows, "versions": versions,
               "commands": {a.name: {"env": a.env(), "argv": c} for a, c in zip(arms, commands, strict=True)},
               "environment": {k: v for k, v in os.environ.items()
                               if k.startswith(("MEGATRON_PERF_TOGGLES", "CUDA", "NCCL", "NVTE"))}}
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (out / "results.md").write_text(markdown(rows, design))
    note = plot(rows, out / "results.png")
    if note:
        print(f"[ablate] note: {note}", file=sys.stderr)
    print(markdown(rows, design))


def _known_args() -> set[str] | None:
    """Megatron argument dests, from the recorded main surface: catches typos before any run."""
    from . import replay

    try:
        return {a["dest"] for a in replay.load_surface("main")["actions"]}
    except Exception:  # noqa: BLE001 - without the record, Megatron's parser reports unknown flags
        return None
