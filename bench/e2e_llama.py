"""End-to-end pretrain_gpt.py arms through the launcher, on one or more GPUs: throughput, loss, memory.

The model is the reference one: Llama-3-8B-shaped layers (hidden 4096, ffn 14336, 32 heads,
8 KV groups), 4 layers, seq 4096, micro-batch 2, global batch 16, vocab 128256, mock data,
distributed optimizer, bf16, Transformer Engine. Arms are toggle settings:

  default            the plugin with an empty environment (every default on)
  all-off            every on/off toggle set to 0
  only:DEST          all off but DEST
  without:DEST       all on but DEST

Each arm runs ``python -m megatron_perf_toggles.run pretrain_gpt.py ...`` (or the --launch prefix)
with its own log, parsed by megatron_perf_toggles.megatron_log. Writes OUT/summary.json.

    python bench/e2e_llama.py --megatron PATH --arms all-off,default --iters 20 --out DIR [--fp8 delayed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_perf_toggles.ablate_design import DEFAULT_TOGGLES, Arm  # noqa: E402
from megatron_perf_toggles.megatron_log import parse_file  # noqa: E402

MODEL = [
    "--num-layers", "4", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--position-embedding-type", "rope",
    "--rotary-base", "500000", "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
    "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-eps", "1e-8", "--seed", "1234",
    "--bf16", "--use-distributed-optimizer", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
    "--mock-data", "--transformer-impl", "transformer_engine", "--log-interval", "1", "--log-throughput",
    "--eval-iters", "0", "--eval-interval", "100000",
]
# A small model of the same family for quick optimizer experiments (the adam-eps arm): args that
# replace the reference shape's values.
SMALL = {"--num-layers": "4", "--hidden-size": "1024", "--ffn-hidden-size": "3584", "--num-attention-heads": "16",
         "--num-query-groups": "4", "--seq-length": "1024", "--max-position-embeddings": "1024",
         "--micro-batch-size": "8", "--global-batch-size": "32"}
FP8 = {"delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
       "tensorwise": ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]}


def make_arm(spec: str) -> Arm:
    off = dict.fromkeys(DEFAULT_TOGGLES, False)
    on = dict.fromkeys(DEFAULT_TOGGLES, True)
    if spec == "default":
        return Arm("default", {})
    if spec == "all-off":
        return Arm("all-off", off)
    kind, _, dest = spec.partition(":")
    if dest not in DEFAULT_TOGGLES:
        raise SystemExit(f"unknown toggle in arm {spec!r}; toggles: {', '.join(DEFAULT_TOGGLES)}")
    if kind == "only":
        return Arm(spec, {**off, dest: True})
    if kind == "without":
        return Arm(spec, {**on, dest: False})
    raise SystemExit(f"unknown arm {spec!r}")


def gemm_peak_tflops() -> float | None:
    """The bf16 GEMM rate this GPU reaches now (8192^3, random data): the MFU denominator."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    stop.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(stop) / 20
    return 2 * 8192**3 / ms / 1e9


def portable(cmd: list[str], ns: argparse.Namespace, out: Path) -> list[str]:
    """The arm's command with this machine's paths replaced by placeholders, for the results file."""
    subs = [(str(Path(ns.megatron)), "$MEGATRON"), (str(out), "$OUT")] + ([(ns.data, "$DATA")] if ns.data else [])
    result = []
    for part in cmd:
        for old, new in subs:
            part = part.replace(old, new)
        result.append(part)
    return result


def versions() -> dict:
    """torch, TE and GPU of the machine that ran the arms, for the results file."""
    out: dict = {}
    try:
        import torch

        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        out["transformer_engine"] = version("transformer_engine")
    except Exception:  # noqa: BLE001 - absent or unreadable metadata: leave it out
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", required=True, help="Megatron-LM checkout (pretrain_gpt.py)")
    ap.add_argument("--arms", required=True, help="comma list: default, all-off, only:DEST, without:DEST")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=9, help="iterations left out of the medians")
    ap.add_argument("--fp8", choices=sorted(FP8), help="add an FP8 recipe to every arm")
    ap.add_argument("--launch", default=sys.executable, help="launcher prefix (default: this python)")
    ap.add_argument("--extra", default="", help="extra Megatron args, space separated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--peak", action="store_true", help="also measure the bf16 GEMM peak (for MFU)")
    ap.add_argument("--shape", choices=("llama3-8b-4l", "small"), default="llama3-8b-4l",
                    help="model: the reference Llama-3-8B-shaped 4 layers, or a small model of the same family "
                         "(hidden 1024, ffn 3584, 16 heads, 4 KV groups, seq 1024, global batch 32)")
    ap.add_argument("--data", metavar="PREFIX",
                    help="train on a real-text indexed dataset (bench/text_corpus.py) instead of mock data")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    script = str(Path(ns.megatron) / "pretrain_gpt.py")
    env_base = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PERF_TOGGLES")}
    env_base["PYTHONPATH"] = os.pathsep.join([str(Path(ns.megatron).resolve()), str(REPO), env_base.get("PYTHONPATH", "")])
    env_base.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Megatron appends `git rev-parse HEAD` of whatever checkout encloses its tree to its version.
    env_base.setdefault("NO_VCS_VERSION", "1")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("WORLD_SIZE", "1"), ("RANK", "0"),
                       ("LOCAL_RANK", "0")):
        env_base.setdefault(key, value)  # a plain `python` launch; torchrun sets these itself
    summary: dict = {"iters": ns.iters, "warmup": ns.warmup, "fp8": ns.fp8, "shape": ns.shape, "data": ns.data,
                     "extra": ns.extra, "arms": {}, "python": platform.python_version(), "versions": versions()}
    if ns.peak:
        summary["bf16_gemm_peak_tflops"] = gemm_peak_tflops()
    for spec in ns.arms.split(","):
        arm = make_arm(spec.strip())
        tag = arm.name.replace(":", "_") + (f"_fp8{ns.fp8}" if ns.fp8 else "")
        model = list(MODEL)
        if ns.shape == "small":
            for flag, value in SMALL.items():
                model[model.index(flag) + 1] = value
        if ns.data:  # bytes as tokens, NullTokenizer's EOD 256: same seed and data order in every arm
            i = model.index("--vocab-size")
            model[i + 1] = "257"
            model.remove("--mock-data")
            model += ["--data-path", ns.data, "--split", "100,0,0"]
        args = [*model, "--train-iters", str(ns.iters), "--tensorboard-dir", str(out / "tb" / tag),
                *(FP8[ns.fp8] if ns.fp8 else []), *ns.extra.split()]
        cmd = [*ns.launch.split(), "-m", "megatron_perf_toggles.run", script, *args]
        log_path = out / f"{tag}.log"
        start = time.monotonic()
        with open(log_path, "w") as log:
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env_base, **arm.env()})
        parsed = parse_file(str(log_path))
        record = {"env": arm.env(), "returncode": code, "seconds": time.monotonic() - start,
                  "summary": parsed.summary(skip_first=ns.warmup), "loss_curve": parsed.series("lm_loss"),
                  "grad_norm_curve": parsed.series("grad_norm"), "command": portable(cmd[1:], ns, out),
                  "decisions": [ln.strip() for ln in log_path.read_text(errors="replace").splitlines()
                                if ln.startswith("[perf-toggles]")]}
        if code != 0:
            record["error_tail"] = log_path.read_text(errors="replace").splitlines()[-25:]
        summary["arms"][tag] = record
        s = record["summary"]
        print(f"{tag:<40} rc={code} ms/iter={s.get('ms_per_iter', {}).get('median')} "
              f"tflops={s.get('tflops_per_gpu', {}).get('median')} loss={s.get('lm_loss_last')} "
              f"mem={s.get('memory_mb', {}).get('max_allocated')}", flush=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
