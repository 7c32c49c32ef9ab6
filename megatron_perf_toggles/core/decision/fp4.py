"""FP4 layer selection: which first and last layers stay in bf16 when training in FP4.

Its own precedence (command line > FP4_* variables > the recipe's default, or with the plugin
switched off Megatron's own), and Megatron's per-stage bound on the counts, which applies only
with fp8.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import stock_off
from ..env import EnvSettings
from ..registry import flag_of
from .plan import Decision, Message

FP4_LAYER_DESTS = ("first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
FP4_RECIPE_SELECTION = {"nvfp4": (True, 2, 8), "mxfp4": (False, 2, 8)}  # (selective, start, end)
MEGATRON_FP4_LAYER_DEFAULTS = (False, 1, 1)  # TransformerConfig's own, where the parser does not say


def _fp4_defaults(args: Mapping[str, Any], env: EnvSettings, stock: Mapping[str, Any],
                  stock_from: Mapping[str, str] | None = None) -> dict[str, Decision]:
    """The FP4 layer selection nobody asked for: the recipe's (or, switched off, stock's own:
    Megatron's, or a front end's where ``stock_from`` says so)."""
    recipe = str(args.get("fp4_recipe") or "nvfp4")
    by_recipe, start, end = FP4_RECIPE_SELECTION.get(recipe, (False, 2, 8))
    if env.plugin_enabled:
        label = "first/last layers in bf16" if by_recipe else "every layer in FP4"
        return {FP4_LAYER_DESTS[0]: Decision(by_recipe, "default", f"{recipe} recipe default: {label}"),
                FP4_LAYER_DESTS[1]: Decision(start, "default", f"{recipe} recipe default"),
                FP4_LAYER_DESTS[2]: Decision(end, "default", f"{recipe} recipe default")}
    return {dest: stock_off.stock_default(stock.get(dest, value), (stock_from or {}).get(dest))
            for dest, value in zip(FP4_LAYER_DESTS, MEGATRON_FP4_LAYER_DEFAULTS, strict=True)}


def fp4_selection(args: Mapping[str, Any], explicit: Mapping[str, Any], env: EnvSettings,
                   stock: Mapping[str, Any], preset: Mapping[str, Decision] | None = None,
                   stock_from: Mapping[str, str] | None = None) -> tuple[dict[str, Decision], list[Message]]:
    """FP4 layer selection: CLI > FP4_* environment > the recipe's default (with the master
    switch off, Megatron's own defaults instead). Layer counts never switch selection on by
    themselves: Megatron reads them only with --first-last-layers-bf16, and the mxfp4 recipe
    trains every layer in FP4 unless selection is asked for."""
    if not args.get("fp4"):
        return {}, []
    preset = preset or {}
    defaults = _fp4_defaults(args, env, stock, stock_from)
    out: dict[str, Decision] = {}
    if "first_last_layers_bf16" in explicit:
        value = explicit["first_last_layers_bf16"]
        out["first_last_layers_bf16"] = Decision(value, "cli", "set on the command line (--first-last-layers-bf16)")
    elif env.fp4_selective_bf16 is not None:
        out["first_last_layers_bf16"] = Decision(
            env.fp4_selective_bf16, "env", f"FP4_SELECTIVE_BF16={int(env.fp4_selective_bf16)}")
    elif "first_last_layers_bf16" in preset:
        out["first_last_layers_bf16"] = preset["first_last_layers_bf16"]
    else:
        out["first_last_layers_bf16"] = defaults["first_last_layers_bf16"]
    selection = out["first_last_layers_bf16"]
    if not selection.value:
        return out, _fp4_counts_unused(explicit, env, selection)
    for dest, env_value, var in (
        ("num_layers_at_start_in_bf16", env.fp4_bf16_start, "FP4_BF16_START"),
        ("num_layers_at_end_in_bf16", env.fp4_bf16_end, "FP4_BF16_END"),
    ):
        if dest in explicit:
            out[dest] = Decision(explicit[dest], "cli", f"set on the command line ({flag_of(dest)})")
        elif env_value is not None:
            out[dest] = Decision(env_value, "env", f"{var}={env_value}")
        elif dest in preset:
            out[dest] = preset[dest]
        else:
            out[dest] = defaults[dest]
    _fp4_counts_per_stage(args, out)
    return out, []


def _fp4_counts_unused(explicit: Mapping[str, Any], env: EnvSettings, selection: Decision) -> list[Message]:
    """Layer counts given while selection is off: they do nothing, which is worth a warning."""
    given = [flag_of(d) for d in FP4_LAYER_DESTS[1:] if d in explicit]
    given += [var for var, value in (("FP4_BF16_START", env.fp4_bf16_start), ("FP4_BF16_END", env.fp4_bf16_end))
              if value is not None]
    if not given:
        return []
    return [Message(
        "warning",
        f"{' and '.join(given)} set, but FP4 selective bf16 is off ({selection.reason}): every layer trains "
        "in FP4 and the counts are unused; set FP4_SELECTIVE_BF16=1 (or pass --first-last-layers-bf16) "
        "to keep those layers in bf16",
    )]


def _fp4_counts_per_stage(args: Mapping[str, Any], out: dict[str, Decision]) -> None:
    """With fp8 Megatron bounds each count by one pipeline stage's layers; without, it does not."""
    per_stage = _layers_per_stage(args)
    if per_stage is None:
        return
    for dest in FP4_LAYER_DESTS[1:]:
        d = out[dest]
        if d.value <= per_stage:
            continue
        if args.get("fp8") and d.source != "cli":
            # TransformerConfig.__post_init__ bounds the counts by one pipeline stage, inside `if fp8`.
            out[dest] = Decision(per_stage, "guard", (
                f"{d.value} layers requested ({d.reason}), but with fp8 Megatron's TransformerConfig allows at "
                f"most the {per_stage} layers of one pipeline stage"))
        elif not args.get("fp8"):
            out[dest] = Decision(d.value, d.source, (
                f"{d.reason}; FP4 picks its bf16 layers by global layer number, so the count is not bounded by "
                f"a pipeline stage's {per_stage} layers (Megatron bounds it only with fp8)"))


def _layers_per_stage(args: Mapping[str, Any]) -> int | None:
    """Layers in one pipeline stage, as Megatron's fp8 rule counts them (num_layers // PP)."""
    layers = args.get("num_layers")
    if not isinstance(layers, int) or layers <= 0:
        return None
    pp = args.get("pipeline_model_parallel_size") or 1
    return max(layers // pp, 0)
