"""The registry against the product spec (the issue's toggle table), and declaration-time checks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_perf_toggles.core import registry
from megatron_perf_toggles.errors import RegistryError

# The product specification, written out independently of the code under test.
SPEC = {
    "GRADIENT_ACCUMULATION_FUSION": ("gradient_accumulation_fusion", True,
                                     ("--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion")),
    "GRAD_REDUCE_IN_BF16": ("grad_reduce_in_bf16", True, ("--grad-reduce-in-bf16", "--no-grad-reduce-in-bf16")),
    "DDP_AVERAGE_IN_COLLECTIVE": ("ddp_average_in_collective", True,
                                  ("--ddp-average-in-collective", "--no-ddp-average-in-collective")),
    "CROSS_ENTROPY_LOSS_FUSION": ("cross_entropy_loss_fusion", True,
                                  ("--cross-entropy-loss-fusion", "--no-cross-entropy-loss-fusion")),
    "CROSS_ENTROPY_FUSION_IMPL": ("cross_entropy_fusion_impl", "te", ("--cross-entropy-fusion-impl",)),
    "FUSED_SINGLE_QKV_ROPE": ("fused_single_qkv_rope", True, ("--fused-single-qkv-rope", "--no-fused-single-qkv-rope")),
    # issue 36: the mixture-of-experts toggles, on by default (for MoE models only)
    "MOE_GROUPED_GEMM": ("moe_grouped_gemm", True, ("--moe-grouped-gemm", "--no-moe-grouped-gemm")),
    "MOE_PERMUTE_FUSION": ("moe_permute_fusion", True, ("--moe-permute-fusion", "--no-moe-permute-fusion")),
    "MOE_ROUTER_FUSION": ("moe_router_fusion", True, ("--moe-router-fusion", "--no-moe-router-fusion")),
}
MOE_DESTS = {"moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion"}


def test_registry_matches_spec_table():
    got = {t.env: (t.dest, t.default, t.flags) for t in registry.TOGGLES}
    assert got == SPEC


def test_moe_toggles_apply_to_moe_models_only():
    assert {t.dest for t in registry.TOGGLES if t.scope == "moe"} == MOE_DESTS
    for dest in MOE_DESTS:
        toggle = registry.BY_DEST[dest]
        assert toggle.group == "moe"
        assert toggle.applies({"num_experts": 8}) and toggle.applies({"num_moe_experts": 2})
        assert not any(toggle.applies(a) for a in ({}, {"num_experts": None}, {"num_experts": 0}, {"num_experts": True}))
    assert registry.BY_DEST["grad_reduce_in_bf16"].applies({})


def test_choice_toggle_accepts_te_and_native():
    assert set(registry.BY_DEST["cross_entropy_fusion_impl"].choices) == {"te", "native"}


def _validate_with(monkeypatch, toggles):
    monkeypatch.setattr(registry, "TOGGLES", tuple(toggles))
    registry._validate()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"group": "nowhere"}, "unknown group"),
        ({"needs": ("warp_drive",)}, "unknown capability"),
        ({"default": "yes"}, "bool defaults"),
        ({"choices": ("on", "off")}, "needs flag and off_flag, no choices"),
        ({"flag": "grad-reduce"}, "malformed"),
        ({"help": "two\nlines"}, "one line"),
    ],
)
def test_bad_declaration_is_rejected_naming_the_entry(monkeypatch, change, message):
    bad = replace(registry.BY_DEST["grad_reduce_in_bf16"], **change)
    others = [t for t in registry.TOGGLES if t.dest != "grad_reduce_in_bf16"]
    with pytest.raises(RegistryError, match=message) as info:
        _validate_with(monkeypatch, [*others, bad])
    assert "grad_reduce_in_bf16" in str(info.value)


def test_duplicate_dest_is_rejected(monkeypatch):
    t = registry.TOGGLES[0]
    with pytest.raises(RegistryError, match="duplicate"):
        _validate_with(monkeypatch, [*registry.TOGGLES, t])


def test_choice_default_must_be_a_choice(monkeypatch):
    bad = replace(registry.BY_DEST["cross_entropy_fusion_impl"], default="cudnn")
    others = [t for t in registry.TOGGLES if t.kind == "bool"]
    with pytest.raises(RegistryError, match="among its choices"):
        _validate_with(monkeypatch, [*others, bad])
