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
}


def test_registry_matches_spec_table():
    got = {t.env: (t.dest, t.default, t.flags) for t in registry.TOGGLES}
    assert got == SPEC


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
