"""``MEGATRON_PERF_TOGGLES=0`` means stock: what the plan may not do then, in one place.

Switched off, the plugin patches nothing (no torch fallback for APEX's fused wgrad kernel),
refuses nothing on the command line or in a front end's configuration (Megatron's own parser and
checks speak for themselves), tags no log directory, and reports no change against stock. Each
value is labelled by where stock takes it from: the command line, the configuration (a Bridge
recipe, a Primus YAML file), a front end's own default, or Megatron's. Where stock itself would
fail, the plan says so in a note rather than pricing a fallback that will not be there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .decision.plan import Decision, Message
from .env import EnvSettings
from .facts import Capabilities

GAF = "gradient_accumulation_fusion"
OFF = "MEGATRON_PERF_TOGGLES=0"
MEGATRON_DEFAULT = "Megatron's own default"
# The sources whose value stock runs as it is: what the user gave, and what stock would take anyway.
STOCK_SOURCES = {"cli": "left as given", "config": "left as given", "default": "left as stock"}


def fallback_installed(caps: Capabilities, env: EnvSettings) -> bool:
    """Whether the plugin's torch stand-in for APEX's fused wgrad kernel would be there: it can run
    on the machine, it is not switched off, and the plugin is on (the fallback is a patch)."""
    return caps.wgrad_fallback and env.wgrad_fallback and env.plugin_enabled


def wgrad_path(fused: bool, caps: Capabilities, env: EnvSettings) -> str:
    """Who computes fused weight gradients: ``apex``, the plugin's torch ``fallback`` (never with the
    plugin off: that is a patch), ``missing`` (stock fails at the first backward) or ``off``."""
    if not fused:
        return "off"
    if caps.apex_fused_wgrad:
        return "apex"
    return "fallback" if fallback_installed(caps, env) else "missing"


def stock_default(value: Any, where: str | None = None) -> Decision:
    """The decision of a value nobody asked for, with the plugin off: stock's own, labelled by where
    stock takes it from (``where``: a front end's default, e.g. a Primus YAML file's; else Megatron's)."""
    return Decision(value, "default", f"{OFF}: {where or MEGATRON_DEFAULT}")


def left_alone(env: EnvSettings, source: str) -> str | None:
    """With the plugin off, the words for a guard's concern about a value that stays (a command-line
    or configuration value is stock's to accept or refuse, a default is stock's own); None with the
    plugin on, or for a value asked for through the environment or a profile (still guarded)."""
    return None if env.plugin_enabled else STOCK_SOURCES.get(source)


def tags_log_dirs(env: EnvSettings) -> bool:
    """Whether the plan tags the log directories with the precision: a change to the namespace, so
    only with the plugin on (and MEGATRON_PERF_TOGGLES_TAG_LOG_DIR not 0)."""
    return env.plugin_enabled and env.tag_log_dir


def untagged_because(env: EnvSettings) -> str:
    """Why the log directories stay as given (for a plan that has some set)."""
    return OFF if not env.plugin_enabled else "MEGATRON_PERF_TOGGLES_TAG_LOG_DIR=0"


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
    why = OFF if not env.plugin_enabled else "the wgrad fallback is switched off"
    return [Message("note", f"stock Megatron would fail here: gradient accumulation fusion is on and APEX's "
                            f"fused_weight_gradient_mlp_cuda is missing ({why}, so the torch fallback is not "
                            "installed); Megatron stops at the first backward pass: install APEX, or pass "
                            "--no-gradient-accumulation-fusion")]
