"""The plugin-wide settings: environment variables that are not a Megatron toggle (the plugin on or
off, the dry run, planning for another machine, FP4 layer selection, profiles, the memory headroom).
Declared here, beside the registry of toggles (``core/registry.py``, which re-exports them and checks
them with the toggles at import); ``core.env`` parses every one by its ``kind``, and the README's
table and ``--help`` are generated from these records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Setting:
    """A plugin-wide environment variable that is not a Megatron toggle. ``core.env`` parses every
    one by its ``kind`` into the ``EnvSettings`` attribute ``field``; unset keeps that attribute's
    default, which ``default`` states for people (the README table)."""

    env: str
    kind: Literal["bool", "int", "text"]
    default: str
    help: str
    field: str


SETTINGS: tuple[Setting, ...] = (
    Setting("MEGATRON_PERF_TOGGLES", "bool", "1",
            "0 is stock Megatron: every plugin default is off (the FP4 layer selection by recipe too) and "
            "Megatron's own values stand; the flags stay registered, variables that are set still apply, "
            "and guards act only on those.",
            field="plugin_enabled"),
    Setting("MEGATRON_PERF_TOGGLES_TAG_LOG_DIR", "bool", "1",
            "0 leaves --tensorboard-dir and --wandb-save-dir untagged.",
            field="tag_log_dir"),
    Setting("MEGATRON_PERF_TOGGLES_ASSUME", "text", "",
            "Plan for another machine: comma list of apex, aiter, grouped_gemm, rocm, cuda, te=VERSION, none. "
            "Replaces detection of those packages; a plan for another machine starts from its planned stack "
            "and this replaces what it names.",
            field="assume"),
    Setting("MEGATRON_PERF_TOGGLES_WGRAD_FALLBACK", "bool", "1",
            "Without APEX, keep gradient accumulation fusion on through a torch GEMM stand-in for APEX's "
            "fused wgrad kernels (CUDA/ROCm, torch with addmm out_dtype); 0 turns fusion off instead.",
            field="wgrad_fallback"),
    Setting("MEGATRON_PERF_TOGGLES_RANK_CHECK", "bool", "1",
            "0 skips the start-up check that every rank decided the same toggles and capabilities.",
            field="rank_check"),
    Setting("MEGATRON_PERF_TOGGLES_DRY_RUN", "bool", "0",
            "1 makes the launcher (or a patched pretrain_gpt.py) stop after Megatron's parse and validate "
            "and print the plan.",
            field="dry_run"),
    Setting("MEGATRON_PERF_TOGGLES_PLAN", "text", "",
            "The job a dry run plans for, as WORLD:GPU (64:h100, 8, :mi355x): what the launcher's --world-size "
            "and --gpu say, for a patched checkout too.",
            field="plan"),
    Setting("MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT", "text", "summary",
            "What a dry run prints: summary (the plan on one screen; Megatron's output and the JSON record go to "
            "a file), json (the record on stdout) or verbose (the summary, Megatron's output and the record).",
            field="dry_run_output"),
    Setting("MEGATRON_PERF_TOGGLES_FAIL_IF_NO_FIT", "bool", "0", "1: explain and a dry run (a patched checkout's too) "
            "exit 3 after a plan that does not fit the GPU's memory, as their --fail-if-no-fit.", field="fail_if_no_fit"),
    Setting("FP4_SELECTIVE_BF16", "bool", "",
            "With FP4: 1 keeps the first/last layers in bf16, 0 puts every layer in FP4 "
            "(default by recipe: nvfp4 1, mxfp4 0; with MEGATRON_PERF_TOGGLES=0, Megatron's own: 0).",
            field="fp4_selective_bf16"),
    Setting("FP4_BF16_START", "int", "2",
            "With FP4 selective bf16: how many layers at the start stay in bf16 (alone it does not switch "
            "selection on).",
            field="fp4_bf16_start"),
    Setting("FP4_BF16_END", "int", "8",
            "With FP4 selective bf16: how many layers at the end stay in bf16, counted over the whole "
            "model, not per pipeline stage.",
            field="fp4_bf16_end"),
    Setting("MEGATRON_PERF_TOGGLES_PROFILE", "text", "",
            "A profile file (JSON, written by `megatron-perf-toggles tune`) whose toggle values replace the plugin "
            "defaults: command line > environment variable > profile > plugin default; guards still apply.",
            field="profile_path"),
    Setting("MEGATRON_PERF_TOGGLES_MEMORY_HEADROOM", "text", "10%",
            "Memory the guard keeps free per GPU: a percentage of its memory (10%) or GB (8). A default whose "
            "estimated peak-memory cost would tip a job that fits stock Megatron over the rest is backed off.",
            field="memory_headroom"),
    Setting("MEGATRON_PERF_TOGGLES_PATCHES", "text", "",
            "Where `megatron-perf-toggles patch` finds its patch sets: a directory laid out like the "
            "repository's patches/ (default: the copy installed with the package, else the source tree's).",
            field="patches_dir"),
)
