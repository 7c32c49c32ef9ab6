"""Every Primus example experiment (MI300X, MI355X) through the plugin's real patch: the checks.

Usage (by tests/test_frontend_corpus.py): ``python primus_corpus.py PRIMUS_TREE MEGATRON_TREE``
with both on the path; prints one JSON object: per experiment file, ``built`` (and the checks that
failed) or why it could not be built. Each file goes the way Primus's runtime takes it: its own
``load_primus_config``, Megatron's namespace from its ``MegatronArgBuilder``, then the
``build_args`` phase through ``run_patches`` twice on twin namespaces: Primus's own patches alone
(the job without the plugin) and with the plugin's patch (registered by importing
``megatron_perf_toggles.primus``). Each is planned for the GPU of its directory (the planned stack
of an MI300X or MI355X, through ``MEGATRON_PERF_TOGGLES_ASSUME``) and the world its parallel sizes
need. Experiments for another backend than Megatron-LM cannot be built by this patch.

Checks, for each experiment that builds:
- the patch applies (a decision record on the namespace, no refusal kept);
- where Megatron's ``validate_args`` passes on the job without the plugin, it passes with it;
- q/k layer norm or packed sequences never get fused single-QKV RoPE;
- per-token loss never gets average-in-collective;
- the ``te`` cross-entropy impl with fusion becomes ``native`` where the core asserts against it;
- mxfp4 with gradient accumulation fusion keeps the bf16 gradient buffer, even with
  ``GRAD_REDUCE_IN_BF16=0`` (a second run of those files).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import sys
from pathlib import Path

DIRECTORIES = {"MI300X": "mi300x", "MI355X": "mi355x"}


def _world(ns) -> int:
    world = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        world *= int(getattr(ns, name, 1) or 1)
    return world


def _validates(ns, world: int) -> str | None:
    import megatron.training.arguments as arguments

    saved = dict(os.environ)
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            arguments.validate_args(ns, {})
        return None
    except BaseException as error:  # noqa: BLE001 - Megatron's answer (SystemExit included)
        return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check(ns, caps, mxfp4_env: bool) -> list[str]:
    failed = []
    packed = bool(getattr(ns, "sft", False) and getattr(ns, "sequence_packing", getattr(ns, "packed", False)))
    if (getattr(ns, "qk_layernorm", False) or packed) and getattr(ns, "fused_single_qkv_rope", False):
        failed.append("fused single-QKV RoPE with q/k layer norm or packed sequences")
    if getattr(ns, "calculate_per_token_loss", False) and getattr(ns, "ddp_average_in_collective", False):
        failed.append("average-in-collective with per-token loss")
    asserts = caps.megatron.asserts_te_cross_entropy or caps.megatron.has_rule("ce_te_impl_stability")
    if asserts and getattr(ns, "cross_entropy_loss_fusion", False) and getattr(ns, "cross_entropy_fusion_impl", "") == "te":
        failed.append("te cross-entropy with fusion on a core that asserts against it")
    mxfp4 = getattr(ns, "fp4", None) and getattr(ns, "fp4_recipe", None) == "mxfp4"
    if mxfp4 and getattr(ns, "gradient_accumulation_fusion", False) and not getattr(ns, "grad_reduce_in_bf16", False):
        failed.append(f"mxfp4 with fusion lost the bf16 gradient buffer{' (GRAD_REDUCE_IN_BF16=0)' * mxfp4_env}")
    return failed


def _logger(loaded, module) -> None:
    """Primus's logger, as its runtime starts it for a job (its patches log through it); it takes
    over print(), which is given back."""
    import builtins

    from primus.core.runtime.logging import init_worker_logger

    printing = builtins.print
    try:
        init_worker_logger(primus_config=loaded, module_name="pre_trainer", module_config=module)
    finally:
        builtins.print = printing


def one(path: Path, gpu: str, env: dict[str, str]) -> dict:
    from primus.backends.megatron.argument_builder import MegatronArgBuilder
    from primus.core.config.primus_config import get_module_config, load_primus_config
    from primus.core.patches import run_patches
    from primus.core.patches.patch_registry import PatchRegistry

    from megatron_perf_toggles import primus as plugin
    from megatron_perf_toggles.frontends import adapter as frontend
    from megatron_perf_toggles.runtime import context
    from megatron_perf_toggles.runtime.machine.capabilities import effective_assume
    from megatron_perf_toggles.runtime.machine.target import make_target
    from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            loaded = load_primus_config(path)
            module = get_module_config(loaded, "pre_trainer")
            framework = getattr(module, "framework", "megatron")
            if framework != "megatron":
                return {"built": False, "why": f"framework {framework}: the patch is for Megatron-LM's backend"}
            twins = [MegatronArgBuilder().update(module.params).finalize() for _ in range(2)]
            _logger(loaded, module)
    except Exception as error:  # noqa: BLE001 - cannot be built here: counted, with why
        return {"built": False, "why": f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"}
    world = _world(twins[0])
    environ = {**env, "WORLD_SIZE": str(world),
               "MEGATRON_PERF_TOGGLES_ASSUME": str(effective_assume(None, make_target(gpu=gpu)))}
    saved = dict(os.environ)
    ids = [p.id for p in PatchRegistry.iter_patches(backend="megatron", phase="build_args")]
    try:
        os.environ.update(environ)
        with PROCESS_CHANGES.scope(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            for ns, enabled in zip(twins, ([i for i in ids if i != plugin.PATCH_ID], ids), strict=True):
                run_patches(backend="megatron", phase="build_args", model_name=getattr(module, "model", None),
                            module_name="pre_trainer", enabled_ids=enabled,
                            extra={"backend_args": ns, "primus_config": loaded, "module_config": module,
                                   "runtime_state": None})
            caps = frontend.capabilities(frontend.read_env(environ))
            ctx = context.current()  # the plugin's patch installed it, a refusal kept on it
            front = ctx.front if ctx is not None else None
            refusal = front.refusal if front is not None and front.config is twins[1] else None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    stock, ours = twins
    if refusal is not None:
        return {"built": True, "failed": [f"refused: {refusal}"]}
    if not getattr(ours, "perf_toggles", None):
        return {"built": True, "failed": ["the patch did not apply (Primus logged why)"]}
    failed = check(ours, caps, "GRAD_REDUCE_IN_BF16" in env)
    without = _validates(copy.deepcopy(stock), world)
    with_plugin = _validates(copy.deepcopy(ours), world) if without is None else None  # only where stock passes
    if without is None and with_plugin is not None:
        failed.append(f"validate_args passes without the plugin, fails with it: {with_plugin}")
    return {"built": True, "failed": failed, "validated": without is None}


def main() -> int:
    primus_tree, megatron_tree = sys.argv[1], sys.argv[2]
    sys.path.insert(0, primus_tree)
    import tempfile

    from megatron_perf_toggles.launcher.import_shims import megatron_importable

    os.chdir(tempfile.mkdtemp(prefix="primus-corpus-"))  # Primus's loader makes ./output directories
    results = {}
    with megatron_importable(megatron_tree), contextlib.redirect_stdout(sys.stderr):
        import megatron.training.arguments  # noqa: F401 - Primus's arg builder reads Megatron's parser
        import primus.backends.megatron.patches  # noqa: F401 - Primus's own patches, registered as its runtime does

        from megatron_perf_toggles import primus as plugin

        plugin.register()
        for folder, gpu in DIRECTORIES.items():
            for path in sorted((Path(primus_tree) / "examples" / "megatron" / "configs" / folder).rglob("*.yaml")):
                name = str(path.relative_to(primus_tree))
                results[name] = one(path, gpu, {})
                text = path.read_text(errors="replace")
                if results[name].get("built") and "mxfp4" in text:
                    again = one(path, gpu, {"GRAD_REDUCE_IN_BF16": "0"})
                    results[name]["failed"] = results[name]["failed"] + again.get("failed", [])
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
