"""Run a Primus experiment file through Primus's own code path, as far as Megatron's validation.

Usage (by tests/test_primus.py): ``python primus_driver.py CASE_JSON`` with the Primus tree and
this repository on ``PYTHONPATH`` and the tree as the working directory. As Primus's runtime does
(``primus/core/runtime/train_runtime.py``): the experiment is loaded by ``load_primus_config``,
Megatron's namespace built by Primus's ``MegatronArgBuilder``, Primus's own patches registered by
importing them, the ``build_args`` phase run with ``run_patches`` (errors logged and swallowed,
as Primus runs it), the module's parameters merged in, the ``before_train`` phase run, then
Megatron's ``validate_args`` (as Primus wrapped it) and ``core_transformer_config_from_args``, as
``initialize_megatron`` and model building call them. The plugin comes in as a user's ``.pth``
line brings it: ``megatron_perf_toggles.primus_hook``. Each job's result is one stdout line,
``RESULT {json}``; a refusal ends the process where Primus's own checks would stop it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run_job(job: dict, megatron_tree: str) -> dict:
    """One job, as Primus's runtime runs it, up to validation (and the TransformerConfig if asked)."""
    import megatron.training.arguments as arguments
    from primus.backends.megatron.argument_builder import MegatronArgBuilder
    from primus.core.config.primus_config import get_module_config, load_primus_config
    from primus.core.patches import run_patches
    from primus.core.runtime.logging import init_worker_logger
    from primus.core.utils.yaml_utils import merge_namespace

    from megatron_perf_toggles.runtime import context

    saved = dict(os.environ)
    os.environ.update(job.get("env", {}))
    try:
        cfg = load_primus_config(Path(job["config"]))
        module = get_module_config(cfg, "pre_trainer")
        init_worker_logger(primus_config=cfg, module_name="pre_trainer", module_config=module)
        for name, value in job.get("overrides", {}).items():  # as a command-line override to Primus
            setattr(module.params, name, value)
        ns = MegatronArgBuilder().update(module.params).finalize()
        dests = job["dests"]
        before = {d: getattr(ns, d, None) for d in dests}
        extra = {"backend_args": ns, "primus_config": cfg, "module_config": module, "runtime_state": None}
        common = dict(backend="megatron", model_name=getattr(module, "model", None), module_name="pre_trainer",
                      extra=extra)
        run_patches(phase="build_args", **common)
        planned = {d: getattr(ns, d, None) for d in dests}
        merge_namespace(ns, module.params, allow_override=False, excepts=[])
        for name, value in job.get("late", {}).items():  # set after the plan: no guard saw it
            setattr(ns, name, value)
        run_patches(phase="before_train", **common)
        arguments.validate_args(ns, {})
        if job.get("transformer_config"):
            arguments.core_transformer_config_from_args(ns)
        ctx = context.current()
        plan = ctx.plan if ctx is not None else None
        checked = None
        if job.get("rank_check"):  # the cross-rank check, at init_process_group as Megatron's initialize calls it
            import tempfile

            import torch.distributed as dist

            armed = getattr(dist.init_process_group, "_perf_toggles_wrapped", False)
            dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
            checked = {"armed": armed, "checked": not getattr(dist.init_process_group, "_perf_toggles_wrapped", False)}
            dist.destroy_process_group()
        records = getattr(ns, "perf_toggles", None)
        records = {k: (v if isinstance(v, dict) else vars(v)) for k, v in
                   (records.items() if isinstance(records, dict) else vars(records).items())} if records else None
        return {"before": before, "planned": planned, "validated": {d: getattr(ns, d, None) for d in dests},
                "records": records, "messages": [m.text for m in plan.messages] if plan is not None else [],
                "fingerprint": ctx.rank_fingerprint if ctx is not None else None, "save": getattr(ns, "save", None),
                "rank_check": checked}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    case = json.loads(sys.argv[1])
    import megatron_perf_toggles.primus_hook  # noqa: F401 - what the .pth line does
    from megatron_perf_toggles.launcher.import_shims import megatron_importable

    with megatron_importable(case["megatron"]):
        import megatron.training.arguments as arguments
        import megatron.training.initialize as initialize
        import primus.backends.megatron.patches  # noqa: F401 - Primus's own patches, registered as its runtime does

        from megatron_perf_toggles.runtime.process_changes import PROCESS_CHANGES

        stock_validate = arguments.validate_args
        result: dict = {}
        for job in case["jobs"]:
            # Each job starts as a fresh process would: Megatron's own validate_args (Primus wraps it
            # again in before_train) and nothing of the plugin's left installed.
            PROCESS_CHANGES.uninstall()
            arguments.validate_args = initialize.validate_args = stock_validate
            if job.get("resume"):  # the previous job saved iteration N where Primus put its checkpoints; load it
                with open(os.path.join(result["save"], "latest_checkpointed_iteration.txt"), "w") as fh:
                    fh.write(str(job["resume"]))
                job = {**job, "overrides": {**job.get("overrides", {}), "load": result["save"]}}
            result = run_job(job, case["megatron"])
            # Primus's logger decorates print(): the result goes to the process's own stdout.
            os.write(1, ("RESULT " + json.dumps(result, default=str) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
