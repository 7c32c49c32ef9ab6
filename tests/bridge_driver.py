"""Build real Megatron-Bridge recipe configs and apply the plugin, many cases in one process.

Usage (by tests/test_bridge.py, under a Python that has Megatron-Bridge):
``python bridge_driver.py < cases.json > results.json``. Transformer Engine is stood in for
(tests/te_standin.py); the Hugging Face config a recipe reads comes from tests/fixtures/hf through
an offline cache. Each case: a recipe, edits to make before ``apply``, the environment, and an
optional planned Megatron release; the result: every decision and every toggle field after
``apply`` and after Bridge's own mixed-precision setup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

FIELDS = ("model.fused_single_qkv_rope", "model.cross_entropy_loss_fusion", "model.cross_entropy_fusion_impl",
          "model.gradient_accumulation_fusion", "model.qk_layernorm", "model.calculate_per_token_loss",
          "ddp.average_in_collective", "ddp.grad_reduce_in_fp32", "mixed_precision.grad_reduce_in_fp32",
          "mixed_precision.first_last_layers_bf16", "mixed_precision.num_layers_at_start_in_bf16",
          "mixed_precision.num_layers_at_end_in_bf16", "model.first_last_layers_bf16",
          "model.num_layers_at_start_in_bf16", "model.num_layers_at_end_in_bf16")
REPO_IDS = {"Qwen3-0.6B": "Qwen/Qwen3-0.6B", "Meta-Llama-3-8B": "meta-llama/Meta-Llama-3-8B"}


def _offline_hf_cache(root: str) -> None:
    """A Hugging Face hub cache holding only the fixture configs, read offline."""
    for name, repo in REPO_IDS.items():
        base = os.path.join(root, "hub", "models--" + repo.replace("/", "--"))
        snap = os.path.join(base, "snapshots", "0" * 40)
        os.makedirs(snap, exist_ok=True)
        os.makedirs(os.path.join(base, "refs"), exist_ok=True)
        with open(os.path.join(base, "refs", "main"), "w") as fh:
            fh.write("0" * 40)
        shutil.copy(os.path.join(HERE, "fixtures", "hf", name, "config.json"), snap)
    os.environ.update(HF_HOME=root, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _get(cfg, path):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def run_case(case: dict) -> dict:
    import importlib

    from megatron_perf_toggles import bridge
    from megatron_perf_toggles.frontends import adapter as frontend
    from megatron_perf_toggles.runtime import provenance

    if case.get("explain"):  # explain in this process, as the command runs it: its JSON record
        from megatron_perf_toggles.tools import cli

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(["explain", *case["explain"]])
        return {"code": code, "explain": json.loads(out.getvalue())}
    module, _, func = case["recipe"].rpartition(".")
    if case.get("build"):  # as explain builds it: the fields the recipe sets are the recipe's
        from megatron_perf_toggles.frontends.bridge import recipe as bridge_recipe

        cfg = bridge_recipe.build(getattr(importlib.import_module(module), func))
    else:
        cfg = getattr(importlib.import_module(module), func)()
    if case.get("model"):  # another model provider in the recipe's place: (class path, keyword arguments)
        path, kwargs = case["model"]
        provider_module, _, provider = path.rpartition(".")
        cfg.model = getattr(importlib.import_module(provider_module), provider)(**kwargs)
    for path, value in case.get("edits", {}).items():
        parent, _, name = path.rpartition(".")
        setattr(_get(cfg, parent) if parent else cfg, name, value)
    before = {f: _get(cfg, f) for f in FIELDS}
    environ = {k: v for k, v in os.environ.items() if k not in {"RANK"}}
    environ.update(case.get("env", {}))
    caps = None
    if case.get("planned_megatron"):
        env = frontend.read_env(environ)
        caps = dataclasses.replace(frontend.capabilities(env),
                                 megatron=frontend.facts_for_version(case["planned_megatron"]))
    record_dir = tempfile.mkdtemp()
    out = io.StringIO()
    if "resume" in case:  # an earlier launch saved into the directory this one resumes from
        _earlier_launch(cfg, case, environ, caps)
    try:
        with contextlib.redirect_stdout(out):
            plan = bridge.apply(cfg, explicit=case.get("explicit", ()), environ=environ, capabilities=caps,
                                record_dir=record_dir)
    except Exception as error:  # noqa: BLE001 - a refusal is a result
        return {"error": f"{type(error).__name__}: {error}", "before": before}
    after = {f: _get(cfg, f) for f in FIELDS}
    extra = _run_time(cfg, case, out)
    # Bridge's own step that copies mixed precision onto the model and DDP configs (runtime_config_update).
    cfg.mixed_precision.finalize()
    cfg.mixed_precision.setup(cfg.model, cfg.optimizer, cfg.ddp)
    after_setup = {f: _get(cfg, f) for f in FIELDS}
    record_path = os.path.join(record_dir, "perf_toggles.json")
    record = json.load(open(record_path)) if os.path.exists(record_path) else None
    return {
        "decisions": provenance.decision_records(plan),  # what the argparse path records
        "messages": [m.text for m in plan.messages],
        "before": before, "after": after, "after_setup": after_setup,
        "table": out.getvalue().splitlines(), "record": record,
        "megatron_version": frontend.capabilities(frontend.read_env({})).megatron.version,
        **extra,
    }


def _earlier_launch(cfg, case: dict, environ: dict, caps) -> None:
    """A launch of the same recipe, with the case's ``resume`` environment, that saved into a
    directory; Megatron's tracker then says iteration 100 was saved there, and this launch loads it."""
    import copy

    from megatron_perf_toggles import bridge

    directory = tempfile.mkdtemp(prefix="ckpt-")
    cfg.checkpoint.save = cfg.checkpoint.load = directory
    earlier = copy.deepcopy(cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        bridge.apply(earlier, environ={**{k: v for k, v in environ.items() if k not in case.get("env", {})},
                                       **case["resume"]}, capabilities=caps, record_dir=tempfile.mkdtemp())
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("100")


def _run_time(cfg, case: dict, out) -> dict:
    """What the run-time protections did: the history beside the checkpoints, this rank's
    fingerprint (and the check at init_process_group), Bridge's own validation under the net."""
    from megatron_perf_toggles.runtime import context

    result: dict = {"fingerprint": (context.current().rank_fingerprint if context.current() else None)}
    if case.get("rank_check"):
        import torch.distributed as dist

        wrapped = getattr(dist.init_process_group, "_perf_toggles_wrapped", False)
        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous", rank=0, world_size=1)
        result["rank_check"] = {"armed": wrapped, "checked": dist.init_process_group.__name__ == "init_process_group"
                                and not getattr(dist.init_process_group, "_perf_toggles_wrapped", False)}
        dist.destroy_process_group()
    if case.get("validate"):
        from megatron.bridge.training.config import runtime_config_update

        for path, value in case.get("late_edits", {}).items():
            parent, _, name = path.rpartition(".")
            setattr(_get(cfg, parent), name, value)
        try:
            with contextlib.redirect_stdout(out):
                runtime_config_update(cfg)
            result["validated"] = True
        except Exception as error:  # noqa: BLE001 - Bridge's refusal is a result
            result["validated"] = f"{type(error).__name__}: {error}"
        result["after_validate"] = {f: _get(cfg, f) for f in FIELDS}
        result["table_after_validate"] = out.getvalue().splitlines()
    save = cfg.checkpoint.save
    history = os.path.join(save, "perf_toggles_history.jsonl") if save else ""
    result["history"] = [json.loads(line) for line in open(history)] if history and os.path.exists(history) else []
    return result


def main() -> int:
    cases = json.load(sys.stdin)
    _offline_hf_cache(tempfile.mkdtemp())  # first: the hub reads its offline setting once, when imported
    import te_standin

    te_standin.install()
    results = []
    with contextlib.redirect_stdout(sys.stderr):  # Bridge's import-time chatter stays off the JSON
        try:
            import megatron.bridge.training.config  # noqa: F401
        except Exception:  # noqa: BLE001
            print(json.dumps({"import_error": traceback.format_exc(limit=3)}), file=sys.__stdout__)
            return 0
        for case in cases:
            try:
                results.append(run_case(case))
            except Exception:  # noqa: BLE001
                results.append({"crash": traceback.format_exc()})
    json.dump({"results": results}, sys.stdout, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
