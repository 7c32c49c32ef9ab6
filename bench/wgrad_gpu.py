"""The APEX-free fused wgrad on a GPU: correctness against float64, and GEMM speed.

Correctness: fresh random inputs, compared with a float64 reference:
  - fp32 main_grad over several accumulation steps (relative error must stay < 1e-5);
  - bf16 main_grad within bf16 rounding (elementwise bound, and normwise against the exactly
    rounded result);
  - non-contiguous and 3-D ([s, b, h]) inputs, as Megatron passes them;
  - every element written (each element of main_grad checked, none left at its old value).
Speed: at Llama-3-8B shapes (8192 tokens: micro-batch 2 x seq 4096), the fallback's
``main_grad += dy^T @ x`` against a plain bf16 ``torch.mm`` of the same shape (target >= 95 %).

    python bench/wgrad_gpu.py [--out bench/results/wgrad_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (name, out_features, in_features) of Llama-3-8B's linear layers, TP=1.
LLAMA3_8B_SHAPES = [
    ("qkv", (32 + 2 * 8) * 128, 4096),
    ("proj", 4096, 4096),
    ("fc1", 2 * 14336, 4096),
    ("fc2", 4096, 14336),
    ("output_layer", 128256, 4096),
]
TOKENS = 2 * 4096


BF16_MAX_ROUNDINGS_RATIO = 1.5


def bf16_verdict(metrics: dict) -> bool:
    return metrics["bf16_max_error_over_bound"] <= 1.0 and metrics["bf16_rel_error_ratio"] <= BF16_MAX_ROUNDINGS_RATIO


def correctness(torch, fb, dev: str = "cuda") -> dict:
    gen = torch.Generator(device=dev).manual_seed(1234)
    out: dict = {}

    def rel(a, ref):
        return ((a.double() - ref).norm() / ref.norm()).item()

    # fp32 main_grad, several accumulation steps, 3-D [s, b, h] inputs.
    g = torch.randn(1024, 2048, device=dev, generator=gen)
    ref = g.double().clone()
    worst = 0.0
    for _ in range(8):
        x = torch.randn(512, 4, 2048, device=dev, generator=gen).to(torch.bfloat16)
        dy = torch.randn(512, 4, 1024, device=dev, generator=gen).to(torch.bfloat16)
        ref += dy.double().reshape(-1, 1024).t() @ x.double().reshape(-1, 2048)
        fb.wgrad_gemm_accum_fp32(x, dy, g)
        worst = max(worst, rel(g, ref))
    out["max_rel_error_fp32"] = worst
    out["fp32_ok"] = worst < 1e-5

    # Non-contiguous (transposed views) 2-D inputs.
    x = torch.randn(2048, 4096, device=dev, generator=gen).to(torch.bfloat16).t()
    dy = torch.randn(1024, 4096, device=dev, generator=gen).to(torch.bfloat16).t()
    g = torch.randn(1024, 2048, device=dev, generator=gen)
    ref = g.double() + dy.double().t() @ x.double()
    fb.wgrad_gemm_accum_fp32(x, dy, g)
    out["rel_error_noncontiguous"] = rel(g, ref)
    out["noncontiguous_ok"] = out["rel_error_noncontiguous"] < 1e-5

    # bf16 main_grad ("accumulation in main_grad's dtype"). Two checks, both sound:
    #  - elementwise: error <= rounding of the result to bf16 (|ref| * 2^-8) plus the deterministic
    #    fp32 summation bound (K + 1) * 2^-24 * sum|terms| (Higham's gamma_n; any order, any split);
    #  - normwise (bf16_verdict): at most two bf16 roundings, the product's and the sum's with
    #    main_grad. That is what accumulating in bf16 means, and what cuBLAS does for a bf16 output
    #    with beta=1, the call APEX's bf16 kernel makes too. Two equal, independent roundings give
    #    sqrt(2) x the error of the exactly rounded result; a third (bf16 split-K partial sums)
    #    pushes past the 1.5 limit.
    k = 8192
    x = torch.randn(k, 2048, device=dev, generator=gen).to(torch.bfloat16)
    dy = torch.randn(k, 1024, device=dev, generator=gen).to(torch.bfloat16)
    gb = torch.randn(1024, 2048, device=dev, generator=gen).to(torch.bfloat16)
    ref = gb.double() + dy.double().t() @ x.double()
    scale = gb.double().abs() + dy.double().abs().t() @ x.double().abs()
    fb.wgrad_gemm_accum_fp16(x, dy, gb)
    err = (gb.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + scale * (k + 1) * 2.0 ** -24
    rounded = ref.to(torch.bfloat16).double()
    out["bf16_max_error_over_bound"] = (err / bound).max().item()
    out["bf16_rel_error"] = rel(gb, ref)
    out["bf16_rel_error_exactly_rounded"] = rel(rounded, ref)
    out["bf16_rel_error_ratio"] = out["bf16_rel_error"] / out["bf16_rel_error_exactly_rounded"]
    out["bf16_fraction_exactly_rounded"] = (gb.double() == rounded).double().mean().item()
    out["bf16_ok"] = bf16_verdict(out)

    # Every element written: with all-ones inputs each element must grow by exactly K.
    k = 4096
    ones_x = torch.ones(k, 1536, device=dev, dtype=torch.bfloat16)
    ones_dy = torch.ones(k, 768, device=dev, dtype=torch.bfloat16)
    g = torch.full((768, 1536), 0.5, device=dev)
    fb.wgrad_gemm_accum_fp32(ones_x, ones_dy, g)
    out["elements_checked"] = g.numel()
    out["every_element_written"] = bool((g == k + 0.5).all().item())
    return out


def timed(torch, fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def speed(torch, fb) -> dict:
    rows = []
    total_fb = total_mm = 0.0
    for name, n_out, n_in in LLAMA3_8B_SHAPES:
        x = torch.randn(TOKENS, n_in, device="cuda").to(torch.bfloat16)
        dy = torch.randn(TOKENS, n_out, device="cuda").to(torch.bfloat16)
        g = torch.zeros(n_out, n_in, device="cuda")
        ms_fb = timed(torch, lambda x=x, dy=dy, g=g: fb.wgrad_gemm_accum_fp32(x, dy, g))
        ms_mm = timed(torch, lambda x=x, dy=dy: torch.mm(dy.t(), x))
        flops = 2.0 * TOKENS * n_out * n_in
        rows.append({"layer": name, "out": n_out, "in": n_in, "tokens": TOKENS, "fallback_ms": ms_fb,
                     "mm_bf16_ms": ms_mm, "fallback_tflops": flops / ms_fb / 1e9, "mm_tflops": flops / ms_mm / 1e9,
                     "ratio_vs_mm": ms_mm / ms_fb})
        total_fb += ms_fb
        total_mm += ms_mm
    return {"shapes": rows, "gemm_ratio_vs_mm": total_mm / total_fb,
            "min_ratio_vs_mm": min(r["ratio_vs_mm"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "wgrad_gpu.json"))
    ns = ap.parse_args()
    import torch

    from megatron_perf_toggles.runtime import wgrad_fallback as fb

    ok, why = fb.usable()
    result = {"usable": ok, "why": why, "torch_version": torch.__version__,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "python": platform.python_version()}
    if ok:
        result["correctness"] = correctness(torch, fb)
        result["speed"] = speed(torch, fb)
    print(json.dumps(result, indent=1))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
