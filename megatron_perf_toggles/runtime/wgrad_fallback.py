"""A stand-in for APEX's ``fused_weight_gradient_mlp_cuda`` built on one torch GEMM.

Megatron's own linear layers (the GPT output layer among them, even with Transformer Engine)
call ``wgrad_gemm_accum_fp32`` / ``wgrad_gemm_accum_fp16`` when gradient accumulation fusion is
on. The contract is ``main_grad += grad_output^T @ input`` with the sum kept in main_grad's
dtype. On CUDA/ROCm, ``torch.addmm(..., out_dtype=torch.float32, out=main_grad)`` does that in a
single GEMM with fp32 accumulation from bf16/fp16 operands; elsewhere (CPU, for tests) the
operands are upcast first.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .machine.probe import gpu_question_without_torch, installed, torch_module
from .process_changes import PROCESS_CHANGES

MODULE_NAME = "fused_weight_gradient_mlp_cuda"
# Where Megatron looks: module attribute + availability flag, and lazy importers (core.utils).
MEGATRON_SITES = ("megatron.core.tensor_parallel.layers",)


def _as_2d(t: Any) -> Any:
    # Megatron passes [s, b, h] activations (possibly non-contiguous views) or already-2-D ones.
    return t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t


def _accumulate(input: Any, grad_output: Any, main_grad: Any) -> None:
    import torch

    x, dy = _as_2d(input), _as_2d(grad_output)
    if main_grad.dtype == torch.float32 and x.dtype != torch.float32:
        if main_grad.is_cuda:
            torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
            return
        main_grad.addmm_(dy.t().float(), x.float())
        return
    if main_grad.is_cuda:
        # bf16/fp16 buffer: fp32 compute, one rounding into the buffer (APEX's fp16 variant). torch
        # otherwise lets cuBLAS reduce split-K partial sums in bf16/fp16, which APEX does not.
        with _full_precision_reduction(torch):
            main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))
        return
    if x.dtype == main_grad.dtype:
        main_grad.addmm_(dy.t(), x)
        return
    main_grad.add_((dy.t().float() @ x.float()).to(main_grad.dtype))


class _full_precision_reduction:
    """Turn off torch's reduced-precision (bf16/fp16) split-K reductions for one GEMM."""

    def __init__(self, torch: Any) -> None:
        self.matmul = torch.backends.cuda.matmul

    def __enter__(self) -> None:
        self.saved = (self.matmul.allow_bf16_reduced_precision_reduction,
                      self.matmul.allow_fp16_reduced_precision_reduction)
        self.matmul.allow_bf16_reduced_precision_reduction = False
        self.matmul.allow_fp16_reduced_precision_reduction = False

    def __exit__(self, *exc: object) -> None:
        (self.matmul.allow_bf16_reduced_precision_reduction,
         self.matmul.allow_fp16_reduced_precision_reduction) = self.saved


def wgrad_gemm_accum_fp32(input: Any, grad_output: Any, main_grad: Any) -> None:
    """``main_grad (fp32) += grad_output^T @ input``."""
    _accumulate(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: Any, grad_output: Any, main_grad: Any) -> None:
    """``main_grad (bf16/fp16) += grad_output^T @ input``."""
    _accumulate(input, grad_output, main_grad)


def usable() -> tuple[bool, str]:
    """Whether the fast path exists here, judged without touching a GPU (no context created)."""
    if gpu_question_without_torch():  # nothing to judge: no GPU can be visible
        return False, "no CUDA or ROCm device is visible" if installed("torch") else "torch is not installed"
    torch = torch_module()
    if torch is None:
        return False, "torch is not installed"
    if not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return False, f"torch {torch.__version__} has no addmm out_dtype (needs a newer torch)"
    if not torch.cuda.is_available():
        return False, "no CUDA or ROCm device is visible"
    return True, f"torch {torch.__version__} addmm with out_dtype=float32"


def make_module() -> types.ModuleType:
    module = types.ModuleType(MODULE_NAME, "megatron-perf-toggles fallback for APEX's fused wgrad kernels")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32  # type: ignore[attr-defined]
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16  # type: ignore[attr-defined]
    module.__megatron_perf_toggles_fallback__ = True  # type: ignore[attr-defined]
    return module


def is_fallback(module: object) -> bool:
    return bool(getattr(module, "__megatron_perf_toggles_fallback__", False))


def install_for(wgrad_path: str, assumed: bool) -> list[str]:
    """What a real run does with its plan's wgrad path before Megatron builds the model (the
    controller's apply, and the layer check, which sets its process up the same way): the fallback
    goes in where the plan chose it (``fallback``), and where the capability was only assumed
    (MEGATRON_PERF_TOGGLES_ASSUME, a planned machine) only if it can run here. Returns the places
    patched ([] where nothing went in)."""
    if wgrad_path != "fallback" or (assumed and not usable()[0]):
        return []
    return activate()


def activate() -> list[str]:
    """Put the fallback where Megatron looks for APEX's module. Never replaces a real APEX.

    Returns the places patched (for the provenance record).
    """
    existing = sys.modules.get(MODULE_NAME)
    if existing is not None and not is_fallback(existing):
        return []
    if existing is None:
        import importlib.util

        if importlib.util.find_spec(MODULE_NAME) is not None:  # a real APEX, not imported yet
            return []
    module = existing or make_module()
    PROCESS_CHANGES.set_item(sys.modules, MODULE_NAME, module, f"sys.modules[{MODULE_NAME!r}] (wgrad fallback)")
    patched = [f"sys.modules[{MODULE_NAME!r}]"]
    for name in MEGATRON_SITES:
        site = sys.modules.get(name)
        if site is None:
            continue
        PROCESS_CHANGES.set_attr(site, "fused_weight_gradient_mlp_cuda", module)
        PROCESS_CHANGES.set_attr(site, "_grad_accum_fusion_available", True)
        patched.append(f"{name}.fused_weight_gradient_mlp_cuda")
    return patched
