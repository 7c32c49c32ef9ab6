"""Shared fixtures. Real Megatron trees come only from MEGATRON_LM_TREES (':'-separated)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_perf_toggles.capabilities import Capabilities, MegatronFacts
from megatron_perf_toggles.env import read_env

REPO = Path(__file__).resolve().parents[1]


def megatron_trees() -> list[Path]:
    raw = os.environ.get("MEGATRON_LM_TREES", "")
    return [Path(p) for p in raw.split(os.pathsep) if p.strip()]


def full_caps(**overrides) -> Capabilities:
    """A machine that can honour every toggle (TE with both kernels, APEX), on a Megatron like main."""
    megatron = overrides.pop("megatron", MegatronFacts(
        version="0.20.0", fused_single_qkv_rope_field=True, asserts_te_cross_entropy=False,
        asserts_ddp_average_with_gtp=True,
    ))
    base = dict(te_version="2.20.2", te_fused_qkv_rope=True, te_cross_entropy=True, apex_fused_wgrad=True,
                device="cuda", megatron=megatron)
    base.update(overrides)
    return Capabilities(**base)


LLAMA_ARGS = {
    "bf16": True,
    "position_embedding_type": "rope",
    "num_layers": 32,
    "pipeline_model_parallel_size": 1,
    "optimizer": "adam",
    "lr": 3e-4,
    "adam_eps": 1e-8,
}


@pytest.fixture
def env():
    return lambda **kw: read_env({k: str(v) for k, v in kw.items()})
