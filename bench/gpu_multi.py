"""Multi-GPU and lifecycle evidence on GPUs (no Transformer Engine needed: local layers). Throughput
at DP=2 is an ablation: ``bench/h200_ablate.py --parts dp2``.

  mismatch  DP=2 with GRAD_REDUCE_IN_BF16=0 injected on rank 1 only: every rank must stop with
            RankMismatchError before the first iteration; reports how long that took.
  resume    train, stop, resume (--save/--load): same tagged log dir (no double tag), same
            decisions; then a resume with a numerics-only toggle changed must warn and name it, and
            one with GRAD_REDUCE_IN_BF16=0 must keep the saved bf16 buffer (its checkpoint layout).
  nccl      DP=2, off vs on, a few iterations with NCCL's collective log (NCCL_DEBUG=INFO,
            NCCL_DEBUG_SUBSYS=COLL): the gradient bytes each step really reduce-scatters, by dtype,
            checked against the bytes computed from the parameter count.
  fixture   a few iterations on another Megatron version, for log-parser fixtures.

    python bench/gpu_multi.py MODE --megatron PATH --out DIR

Checkpoints go under DIR/ck: leave them out when packing results (they are gigabytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_perf_toggles.tools.megatron_log import parse_file  # noqa: E402
from megatron_perf_toggles.tools.nccl_log import grad_buffer_bytes, nccl_traffic, param_count  # noqa: E402

LOCAL = ["--transformer-impl", "local", "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-rope-fusion"]
COMMON = ["--bf16", "--use-distributed-optimizer", "--tokenizer-type", "NullTokenizer", "--mock-data",
          "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
          "--log-interval", "1", "--log-throughput", "--eval-iters", "0", "--eval-interval", "100000",
          "--seed", "1234", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear", "--untie-embeddings-and-output-weights", *LOCAL]
DP2_MODEL = ["--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
             "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--vocab-size", "128256"]
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", "1024", "--ffn-hidden-size", "4096", "--num-attention-heads", "8",
               "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "2",
               "--global-batch-size", "4", "--vocab-size", "32000"]
FIXED_OFF = {"GRADIENT_ACCUMULATION_FUSION": "0", "CROSS_ENTROPY_LOSS_FUSION": "0", "FUSED_SINGLE_QKV_ROPE": "0"}


def base_env(megatron: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(megatron).resolve()), str(REPO), env.get("PYTHONPATH", "")])
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Megatron appends `git rev-parse HEAD` of whatever checkout encloses its tree to its version.
    env.setdefault("NO_VCS_VERSION", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def run(cmd: list[str], env: dict[str, str], log: Path, timeout: int = 400) -> tuple[int, float]:
    start = time.monotonic()
    with open(log, "w") as fh:
        try:
            code = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -9
    return code, time.monotonic() - start


def torchrun(n: int, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port", str(port)]


def dp2_arm(ns: argparse.Namespace, log: Path, on: bool, port: int, iters: int, extra_args: tuple[str, ...] = (),
            extra_env: dict[str, str] | None = None) -> tuple[int, float]:
    """One DP=2 launch with GRAD_REDUCE_IN_BF16 and DDP_AVERAGE_IN_COLLECTIVE both on or both off."""
    env = {**base_env(ns.megatron), **FIXED_OFF, **(extra_env or {}),
           "GRAD_REDUCE_IN_BF16": "1" if on else "0", "DDP_AVERAGE_IN_COLLECTIVE": "1" if on else "0"}
    script = str(Path(ns.megatron) / "pretrain_gpt.py")
    return run([*torchrun(2, port), "-m", "megatron_perf_toggles.run", script, *DP2_MODEL, *COMMON,
                "--train-iters", str(iters), *extra_args], env, log)


def nccl(ns: argparse.Namespace, out: Path) -> dict:
    iters = 6
    results = {}
    for on in (False, True):
        name = "on" if on else "off"
        log = out / f"nccl_{name}.log"
        code, secs = dp2_arm(ns, log, on, 29650 + len(results), iters,
                             extra_env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "COLL"})
        text = log.read_text(errors="replace")
        n = param_count(log.read_text(errors="replace"))
        traffic = nccl_traffic(text, iters)
        rs = {k: v for k, v in traffic["large_per_step"].items() if k.startswith(("ReduceScatter/", "AllReduce/"))}
        measured = sum(v["buffer_bytes"] for v in rs.values())
        expected = grad_buffer_bytes(n, on) if n else None
        results[name] = {"returncode": code, "seconds": secs, "parameters": n, "traffic": traffic,
                         "grad_reduction_bytes_per_step_measured": measured,
                         "grad_reduction_bytes_per_step_expected": expected,
                         "measured_over_expected": measured / expected if expected else None,
                         "error_tail": text.splitlines()[-20:] if code else None}
        print(f"nccl {name:<4} rc={code} params={n} grad bytes/step measured={measured:.0f} expected={expected} "
              f"reductions={sorted(rs)}", flush=True)
    return results


def mismatch(ns: argparse.Namespace, out: Path) -> dict:
    script = str(Path(ns.megatron) / "pretrain_gpt.py")
    env = {**base_env(ns.megatron), **FIXED_OFF}
    args = [*SMALL_MODEL, *COMMON, "--train-iters", "5"]
    log = out / "mismatch.log"
    cmd = [*torchrun(2, 29700), str(REPO / "bench" / "rank_env_shim.py"), "1", "GRAD_REDUCE_IN_BF16=0", script, *args]
    code, secs = run(cmd, env, log, timeout=300)
    text = log.read_text(errors="replace")
    errors = [ln for ln in text.splitlines() if "RankMismatchError" in ln and "differ across ranks" in ln]
    result = {"returncode": code, "seconds_to_exit": secs, "error_lines": errors[:4],
              "iterations_run": len(parse_file(str(log)).iterations)}
    print(f"mismatch rc={code} in {secs:.1f}s, {len(errors)} error lines, iterations={result['iterations_run']}",
          flush=True)
    return result


def resume(ns: argparse.Namespace, out: Path) -> dict:
    script = str(Path(ns.megatron) / "pretrain_gpt.py")
    env = {**base_env(ns.megatron), **FIXED_OFF}
    ck, tb = out / "ck", out / "tb"
    common = [*SMALL_MODEL, *COMMON, "--save", str(ck), "--load", str(ck), "--save-interval", "4",
              "--tensorboard-dir", str(tb)]
    steps = {}
    # One schedule (--train-iters 12) for every leg, as a real job has: Megatron refuses a resume
    # whose lr/wd schedule differs. The first two legs stop early through --exit-interval.
    # Then two changed resumes: a numerics-only toggle (warned, resumes), and grad_reduce_in_bf16,
    # which names the distributed optimizer's checkpoint state here (the plugin keeps the saved value).
    legs = (("first", ["--exit-interval", "4"], {}), ("resumed", ["--exit-interval", "8"], {}),
            ("resumed_changed_numerics", ["--exit-interval", "10"], {"DDP_AVERAGE_IN_COLLECTIVE": "0"}),
            ("resumed_changed_layout", [], {"GRAD_REDUCE_IN_BF16": "0"}))
    for name, stop, extra_env in legs:
        log = out / f"resume_{name}.log"
        code, _secs = run([*torchrun(1, 29800), "-m", "megatron_perf_toggles.run", script, *common,
                          "--train-iters", "12", *stop], {**env, **extra_env}, log)
        text = log.read_text(errors="replace")
        parsed = parse_file(str(log))
        steps[name] = {
            "returncode": code,
            "first_iteration": parsed.iterations[0].iteration if parsed.iterations else None,
            "last_iteration": parsed.iterations[-1].iteration if parsed.iterations else None,
            "decisions": [ln for ln in text.splitlines() if ln.startswith("[perf-toggles]") and ": " in ln],
            "resume_warnings": [ln for ln in text.splitlines() if "resuming from" in ln],
            "loaded_checkpoint": "successfully loaded checkpoint" in text.lower(),
        }
        print(f"resume {name}: rc={code} iterations {steps[name]['first_iteration']}..{steps[name]['last_iteration']} "
              f"warnings={steps[name]['resume_warnings']}", flush=True)
    steps["tensorboard_tree"] = sorted(str(p.relative_to(tb)) for p in tb.rglob("*") if p.is_dir())
    return steps


def fixture(ns: argparse.Namespace, out: Path) -> dict:
    script = str(Path(ns.megatron) / "pretrain_gpt.py")
    env = {**base_env(ns.megatron), **FIXED_OFF}
    log = out / f"fixture_{Path(ns.megatron).name}.log"
    code, _secs = run([*torchrun(1, 29900), "-m", "megatron_perf_toggles.run", script, *SMALL_MODEL, *COMMON,
                      "--train-iters", "6"], env, log)
    print(f"fixture {log.name} rc={code} iterations={len(parse_file(str(log)).iterations)}", flush=True)
    return {"returncode": code, "log": log.name}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("nccl", "mismatch", "resume", "fixture"))
    ap.add_argument("--megatron", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=19)
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"nccl": nccl, "mismatch": mismatch, "resume": resume, "fixture": fixture}[ns.mode](ns, out)
    (out / f"{ns.mode}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
