"""Parse + validate + TransformerConfig cases (kind ``parse``) and the wgrad fallback's sites (kind
``wgrad_sites``), run on a tree's worker (tree_driver.py) for tests/test_megatron_real.py.

Each case has its own environment and argv on top of ``COMMON``; ``run_case`` is what the worker calls.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import traceback

import tree_driver

COMMON = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "1e-4", "--train-iters", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--mock-data", "--position-embedding-type", "rope", "--no-rope-fusion", "--eval-interval", "1",
    "--eval-iters", "0",
]


def _clean_environ(extra: dict[str, str]) -> None:
    from sandbox import sandbox_os_environ

    sandbox_os_environ(extra=extra, drop=("WORLD_SIZE",))
    os.environ.setdefault("MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT", "json")  # the record on stdout, for the checks


def run_case(case: dict) -> dict:
    """One case in the worker, Megatron imported from the tree on its path."""
    from megatron_perf_toggles.launcher.import_shims import megatron_importable

    if case["kind"] == "wgrad_sites":
        with megatron_importable():
            return wgrad_sites()
    with megatron_importable():
        from megatron.training import arguments
    if case.get("stock"):
        tree_driver.assert_megatron_unwrapped(arguments)
    saved_environ, saved_argv = dict(os.environ), list(sys.argv)
    try:
        return _run_case(case, {"module": arguments, "parse_args": arguments.parse_args})
    finally:
        os.environ.clear()
        os.environ.update(saved_environ)
        sys.argv = saved_argv
        tree_driver.plan_te_version(None)


def _run_case(case: dict, api: dict) -> dict:
    from megatron_perf_toggles import extra_args_provider
    from megatron_perf_toggles.core.registry import TOGGLES

    _clean_environ(case.get("env", {}))
    tree_driver.plan_te_version(case.get("te_version"))
    for path, text in case.get("files", {}).items():  # e.g. a checkpoint directory to resume from
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    sys.argv = ["pretrain_gpt.py", *COMMON, *case.get("argv", [])]
    out, err = io.StringIO(), io.StringIO()
    result: dict = {"id": case["id"]}
    module = api["module"]
    saved = {name: getattr(module, name) for name in ("get_device_arch_version",) if hasattr(module, name)}
    if case.get("device_arch") is not None and "get_device_arch_version" in saved:
        module.get_device_arch_version = lambda: case["device_arch"]  # a GPU machine's answer, no GPU touched
    import torch

    real_capability = torch.cuda.get_device_capability
    if case.get("device_capability"):  # validate_args asks it for grouped GEMM: a GPU's answer, no GPU touched
        torch.cuda.get_device_capability = lambda device=None: tuple(case["device_capability"])
    te_swap = None
    if case.get("te_version"):
        # Answer Megatron's TE version checks as a machine with that TE would, wherever imported.
        from megatron.core import utils as core_utils
        from packaging.version import Version

        from megatron_perf_toggles.runtime.rebinding import rebind

        real = core_utils.is_te_min_version
        fake = lambda want, *a, **k: Version(case["te_version"]) >= Version(str(want))  # noqa: E731
        rebind(real, fake, None)
        te_swap = (real, fake)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            provider = None if case.get("stock") else extra_args_provider
            args = api["parse_args"](extra_args_provider=provider)
            result["parsed"] = True
            if case.get("validate", True):
                module.validate_args(args, {})  # looked up now, as Megatron's own callers do
                result["validated"] = True
            result["values"] = {t.dest: getattr(args, t.dest, None) for t in TOGGLES}
            for dest in ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
                         "tensorboard_dir", "wandb_save_dir", "save", "load", "accumulate_allreduce_grads_in_fp32"):
                result["values"][dest] = getattr(args, dest, None)
            result["perf_toggles"] = getattr(args, "perf_toggles", None)
            result["precision"] = getattr(args, "perf_toggles_precision", None)
            if case.get("validate", True) and case.get("config", True):
                cfg = module.core_transformer_config_from_args(args)
                result["config_fused_single_qkv_rope"] = getattr(cfg, "fused_single_qkv_rope", None)
                result["config_has_field"] = hasattr(cfg, "fused_single_qkv_rope")
                result["config_cross_entropy_fusion_impl"] = getattr(cfg, "cross_entropy_fusion_impl", None)
                result["config_fp4_layers"] = [cfg.first_last_layers_bf16, cfg.num_layers_at_start_in_bf16,
                                               cfg.num_layers_at_end_in_bf16]
                result["config_moe"] = {d: getattr(cfg, d, None) for d in ("moe_grouped_gemm", "moe_permute_fusion",
                                                                          "moe_router_fusion")}
    except SystemExit as exc:
        result["exit"] = exc.code
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback_tail"] = traceback.format_exc().splitlines()[-3:]
    finally:
        torch.cuda.get_device_capability = real_capability
        for name, fn in saved.items():
            setattr(module, name, fn)
        if te_swap is not None:
            from megatron_perf_toggles.runtime.rebinding import rebind

            rebind(te_swap[1], te_swap[0], None)
    result["stdout"] = "\n".join(ln for ln in out.getvalue().splitlines() if ln.startswith("[perf-toggles]"))
    result["stderr"] = err.getvalue()[-4000:]
    return result


def wgrad_sites() -> dict:
    """Where this Megatron looks for APEX's fused wgrad module, before and after our fallback."""
    import inspect

    from megatron.core import utils as core_utils
    from megatron.core.tensor_parallel import layers

    from megatron_perf_toggles.runtime import wgrad_fallback

    src = inspect.getsource(layers)
    before = {
        "has_flag": hasattr(layers, "_grad_accum_fusion_available"),
        "flag": getattr(layers, "_grad_accum_fusion_available", None),
        "calls_fp32": "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(" in src,
        "calls_fp16": "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(" in src,
        "utils_imports_lazily": "import fused_weight_gradient_mlp_cuda" in inspect.getsource(core_utils),
    }
    patched = wgrad_fallback.activate()
    after = {
        "patched": patched,
        "flag": layers._grad_accum_fusion_available,
        "module_is_fallback": wgrad_fallback.is_fallback(getattr(layers, "fused_weight_gradient_mlp_cuda", None)),
    }
    import fused_weight_gradient_mlp_cuda  # what core.utils' lazy import will get

    after["lazy_import_is_fallback"] = wgrad_fallback.is_fallback(fused_weight_gradient_mlp_cuda)
    return {"before": before, "after": after}
