"""Numerics check of the fusions that should be exact math, on one GPU.

A loss curve hides a fused kernel that drops a term or accumulates in the wrong precision: the
curve still falls. This check does not train. It builds one small Megatron GPT model (dense or
mixture-of-experts) from one state, feeds it one batch, and takes the loss and every parameter's
gradient three ways:

  reference   every fusion off, parameters and arithmetic in float32 (the higher-precision truth)
  unfused     every fusion off, bf16 (what stock computes)
  fused:X     only fusion X on, bf16 (what the toggle computes)

Each bf16 path's error is measured against the reference: the loss's relative error, and the
gradients' relative L2 error over all parameters together (and the worst single parameter). A
fusion passes when its error is at most ``--multiple`` (default 2) times the unfused path's, plus
a floor of 1e-6 for errors that are already at float32 round-off. Every bf16 path runs twice, so
a fused path that is nondeterministic by design (atomics in a backward pass) shows its own
run-to-run spread beside its error.

The weights are copied from one float32 state into every variant, so grouped GEMM (whose experts
draw their initial weights in another order than the sequential experts) starts from the same
weights as the rest. Gradient accumulation fusion writes into fp32 ``main_grad`` buffers, as
Megatron's data-parallel wrapper provides them; the output layer's fused wgrad uses this
package's APEX-free fallback where APEX is absent.

    python bench/numerics_check.py --out DIR [--model dense|moe|both]
    python bench/numerics_check.py --report docs/benchmarks/raw/numerics/numerics.json   # judge saved errors again

Needs a CUDA GPU, Megatron-LM on PYTHONPATH and Transformer Engine. Writes DIR/numerics.json and
prints one line per fusion.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# fusion name -> the TransformerConfig fields it sets (its registry toggle in the comment)
FUSIONS: dict[str, dict[str, Any]] = {
    "cross_entropy_loss_fusion": {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"},
    "rope_fusion": {"apply_rope_fusion": True},  # stock's default; the base of the next one
    "fused_single_qkv_rope": {"apply_rope_fusion": True, "fused_single_qkv_rope": True},
    "gradient_accumulation_fusion": {"gradient_accumulation_fusion": True},
    "moe_grouped_gemm": {"moe_grouped_gemm": True},
    "moe_permute_fusion": {"moe_permute_fusion": True},
    "moe_router_fusion": {"moe_router_fusion": True},
}
MOE_ONLY = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion")
FLOOR = 1e-6
# What each fusion is judged against: the path stock Megatron takes without the toggle. Stock fuses
# RoPE by default (apply_rope_fusion), so the single-QKV variant is held to the fused-RoPE path's
# error; everything else to the path with every fusion off.
BASE_PATH = {"fused_single_qkv_rope": "rope_fusion"}
# Fusions that are stock's own defaults rather than this package's toggles: measured, not judged.
STOCK_DEFAULTS = ("rope_fusion",)


def verdict(fused_err: float, unfused_err: float, multiple: float) -> bool:
    """A fused path passes when its error is within ``multiple`` times the unfused path's (plus a floor)."""
    return fused_err <= multiple * unfused_err + FLOOR


def rel_l2(grads: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float, str]:
    """Relative L2 error of all gradients together, and the worst parameter's (with its name)."""
    num = den = 0.0
    worst, worst_name = 0.0, ""
    for name, r in ref.items():
        g = grads[name]
        d = float((g.double() - r.double()).norm() ** 2)
        n = float(r.double().norm() ** 2)
        num, den = num + d, den + n
        rel = math.sqrt(d / n) if n > 0 else math.sqrt(d)
        if rel > worst:
            worst, worst_name = rel, name
    return math.sqrt(num / den) if den > 0 else math.sqrt(num), worst, worst_name


def canonical(name: str) -> str:
    """A parameter's name in the sequential-experts layout (grouped experts' weightN -> local_experts.N)."""
    m = re.match(r"(.*\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$", name)
    return f"{m[1]}.local_experts.{m[4]}.{m[2]}.{m[3]}" if m else name


def init_distributed() -> None:
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def build(model: str, fields: dict[str, Any], fp32: bool) -> Any:
    """One small GPT model with the given config fields (bf16 unless ``fp32``)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = model == "moe"
    cfg: dict[str, Any] = dict(
        num_layers=2, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_query_groups=4,
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, bf16=not fp32,
        params_dtype=torch.float32 if fp32 else torch.bfloat16, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, init_method_std=0.02,
    )
    if moe:
        cfg.update(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512, moe_token_dispatcher_type="alltoall",
                   moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False)
    cfg.update(fields)
    config = TransformerConfig(**cfg)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=8 if moe else None,
                                                      moe_grouped_gemm=bool(cfg.get("moe_grouped_gemm")))
    net = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=32000, max_sequence_length=1024,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False)
    return net.cuda()


def run_once(model: str, fields: dict[str, Any], state: dict[str, Any], batch: tuple, fp32: bool) -> dict[str, Any]:
    """Load ``state``, one forward and backward on ``batch``; the loss and each parameter's fp32 gradient."""
    import torch

    net = build(model, fields, fp32)
    params = dict(net.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[canonical(name)].to(p.dtype))
    fused_wgrad = bool(fields.get("gradient_accumulation_fusion"))
    for p in params.values():
        p.grad = None
        if fused_wgrad:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            p.grad_added_to_main_grad = False  # a fused wgrad sets it True and leaves .grad a dummy
            p.zero_out_wgrad = True
    tokens, labels, position_ids = batch
    per_token = net(tokens, position_ids, None, labels=labels)
    loss = per_token.float().mean()
    loss.backward()
    torch.cuda.synchronize()
    grads = {}
    for name, p in params.items():
        if fused_wgrad and p.grad_added_to_main_grad:
            g = p.main_grad.clone()
        else:
            g = p.grad.float() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if fused_wgrad:
                g = g + p.main_grad
        grads[canonical(name)] = g.detach().clone()
    out = {"loss": float(loss), "grads": grads}
    del net
    torch.cuda.empty_cache()
    return out


def check_model(model: str, multiple: float, tokens_per_batch: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(7)
    ref_net = build(model, {}, fp32=True)  # the one state every variant starts from
    state = {canonical(n): p.detach().float().clone() for n, p in ref_net.named_parameters()}
    del ref_net
    seq, micro = 1024, max(1, tokens_per_batch // 1024)
    gen = torch.Generator(device="cuda").manual_seed(11)
    tokens = torch.randint(0, 32000, (micro, seq), device="cuda", generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(micro, -1)
    batch = (tokens, labels, position_ids)
    ref = run_once(model, {}, state, batch, fp32=True)
    unfused = [run_once(model, {}, state, batch, fp32=False) for _ in range(2)]

    def errors(res: dict[str, Any]) -> dict[str, Any]:
        g, worst, worst_name = rel_l2(res["grads"], ref["grads"])
        return {"loss": res["loss"], "loss_rel_err": abs(res["loss"] - ref["loss"]) / abs(ref["loss"]),
                "grad_rel_l2": g, "worst_param_rel": worst, "worst_param": worst_name}

    base = [errors(u) for u in unfused]
    out: dict[str, Any] = {"model": model, "reference_loss": ref["loss"], "unfused": base,
                           "unfused_repeat_grad_rel_l2": rel_l2(unfused[1]["grads"], unfused[0]["grads"])[0],
                           "fusions": {}}
    for name, fields in FUSIONS.items():
        if model == "dense" and name in MOE_ONLY:
            continue
        try:
            runs = [run_once(model, fields, state, batch, fp32=False) for _ in range(2)]
        except Exception as error:  # noqa: BLE001 - a fusion that cannot run here is reported, not fatal
            out["fusions"][name] = {"error": f"{type(error).__name__}: {error}",
                                    "trace": traceback.format_exc()[-2000:]}
            print(f"{model:5s} {name:28s} could not run: {type(error).__name__}: {error}", flush=True)
            continue
        repeat = rel_l2(runs[1]["grads"], runs[0]["grads"])[0]
        out["fusions"][name] = {"runs": [errors(r) for r in runs], "repeat_grad_rel_l2": repeat,
                                "deterministic": runs[0]["loss"] == runs[1]["loss"] and repeat == 0}
    judge(out, multiple)
    return out


def judge(model: dict[str, Any], multiple: float) -> list[str]:
    """Each fusion's verdict from the errors a check saved (so a saved result can be judged again):
    its loss and gradient errors against its base path's (BASE_PATH; else the unfused path's, the
    worse of its two runs). Returns one line per fusion."""
    lines = []
    for name, entry in model["fusions"].items():
        if "error" in entry:
            lines.append(f"{model['model']:5s} {name:28s} could not run: {entry['error']}")
            continue
        base_name = BASE_PATH.get(name)
        base_runs = model["fusions"].get(base_name, {}).get("runs") if base_name else None
        base = base_runs or model["unfused"]
        got = entry["runs"][0]
        loss_ok = verdict(got["loss_rel_err"], max(b["loss_rel_err"] for b in base), multiple)
        grad_ok = verdict(got["grad_rel_l2"], max(b["grad_rel_l2"] for b in base), multiple)
        entry.update(base=base_name if base_runs else "unfused", multiple=multiple,
                     passed=None if name in STOCK_DEFAULTS else loss_ok and grad_ok)
        word = ("measured (stock's own default)" if entry["passed"] is None else "pass" if entry["passed"] else "FAIL")
        lines.append(f"{model['model']:5s} {name:28s} loss err {got['loss_rel_err']:.2e} ({entry['base']} "
                     f"{max(b['loss_rel_err'] for b in base):.2e})  grad err {got['grad_rel_l2']:.2e} ({entry['base']} "
                     f"{max(b['grad_rel_l2'] for b in base):.2e})  repeat {entry['repeat_grad_rel_l2']:.1e} -> {word}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for numerics.json (required unless --report)")
    p.add_argument("--report", metavar="JSON", help="judge a saved numerics.json again (no GPU) and print it")
    p.add_argument("--write", action="store_true", help="with --report: save the verdicts back into the file")
    p.add_argument("--model", choices=("dense", "moe", "both"), default="both")
    p.add_argument("--multiple", type=float, default=2.0, help="a fused error may be this many times the unfused one")
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the one batch (sequences of 1024)")
    ns = p.parse_args(argv)
    if ns.multiple < 1:
        p.error("--multiple must be at least 1")
    if ns.report:
        return report(Path(ns.report), ns.multiple, ns.write)
    if not ns.out:
        p.error("--out is required (or --report JSON)")
    try:
        import torch
        if not torch.cuda.is_available():
            print("numerics_check: needs a CUDA GPU", file=sys.stderr)
            return 2
        from megatron_perf_toggles.runtime import wgrad_fallback
        wgrad_fallback.activate()  # the output layer's fused wgrad without APEX
        init_distributed()
    except ImportError as error:
        print(f"numerics_check: {error} (needs torch with CUDA, Megatron-LM on PYTHONPATH, Transformer Engine)",
              file=sys.stderr)
        return 2
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "models": []}
    try:
        import transformer_engine
        results["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        results["transformer_engine"] = None
    for model in (("dense", "moe") if ns.model == "both" else (ns.model,)):
        results["models"].append({**check_model(model, ns.multiple, ns.tokens), "multiple": ns.multiple})
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    for m in results["models"]:  # gradients are not kept, only the errors
        m.pop("grads", None)
    (out / "numerics.json").write_text(json.dumps(results, indent=1, default=str))
    return summarize(results)


def report(path: Path, multiple: float, write: bool = False) -> int:
    """--report: the verdicts of a saved check, judged with ``multiple`` (``write``: saved back)."""
    try:
        results = json.loads(path.read_text())
        for m in results["models"]:
            m["multiple"] = multiple
        code = summarize(results)
        if write:
            path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        return code
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"numerics_check: cannot read {path}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


def summarize(results: dict[str, Any]) -> int:
    """Print one line per fusion and the overall line."""
    for m in results["models"]:
        print("\n".join(judge(m, m.get("multiple", 2.0))))
    failed = [f"{m['model']}:{n}" for m in results["models"] for n, e in m["fusions"].items()
              if e.get("passed") is False or "error" in e]
    print(f"numerics: {'every toggle passed' if not failed else 'not passed: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
