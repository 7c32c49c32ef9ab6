"""The caching allocator in the memory plan (core/allocator.py, core/memory_guard.py): the largest
allocation, the three verdicts, the guard that backs a default off only where that changes the
outcome, the launch environment it asks for, Megatron's own rules about the setting, and the H200
runs that check the verdicts (docs/benchmarks/allocator_validation.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import full_caps

from megatron_perf_toggles.core import allocator, megatron_rules, memory
from megatron_perf_toggles.core.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import MegatronFacts

REPO = Path(__file__).resolve().parents[2]
ES = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
NATIVE = {"CROSS_ENTROPY_FUSION_IMPL": "native"}
H200_MB = 143156.0  # what torch reports on an H200
# A logits-heavy job: 40960 tokens of a 256000 vocabulary per micro-batch on one GPU (the H200 runs' logits-41k).
LOGITS = {"hidden_size": 1024, "ffn_hidden_size": 3584, "num_layers": 4, "num_attention_heads": 16,
          "group_query_attention": True, "num_query_groups": 4, "seq_length": 4096, "micro_batch_size": 10,
          "vocab_size": 256000, "untie_embeddings_and_output_weights": True, "swiglu": True, "bf16": True,
          "use_distributed_optimizer": True, "world_size": 1, "transformer_impl": "transformer_engine"}


MAIN = MegatronFacts(version="0.20.0", rules=tuple(r.id for r in megatron_rules.RULES if "main" in r.versions))


def plan(args=None, explicit=None, gpu_mb=H200_MB, megatron=None, **environ):
    caps = full_caps(apex_fused_wgrad=False, wgrad_fallback=True, gpu_memory_mb=gpu_mb, gpu_name="GPU",
                     torch_version="2.9.0", **({"megatron": megatron} if megatron else {}))
    return decide(args or LOGITS, explicit or {}, read_env(environ), caps)


@pytest.mark.parametrize(("environ", "on"), [
    ({}, False), (ES, True), ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    # torch reads the generic name first: it wins over the CUDA one
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
    ({"PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"}, True),
])
def test_the_allocator_setting_is_read_where_torch_reads_it(environ, on):
    assert allocator.expandable_segments(environ) is on
    assert read_env(environ).expandable_segments is on


def test_the_largest_allocation_follows_the_cross_entropy_path():
    layout = memory.layout_from_args(LOGITS)
    tv = layout.tokens * layout.vocab_per_rank
    stock = allocator.largest_allocation(layout, {"cross_entropy_loss_fusion": False})
    te = allocator.largest_allocation(layout, {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "te"})
    assert stock.mb == pytest.approx(4 * tv / 2**20, abs=0.1) and "fp32" in stock.what
    assert te.mb == pytest.approx(2 * tv / 2**20, abs=0.1) and "bf16" in te.what
    # A dense job with a small vocabulary: the MLP's first projection can be the largest.
    small = memory.layout_from_args({**LOGITS, "vocab_size": 1024, "ffn_hidden_size": 16384})
    assert "MLP" in allocator.largest_allocation(small, {}).what
    # Attention outside a fused kernel materialises its scores.
    local = memory.layout_from_args({**LOGITS, "vocab_size": 1024, "transformer_impl": "local", "seq_length": 16384,
                                     "micro_batch_size": 1})
    assert "attention scores" in allocator.largest_allocation(local, {}).what


@pytest.mark.parametrize(("peak", "largest", "es_set", "allowed", "expected"), [
    (50, 20, False, True, "fits"),
    (70, 20, False, True, "fits_with_expandable_segments"),
    (70, 20, True, True, "fits"),
    (70, 20, False, False, "does_not_fit"),
    (90, 20, False, True, "does_not_fit"),
    (90, 20, True, True, "does_not_fit"),
])
def test_verdicts(peak, largest, es_set, allowed, expected):
    assert allocator.verdict(peak, allocator.Largest(largest, "x"), 80, es_set, allowed) == expected


def test_a_default_that_needs_expandable_segments_where_stock_does_not_is_backed_off():
    """Stock fits with fixed segments; the native fusion's fp32 copy would make the job need
    expandable segments: backed off, and the reason says which case it is."""
    p = plan(CROSS_ENTROPY_FUSION_IMPL="native")
    ce = p.decisions["cross_entropy_loss_fusion"]
    assert (ce.value, ce.source) == (False, "guard")
    assert "fit without expandable segments" in ce.reason or "to fit (" in ce.reason
    assert p.memory["verdict"] == {"stock": "fits", "plan": "fits"}
    assert not p.memory["launch_environment"]
    assert not [m for m in p.messages if m.level == "warning"]


def test_with_expandable_segments_set_the_default_is_judged_on_the_peak_alone():
    small = {**LOGITS, "micro_batch_size": 4}  # 16384 tokens: the native term is a measured one there
    without = plan(small, gpu_mb=60 * 1024, CROSS_ENTROPY_FUSION_IMPL="native")
    with_es = plan(small, gpu_mb=60 * 1024, CROSS_ENTROPY_FUSION_IMPL="native", **ES)
    assert without.decisions["cross_entropy_loss_fusion"].source == "guard"
    assert with_es.decisions["cross_entropy_loss_fusion"].value is True
    assert with_es.memory["verdict"]["plan"] == "fits" and with_es.memory["expandable_segments_set"] is True


def test_where_only_expandable_segments_make_it_fit_the_launch_says_so():
    heavy = {**LOGITS, "micro_batch_size": 14}  # the H200 runs' logits-57k: stock died in its second iteration
    p = plan(heavy, **NATIVE)  # as on Megatron 0.19 and later, which refuse the te implementation
    assert p.memory["verdict"] == {"stock": "fits_with_expandable_segments", "plan": "fits_with_expandable_segments"}
    assert p.memory["largest_allocation_mb"] == pytest.approx(4 * 57344 * 256000 / 2**20, abs=0.1)
    (var,) = p.memory["launch_environment"]
    assert (var["name"], var["value"]) == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "largest allocation" in var["why"] and "fp32 copy of the logits" in var["why"]
    assert any("fits only with expandable segments" in m.text for m in p.messages)
    assert not plan(heavy, **ES, **NATIVE).memory["launch_environment"]  # already set: nothing to ask
    # Transformer Engine's cross entropy holds no fp32 copy: there the defaults fit where stock needs the setting.
    te = plan(heavy)
    assert te.decisions["cross_entropy_fusion_impl"].value == "te"
    assert te.memory["verdict"] == {"stock": "fits_with_expandable_segments", "plan": "fits"}


def test_te_cuda_graphs_ask_for_nccl_graph_register_beside_it():
    heavy = {**LOGITS, "micro_batch_size": 14, "cuda_graph_impl": "transformer_engine"}
    names = [v["name"] for v in plan(heavy, megatron=MAIN, **NATIVE).memory["launch_environment"]]
    assert names == ["PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER"]
    # A Megatron without the rule (before 0.16 it refuses the pair outright, as below)
    old = MegatronFacts(version="0.15.0", rules=("cuda_graphs_expandable_segments",))
    p = plan(heavy, megatron=old, **NATIVE)
    assert p.memory["launch_environment"] == [] and p.memory["verdict"]["plan"] == "does_not_fit"
    assert "CUDA graphs" in p.memory["expandable_segments_refused"]


def test_megatron_refusing_expandable_segments_with_nccl_user_buffers():
    heavy = {**LOGITS, "micro_batch_size": 14, "nccl_ub": True}
    p = plan(heavy, megatron=MAIN, **NATIVE)  # torch 2.9 here: Megatron refuses the setting with --use-nccl-ub
    assert p.memory["verdict"]["plan"] == "does_not_fit" and not p.memory["launch_environment"]
    assert any("--use-nccl-ub" in m.text for m in p.messages if m.level == "warning")
    newer = full_caps(apex_fused_wgrad=False, wgrad_fallback=True, gpu_memory_mb=H200_MB, torch_version="2.11.0",
                      megatron=MAIN)
    assert decide(heavy, {}, read_env(NATIVE), newer).memory["verdict"]["plan"] == "fits_with_expandable_segments"
    # A Megatron without the rule (0.13) takes the setting with user buffers too.
    p13 = plan(heavy, megatron=MegatronFacts(version="0.13.0", rules=()), **NATIVE)
    assert p13.memory["verdict"]["plan"] == "fits_with_expandable_segments"


def test_past_the_validated_size_the_native_fusion_is_priced_as_a_bound():
    layout = memory.layout_from_args(LOGITS)  # 10.5e9 logits per micro-batch
    assert layout.tokens * layout.vocab_per_rank > memory.NATIVE_CE_VALIDATED_ELEMENTS
    assert memory.cross_entropy_mb(layout, True, "native") == pytest.approx(2 * memory.fp32_logits_mb(layout))
    small = memory.layout_from_args({**LOGITS, "micro_batch_size": 4})
    assert memory.cross_entropy_mb(small, True, "native") == pytest.approx(memory.fp32_logits_mb(small))


# --- the H200 runs -----------------------------------------------------------------------------------

VALIDATION = json.loads((REPO / "docs" / "benchmarks" / "allocator_validation.json").read_text())


def test_the_committed_runs_cover_three_layouts_and_every_verdict_held():
    layouts = {r["layout"] for r in VALIDATION}
    assert len(layouts) >= 3
    for layout in layouts:
        cells = {(r["arm"], r["alloc"]) for r in VALIDATION if r["layout"] == layout}
        assert cells == {(a, b) for a in ("stock", "defaults") for b in ("fixed", "expandable")}, layout
    assert all(r["outcome"] == r["expected"] for r in VALIDATION)
    assert {r["outcome"] for r in VALIDATION} == {"ran", "out of memory"}
