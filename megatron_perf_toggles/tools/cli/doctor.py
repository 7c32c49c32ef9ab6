"""``doctor``: what this machine has (Megatron, torch, GPU, Transformer Engine, APEX, aiter) and
which toggles can be on here, and why not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import Any

from ..._version import __version__
from ...core.decision.decide import Plan
from ...core.env import EnvSettings
from ...core.facts import Capabilities, MegatronFacts
from ...core.profile import Profile
from ...core.registry import format_value
from ...errors import PerfTogglesError
from ...runtime.controller import Registration, new_context
from ...runtime.machine.capabilities import TE_BROKEN, detect, megatron_facts, resolve
from ...runtime.machine.probe import installed, torch_module
from ..llama3_8b import llama3_8b_args
from .output import WGRAD_WORDS, _profile_summary, _say, _table, _width


def _doctor_megatron(tree: str | None) -> tuple[MegatronFacts | None, str | None]:
    """The facts of the Megatron in use (importing it, no parser built), or why there is none.

    A checkout named with --megatron that is missing or does not import is an error (exit 2);
    with none named, "not importable" is part of the report."""
    import importlib.util

    from ...launcher.import_shims import import_failure, megatron_importable
    from ...runtime.process_changes import PROCESS_CHANGES

    if tree is not None and not os.path.isfile(os.path.join(tree, "megatron", "training", "arguments.py")):
        raise PerfTogglesError(f"--megatron {tree}: not a Megatron-LM checkout (no megatron/training/arguments.py)",
                               "pass the directory that holds pretrain_gpt.py")
    if tree is None and importlib.util.find_spec("megatron") is None:
        return None, "not importable (put the Megatron-LM checkout on PYTHONPATH, or pass --megatron PATH)"
    try:
        with PROCESS_CHANGES.scope(), megatron_importable(tree):  # a report changes nothing
            import megatron.training.arguments  # noqa: F401 - what megatron_facts() inspects
    except Exception as error:  # noqa: BLE001 - any import failure is one line
        what, hint = import_failure(error)
        if tree is not None:
            raise PerfTogglesError(f"cannot import Megatron-LM from {tree}: {what}", hint) from None
        return None, f"cannot import Megatron-LM from PYTHONPATH: {what}"
    return megatron_facts(), None


def _machine_diagnosed() -> Capabilities:
    """This machine's capabilities for ``doctor``: torch imported, as a run imports it (a plan may
    read its build file instead), and a torch that is installed but does not import named."""
    broken = installed("torch") and torch_module() is None
    caps = detect(deep=True)
    if broken:
        caps = replace(caps, notes={**caps.notes, "torch": "torch is installed but does not import "
                                                            "(python -c 'import torch' shows why)"})
    return caps


def _te_report(caps: Capabilities) -> dict[str, Any]:
    """Transformer Engine and its kernels the toggles use, for doctor's JSON."""
    return {"version": caps.te_version, "fused_qkv_rope_kernel": caps.te_fused_qkv_rope,
            "cross_entropy_kernel": caps.te_cross_entropy, "grouped_linear": caps.te_grouped_linear,
            "moe_permutation_kernels": caps.te_fused_permute, "moe_router_kernels": caps.te_fused_router}


def _doctor_plan(caps: Capabilities) -> tuple[Plan, EnvSettings, Profile | None, Capabilities]:
    """What the toggles decide on this machine (or the one MEGATRON_PERF_TOGGLES_ASSUME plans),
    for a Llama-style bf16 run: doctor's process object comes from the factory like every entry
    point's, reads the environment and profile once, and plans through its controller."""
    ctx = new_context("doctor", os.environ, mode="plan", announce=False)
    controller = ctx.controller
    assert controller is not None, "new_context makes the controller"
    env, profile = controller.env, controller.profile
    assumed = resolve(env.assume) if env.assume else None
    effective = replace(assumed, megatron=caps.megatron) if assumed else caps
    controller.capabilities, controller.observing = effective, "doctor"
    view = argparse.Namespace(**_llama_view())
    return controller.plan(view, Registration(controller, {}, ())), env, profile, effective


def cmd_doctor(ns: argparse.Namespace) -> int:
    facts, why_not = _doctor_megatron(ns.megatron)  # a bad --megatron fails before torch is imported
    caps = _machine_diagnosed()
    if facts is not None:
        caps = replace(caps, megatron=facts)
    plan, env, profile, effective = _doctor_plan(caps)
    report = {
        "megatron": asdict(facts) if facts is not None else {"error": why_not},
        "torch": {"version": caps.torch_version, "device": caps.device},
        "gpu_arch": caps.gpu_arch,
        "transformer_engine": _te_report(caps),
        "apex_fused_wgrad": caps.apex_fused_wgrad,
        "aiter": caps.aiter_version,
        "notes": caps.notes,
        "toggles_here": {dest: d.to_record() for dest, d in plan.decisions.items()},
        "assumed": list(effective.assumed),
        "wgrad_path": plan.wgrad_path,
        "profile": plan.profile,
    }
    if ns.json:
        print(json.dumps(report, indent=1, sort_keys=True, default=str))
        return 0
    yes = {True: "yes", False: "no", None: "unknown"}
    width = _width()
    _say(f"megatron-perf-toggles {__version__}, Python {sys.version.split()[0]}", width)
    if facts is not None:
        _say(f"Megatron-LM:        {facts.version} at {facts.path}", width)
        _say(f"  fused_single_qkv_rope field: {yes[facts.fused_single_qkv_rope_field]}; "
             f"asserts te cross entropy: {yes[facts.asserts_te_cross_entropy]}", width)
    else:
        _say(f"Megatron-LM:        {why_not}", width)
    backend = {"rocm": "ROCm/HIP", "cuda": "CUDA", "cpu": "CPU only"}.get(caps.device or "", "")
    _say(f"torch:              {caps.torch_version or 'not installed'} {backend}".rstrip(), width)
    _say(f"GPU architecture:   {caps.gpu_arch or 'none visible'}", width)
    te_missing = "does not import (see the note below)" if TE_BROKEN in caps.notes.get("te", "") else "not installed"
    _say(f"Transformer Engine: {caps.te_version or te_missing}"
         + (f" (fused QKV RoPE kernel: {yes[caps.te_fused_qkv_rope]}, cross-entropy kernel: "
            f"{yes[caps.te_cross_entropy]}; MoE: grouped linear {yes[caps.te_grouped_linear]}, permutation "
            f"{yes[caps.te_fused_permute]}, router {yes[caps.te_fused_router]} (used from TE 2.7))"
            if caps.te_version else ""), width)
    _say(f"APEX fused wgrad:   {yes[caps.apex_fused_wgrad]}", width)
    _say(f"aiter (AMD):        {caps.aiter_version or 'not installed'}", width)
    _say(f"fused wgrad path:   {WGRAD_WORDS[plan.wgrad_path]}", width)
    for note in caps.notes.values():
        _say(f"  note: {note}", width)
    if profile is not None:
        _say(f"profile:            {_profile_summary(profile)}", width)
        for message in plan.messages:
            if message.level == "profile":
                _say(f"  {message.text}", width)
    print()
    label = "Toggles on this machine" + (" (planned via MEGATRON_PERF_TOGGLES_ASSUME)" if env.assume else "")
    _say(f"{label}, for a Llama-style bf16 run:", width)
    rows = [[dest, format_value(d.value), d.reason] for dest, d in plan.shown().items()]  # a dense run: no MoE rows
    print(_table(rows, ["toggle", "value", "why"], width))
    return 0


def _llama_view() -> dict[str, Any]:
    return llama3_8b_args("bf16", "position_embedding_type", "num_layers", "optimizer")


def _add_doctor(sub: Any) -> None:
    doc = sub.add_parser("doctor", help="report what this machine has and which toggles can be on here",
                         description="Report Megatron, torch (ROCm/CUDA), GPU architecture, Transformer Engine "
                         "and its kernels, APEX and aiter, then which toggles can be on here and why not.")
    doc.add_argument("--megatron", metavar="PATH", help="a Megatron-LM checkout (default: whatever is importable)")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.set_defaults(func=cmd_doctor)

