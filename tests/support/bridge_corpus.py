"""Every Megatron-Bridge recipe that builds on this CPU machine, through bridge.apply: the checks.

Usage (by tests/test_frontend_corpus.py, under the Bridge interpreter): ``python bridge_corpus.py``;
prints one JSON object: per recipe, ``built`` (and the checks that failed, if any) or why it
could not be built here. Every ``*_config`` function of ``megatron.bridge.recipes`` is one
recipe (pretrain, finetune, SFT, PEFT; all model families). Transformer Engine is stood in for
(tests/te_standin.py); Hugging Face configs come from tests/fixtures/hf offline, so a recipe
whose model config is not there cannot be built (Bridge's loader retries with sleeps: they are
skipped here, nothing else of it changes).

Each recipe is planned for the machine it is written for (an H100's planned stack, through
``MEGATRON_PERF_TOGGLES_ASSUME``) and the world its parallel sizes need. Checks, for each
recipe that builds:
- ``apply`` never raises;
- where Bridge's own validation (``runtime_config_update``) passes without the plugin, it
  passes with it;
- q/k layer norm or packed sequences never get fused single-QKV RoPE;
- per-token loss never gets average-in-collective;
- the ``te`` cross-entropy impl with fusion becomes ``native`` where the installed core asserts
  against it;
- both gradient-reduce fields (mixed precision and DDP) agree.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import tempfile
import time
import traceback
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the Bridge driver
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository


def recipes() -> list[tuple[str, object]]:
    import megatron.bridge.recipes as package

    out = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that does not import here has no recipe to build
            continue
        for name, fn in vars(module).items():
            if (name.endswith("_config") and inspect.isfunction(fn) and fn.__module__ == module.__name__
                    and not name.startswith("_")
                    and all(p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                            for p in inspect.signature(fn).parameters.values())):
                out[f"{module.__name__}:{name}"] = fn
    return sorted(out.items())


def _world(cfg) -> int:
    m = cfg.model
    sizes = [getattr(m, a, 1) or 1 for a in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "context_parallel_size", "expert_model_parallel_size")]
    world = 1
    for s in sizes:
        world *= int(s)
    return world


def _validates(cfg, world: int) -> str | None:
    from megatron.bridge.training.config import runtime_config_update

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runtime_config_update(cfg)
        return None
    except Exception as error:  # noqa: BLE001 - Bridge's answer
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def _packed(cfg) -> bool:
    d = cfg.dataset
    size = getattr(getattr(d, "packed_sequence_specs", None), "packed_sequence_size", -1) or -1
    return bool(getattr(d, "enable_offline_packing", False) or getattr(d, "enable_in_batch_packing", False)
                or size > 0)


def check(cfg, caps) -> list[str]:
    """The corpus's checks on a configuration after apply."""
    m, failed = cfg.model, []
    if (getattr(m, "qk_layernorm", False) or _packed(cfg)) and getattr(m, "fused_single_qkv_rope", False):
        failed.append("fused single-QKV RoPE with q/k layer norm or packed sequences")
    if getattr(m, "calculate_per_token_loss", False) and getattr(cfg.ddp, "average_in_collective", False):
        failed.append("average-in-collective with per-token loss")
    asserts = caps.megatron.asserts_te_cross_entropy or caps.megatron.has_rule("ce_te_impl_stability")
    if asserts and getattr(m, "cross_entropy_loss_fusion", False) and getattr(m, "cross_entropy_fusion_impl", "") == "te":
        failed.append("te cross-entropy with fusion on a core that asserts against it")
    mp = cfg.mixed_precision
    if not isinstance(mp, str) and mp is not None and mp.grad_reduce_in_fp32 != cfg.ddp.grad_reduce_in_fp32:
        failed.append("mixed_precision.grad_reduce_in_fp32 != ddp.grad_reduce_in_fp32")
    return failed


def _h100_stack() -> str:
    """The machine the recipes are written for, as MEGATRON_PERF_TOGGLES_ASSUME names it: an H100's
    planned stack (this CPU machine has no fused-wgrad path at all)."""
    from megatron_perf_toggles.runtime.machine.capabilities import effective_assume
    from megatron_perf_toggles.runtime.machine.target import make_target

    return str(effective_assume(None, make_target(gpu="h100")))


H100_STACK = _h100_stack()


def one(spec: str, fn) -> dict:
    from megatron_perf_toggles import bridge
    from megatron_perf_toggles.frontends import adapter as frontend
    from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cfg = bridge.build(fn)
    except Exception as error:  # noqa: BLE001 - cannot be built here: counted, with why
        return {"built": False, "why": f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"}
    if not all(hasattr(cfg, section) for section in ("model", "ddp", "mixed_precision", "checkpoint")):
        return {"recipe": False}  # a helper that returns a part of a configuration, not a recipe
    world = _world(cfg)
    stock = _validates(copy.deepcopy(cfg), world)
    environ = {k: v for k, v in os.environ.items() if k != "RANK"}
    environ.update(WORLD_SIZE=str(world), MEGATRON_PERF_TOGGLES_ASSUME=H100_STACK)
    try:
        with PROCESS_CHANGES.scope(), contextlib.redirect_stdout(io.StringIO()):
            bridge.apply(cfg, environ=environ, record_dir=tempfile.mkdtemp())
            caps = frontend.capabilities(frontend.read_env(environ))
            failed = check(cfg, caps)
            ours = _validates(cfg, world)
    except Exception:  # noqa: BLE001 - apply must never raise on a recipe
        return {"built": True, "failed": ["apply raised: " + traceback.format_exc(limit=-3)]}
    if stock is None and ours is not None:
        failed.append(f"Bridge's validation passes without the plugin, fails with it: {ours}")
    return {"built": True, "failed": failed, "validated": stock is None}


def main() -> int:
    import bridge_driver

    bridge_driver._offline_hf_cache(tempfile.mkdtemp())  # first: the hub reads its offline setting once
    import te_standin

    te_standin.install()
    os.chdir(tempfile.mkdtemp(prefix="bridge-corpus-"))  # recipes' relative output directories land here
    with contextlib.redirect_stdout(sys.stderr):
        from megatron.bridge.models.hf_pretrained import safe_config_loader

        # No waits between offline retries: the loader's own view of time, not the process's.
        safe_config_loader.time = types.SimpleNamespace(sleep=lambda seconds: None, time=time.time)
        results = {spec: one(spec, fn) for spec, fn in recipes()}
    results = {spec: r for spec, r in results.items() if r.get("recipe", True)}
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
