"""Turn the raw H200 run summaries (docs/benchmarks/raw/) into the committed benchmark results.

Writes docs/benchmarks/{summary.json, wgrad.json, e2e_h200.md, e2e_h200.png}. Every number comes
from the raw files, which bench/e2e_llama.py, bench/wgrad_gpu.py and bench/gpu_multi.py wrote on
the GPU machine.

    python bench/report_h200.py
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAW = REPO / "docs" / "benchmarks" / "raw"
OUT = REPO / "docs" / "benchmarks"

RUN = {
    "device": "NVIDIA H200 (1 GPU; 2 GPUs for the DP=2 runs), driver 580.159.04",
    "megatron_commit": "d98e8a64ddf34856e74b24714e3bedb2f5a39553 (NVIDIA/Megatron-LM main, core 0.20.0)",
    "te_version": "2.20.2",
    "torch_version": "2.11.0+cu130",
    "python": "3.12",
    "model": "Llama-3-8B-shaped layers: hidden 4096, ffn 14336, 32 heads, 8 KV groups, 4 layers, seq 4096, "
             "micro-batch 2, global batch 16, vocab 128256, mock data, distributed optimizer, bf16, TE",
    "command": "python bench/e2e_llama.py --megatron /path/to/Megatron-LM --arms ARMS --iters 20 "
               "[--fp8 delayed|tensorwise] --out DIR  (each arm: python -m megatron_perf_toggles.run "
               "pretrain_gpt.py <bench/e2e_llama.py MODEL args>)",
    "medians": "iterations 10-20 (warm-up 9 skipped); spread is min-max over those iterations",
}
# DP=2 run (bench/gpu_multi.py dp2, 2x H200, local layers): its logs did not come back from the
# machine (the packed results were over the transfer limit), so these are the numbers the script
# printed there, copied from its output.
DP2 = {
    "setup": "2x H200, DP=2, local layers (no TE), hidden 4096, ffn 14336, 4 layers, vocab 128256, seq 1024, "
             "micro-batch 1, global batch 2, bf16, distributed optimizer; iterations 11-30; other toggles fixed off",
    "arms": {
        "off": {"ms_per_iter": {"median": 100.4, "min": 96.8, "max": 104.8}, "lm_loss_iter30": 8.826838,
                "max_allocated_mb": 27148.93},
        "on": {"ms_per_iter": {"median": 89.65, "min": 85.3, "max": 95.7}, "lm_loss_iter30": 8.825714,
               "max_allocated_mb": 27148.93},
        "off_overlap": {"ms_per_iter": {"median": 110.5, "min": 107.6, "max": 139.0}, "lm_loss_iter30": 8.825064,
                        "max_allocated_mb": 27149.03},
        "on_overlap": {"ms_per_iter": {"median": 98.45, "min": 93.0, "max": 111.4}, "lm_loss_iter30": 8.825727,
                       "max_allocated_mb": 27149.12},
    },
    "source": "stdout of bench/gpu_multi.py dp2 (logs not retrieved)",
}


def load(name: str) -> dict:
    return json.loads((RAW / name).read_text())


def arms() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for i in range(1, 6):
        out.update(load(f"e2e{i}.json")["arms"])
    return out


def ms(a: dict) -> float:
    return a["summary"]["ms_per_iter"]["median"]


def tf(a: dict) -> float:
    return a["summary"]["tflops_per_gpu"]["median"]


def mem(a: dict) -> float:
    return a["summary"]["memory_mb"]["max_allocated"]


def llama_params(hidden: int, ffn: int, layers: int, vocab: int, heads: int, kv_groups: int) -> int:
    """Parameters of a Llama-style GPT (RMSNorm, SwiGLU, no biases, untied output layer)."""
    head_dim = hidden // heads
    qkv = hidden * (hidden + 2 * kv_groups * head_dim)
    per_layer = qkv + hidden * hidden + hidden * 2 * ffn + ffn * hidden + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


def params() -> int:
    n = llama_params(4096, 14336, 4, 128256, 32, 8)
    assert n == 1923125248  # what Megatron printed in every arm's log ("number of parameters ...")
    return n


DP2_PARAMS = llama_params(4096, 14336, 4, 128256, 32, 32)  # no GQA in the DP=2 runs


def main() -> int:
    a = arms()
    peak = load("e2e1.json").get("bf16_gemm_peak_tflops")
    off, on = a["all-off"], a["default"]
    one = {k.split("_", 1)[1]: a[k] for k in a if k.startswith("only_") and "fp8" not in k}
    loo = {k.split("_", 1)[1]: a[k] for k in a if k.startswith("without_")}
    per_toggle = {d: ms(off) / ms(v) for d, v in one.items()}
    final_loss_rel = abs(on["summary"]["lm_loss_last"] - off["summary"]["lm_loss_last"]) / off["summary"]["lm_loss_last"]
    dp2 = {**DP2, "speedup": DP2["arms"]["off"]["ms_per_iter"]["median"] / DP2["arms"]["on"]["ms_per_iter"]["median"],
           "speedup_overlap": DP2["arms"]["off_overlap"]["ms_per_iter"]["median"]
           / DP2["arms"]["on_overlap"]["ms_per_iter"]["median"],
           "grad_reduction_bytes_per_step": {
               "how": "computed, not measured: gradient buffer = parameters x bytes per element; with the "
                      "distributed optimizer each rank reduce-scatters it and sends half of it (DP=2)",
               "parameters": DP2_PARAMS,
               "fp32_buffer_bytes": DP2_PARAMS * 4, "bf16_buffer_bytes": DP2_PARAMS * 2,
               "sent_per_rank_fp32": DP2_PARAMS * 2, "sent_per_rank_bf16": DP2_PARAMS,
               "checked_against_nccl": False}}
    expected_saving_mb = params() * 2 / 2**20
    measured_saving_mb = mem(off) - mem(one["grad_reduce_in_bf16"])
    fp8 = {r: {"all_off_ms": ms(a[f"all-off_fp8{r}"]), "default_ms": ms(a[f"default_fp8{r}"]),
               "speedup": ms(a[f"all-off_fp8{r}"]) / ms(a[f"default_fp8{r}"]),
               "tflops": [tf(a[f"all-off_fp8{r}"]), tf(a[f"default_fp8{r}"])],
               "log_dir_tag": "fp8" if r == "delayed" else "fp8_tensorwise"} for r in ("delayed", "tensorwise")}
    summary = {
        **RUN,
        "headline_speedup": ms(off) / ms(on),
        "headline": {"all_off": {"ms_per_iter": ms(off), "tflops": tf(off)},
                     "default": {"ms_per_iter": ms(on), "tflops": tf(on)},
                     "tflops_gain": tf(on) / tf(off)},
        "per_toggle": per_toggle,
        "leave_one_out": {d: ms(v) / ms(on) for d, v in loo.items()},
        "mfu": {"bf16_gemm_peak_tflops": peak, "default": tf(on) / peak, "all_off": tf(off) / peak},
        "memory_mb": {k: mem(v) for k, v in a.items()},
        "grad_buffer_bf16_saving_mb": {"expected_from_parameters": expected_saving_mb, "measured": measured_saving_mb},
        "fp8": fp8,
        "convergence_final_loss_rel_diff": None,
        "convergence_note": "not run yet: the 300-iteration real-text runs did not fit the GPU time available "
                            "for these measurements. "
                            "At iteration 20 on mock data the default and all-off losses are "
                            f"{on['summary']['lm_loss_last']:.5f} and {off['summary']['lm_loss_last']:.5f} "
                            f"({final_loss_rel:.2%} apart).",
        "dp2": dp2,
        "mi355x_reference": "the originating ROCm change measured +3.5 % to +7 % on 8x MI355X (bf16, fp8, fp4; "
                            "Llama3-8B, Llama2-7B) and mxfp4 reaching the MLPerf eval-loss target 3.3: their "
                            "figures, not measured here",
    }
    OUT.joinpath("summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    w = load("wgrad_gpu_h200.json")
    wgrad = {
        "gemm_ratio_vs_mm": w["speed"]["gemm_ratio_vs_mm"],
        "min_ratio_vs_mm": w["speed"]["min_ratio_vs_mm"],
        "per_shape": w["speed"]["shapes"],
        "e2e_speedup": ms(off) / ms(one["gradient_accumulation_fusion"]),
        "e2e": {"all_off_ms": ms(off), "fallback_ms": ms(one["gradient_accumulation_fusion"]),
                "loss_iter20": [off["summary"]["lm_loss_last"], one["gradient_accumulation_fusion"]["summary"]["lm_loss_last"]]},
        "max_rel_error_fp32": w["correctness"]["max_rel_error_fp32"],
        "rel_error_noncontiguous": w["correctness"]["rel_error_noncontiguous"],
        "bf16_and_every_element_checks": "the first H200 run used flawed criteria (error relative to a result "
                                         "that can cancel to ~0; a 1e-3 tolerance on fp32 sums); bench/wgrad_gpu.py now "
                                         "checks them soundly but has not been re-run on a GPU",
        "device": "NVIDIA H200",
        "torch_version": w["torch_version"],
        "te_version": RUN["te_version"],
        "megatron_commit": RUN["megatron_commit"],
        "commands": ["python bench/wgrad_gpu.py",
                     "python bench/e2e_llama.py --megatron /path/to/Megatron-LM --arms all-off,"
                     "only:gradient_accumulation_fusion --iters 20 --out DIR"],
    }
    OUT.joinpath("wgrad.json").write_text(json.dumps(wgrad, indent=1) + "\n")

    def row(name: str, v: dict, base: dict) -> str:
        s = v["summary"]
        return (f"| {name} | {ms(v):.1f} | {s['ms_per_iter']['min']:.1f}–{s['ms_per_iter']['max']:.1f} | {tf(v):.1f} "
                f"| {ms(base) / ms(v):.3f} | {s['lm_loss_last']:.5f} | {mem(v):.0f} |")

    head = "| arm | ms/iter | spread | TFLOP/s/GPU | speedup vs baseline | loss @20 | max alloc MB |\n|---|---|---|---|---|---|---|"
    lines = [
        "# Megatron-LM main on one H200: the toggles, measured", "",
        f"Setup: {RUN['model']}. Megatron {RUN['megatron_commit']}, TE {RUN['te_version']}, torch {RUN['torch_version']}.",
        f"Medians of {RUN['medians']}. Command: `{RUN['command']}`.", "",
        "## Headline: the plugin with an empty environment vs all five toggles off", "", head,
        row("all off (baseline)", off, off), row("default (plugin, empty env)", on, off), "",
        f"Speedup {ms(off) / ms(on):.3f}x (TFLOP/s {tf(off):.1f} → {tf(on):.1f}, +{(tf(on) / tf(off) - 1):.1%}); "
        f"target was +7 %. MFU against the bf16 GEMM peak measured on the same GPU in the same run series ({peak:.0f} TFLOP/s, "
        f"8192³): {tf(off) / peak:.1%} → {tf(on) / peak:.1%}.", "",
        "## One at a time (all off, then each toggle alone)", "", head, row("all off (baseline)", off, off),
        *[row(f"only {d}", v, off) for d, v in one.items()], "",
        "## Leave one out (all on, then each toggle off)", "", head, row("default, all on (baseline)", on, on),
        *[row(f"without {d}", v, on) for d, v in loo.items()], "",
        "## FP8", "", head,
        *[row(f"{n} fp8 {r}", a[f"{n}_fp8{r}"], a[f"all-off_fp8{r}"]) for r in ("delayed", "tensorwise")
          for n in ("all-off", "default")], "",
        "Log directories were tagged `fp8` (delayed) and `fp8_tensorwise` (tensorboard dir of each arm).", "",
        "## Memory", "",
        f"bf16 gradient buffer: {params():,} parameters × 2 bytes saved = {expected_saving_mb:.1f} MiB expected; "
        f"measured max-allocated difference all-off vs only grad_reduce_in_bf16: {measured_saving_mb:.1f} MiB.", "",
        "## Two GPUs (DP=2), gradient reduce in bf16 + average in collective", "",
        f"{DP2['setup']}. Numbers from the script's printed output (its logs were not retrieved).", "",
        "| arm | ms/iter | spread | loss @30 | max alloc MB |", "|---|---|---|---|---|",
        *[f"| {k} | {v['ms_per_iter']['median']:.1f} | {v['ms_per_iter']['min']:.1f}–{v['ms_per_iter']['max']:.1f} | "
          f"{v['lm_loss_iter30']:.6f} | {v['max_allocated_mb']:.2f} |" for k, v in DP2["arms"].items()], "",
        f"Speedup {dp2['speedup']:.3f}x without and {dp2['speedup_overlap']:.3f}x with --overlap-grad-reduce. "
        f"Gradient bytes per step (computed from {DP2_PARAMS:,} parameters, not checked against NCCL): fp32 buffer "
        f"{DP2_PARAMS * 4 / 2**30:.2f} GiB vs bf16 {DP2_PARAMS * 2 / 2**30:.2f} GiB; each rank reduce-scatters half. "
        "Peak allocated memory is equal in both arms, as in the reference runs; not explained here.", "",
        "## Not measured here", "",
        "- Convergence over 300 iterations on real text (plugin defaults vs all off) and the adam-eps 1e-8 vs 1e-5 arm. "
        "The tools are ready: `python bench/text_corpus.py --out DIR/stdlib` (Python's standard library as byte "
        "tokens, Megatron's .bin/.idx format, checked with Megatron's own IndexedDataset) and "
        "`python bench/e2e_llama.py --data DIR/stdlib --arms all-off,default --iters 300 ...`.",
        "- MI355X/ROCm: the originating change reports +3.5 % to +7 % on 8x MI355X and mxfp4 reaching the MLPerf "
        "eval-loss target 3.3 (their figures).",
    ]
    OUT.joinpath("e2e_h200.md").write_text("\n".join(lines) + "\n")
    plot(off, on, one, loo)
    print("\n".join(lines))
    return 0


def plot(off: dict, on: dict, one: dict, loo: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    items = [("all off", off), *[(f"only {d}", v) for d, v in one.items()], ("default (all on)", on),
             *[(f"without {d}", v) for d, v in loo.items()]]
    med = [tf(v) for _, v in items]
    lo = [m - v["summary"]["tflops_per_gpu"]["min"] for m, (_, v) in zip(med, items, strict=True)]
    hi = [v["summary"]["tflops_per_gpu"]["max"] - m for m, (_, v) in zip(med, items, strict=True)]
    colors = ["#888" if n in ("all off", "default (all on)") else ("#3a7" if n.startswith("only") else "#c73")
              for n, _ in items]
    ax1.bar(range(len(items)), med, yerr=[lo, hi], capsize=3, color=colors)
    ax1.set_xticks(range(len(items)), [n for n, _ in items], rotation=40, ha="right", fontsize=7)
    ax1.set_ylim(min(med) * 0.95, max(med) * 1.02)
    ax1.set_ylabel("TFLOP/s/GPU (median, min–max)")
    ax1.set_title("H200, Llama-3-8B-shaped 4 layers, bf16")
    for name, v in (("all off", off), ("default", on)):
        curve = v["loss_curve"]
        ax2.plot([i for i, _ in curve], [x for _, x in curve], label=name)
    ax2.set_yscale("log")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("lm loss (mock data)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(OUT / "e2e_h200.png", dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
