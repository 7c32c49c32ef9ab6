"""``MEGATRON_PERF_TOGGLES=0`` means stock Megatron: what the plan may not do then, in one place.

Switched off, the plugin patches nothing (no torch fallback for APEX's fused wgrad kernel),
refuses nothing on the command line (Megatron's own parser and checks speak for themselves), and
reports no change against stock. Where stock itself would fail, the plan says so in a note rather
than pricing a fallback that will not be there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .decision.plan import Message
from .env import EnvSettings
from .facts import Capabilities

GAF = "gradient_accumulation_fusion"


def wgrad_path(fused: bool, caps: Capabilities, env: EnvSettings) -> str:
    """Who computes fused weight gradients: ``apex``, the plugin's torch ``fallback`` (never with the
    plugin off: that is a patch), ``missing`` (stock fails at the first backward) or ``off``."""
    if not fused:
        return "off"
    if caps.apex_fused_wgrad:
        return "apex"
    return "fallback" if caps.wgrad_fallback and env.wgrad_fallback and env.plugin_enabled else "missing"


def keeps_cli(env: EnvSettings, source: str) -> bool:
    """Whether a guard must leave a value alone without refusing it: a command-line value with the
    plugin off is stock's to accept or refuse, not the plugin's."""
    return source == "cli" and not env.plugin_enabled


def priced(values: Mapping[str, Any], base: Mapping[str, Any], caps: Capabilities, env: EnvSettings
           ) -> dict[str, Any]:
    """The values the memory model prices: fused wgrad with no kernel to run it (``missing``) fails
    exactly where stock does, so it is priced as stock runs (no change), not as the fallback."""
    out = dict(values)
    if out.get(GAF) and wgrad_path(True, caps, env) == "missing":
        out[GAF] = base.get(GAF, out[GAF])
    return out


def notes(path: str, env: EnvSettings) -> list[Message]:
    """A note where stock itself would fail with this plan (the plan still exits 0: it is stock's)."""
    if path != "missing":
        return []
    why = "MEGATRON_PERF_TOGGLES=0" if not env.plugin_enabled else "the wgrad fallback is switched off"
    return [Message("note", f"stock Megatron would fail here: gradient accumulation fusion is on and APEX's "
                            f"fused_weight_gradient_mlp_cuda is missing ({why}, so the torch fallback is not "
                            "installed); Megatron stops at the first backward pass: install APEX, or pass "
                            "--no-gradient-accumulation-fusion")]
