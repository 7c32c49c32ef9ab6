"""The caching allocator in the memory plan (core/memory/allocator.py, core/memory/memory_guard.py): the largest
allocation, the three verdicts, the guard that backs a default off only where that changes the
outcome, the launch environment it asks for, Megatron's own rules about the setting, and the H200
runs that check the verdicts (docs/benchmarks/allocator_validation.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import MegatronFacts
from megatron_perf_toggles.core.memory import allocator
from megatron_perf_toggles.core.memory import model as memory
from megatron_perf_toggles.core.rules import megatron_rules
from megatron_perf_toggles.errors import EnvValueError

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
    assert allocator.alloc_conf(environ).expandable is on
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
    stages = [(peak, allocator.Largest(largest, "x"))]
    fixed, expandable = allocator.need_mb(stages, False), allocator.need_mb(stages, True)
    assert (fixed, expandable) == (peak + largest, peak)
    assert allocator.verdict(fixed, expandable, 80, es_set, allowed) == expected


def test_the_need_is_the_neediest_stages():
    """With pipeline parallelism the first stage may peak higher, but it holds no logits: each stage's
    peak goes with its own largest allocation."""
    first, last = (55000.0, allocator.Largest(448, "mlp")), (50000.0, allocator.Largest(4008, "logits"))
    assert allocator.need_mb([first, last], False) == 55448 and allocator.need_mb([first, last], True) == 55000
    args = {**LOGITS, "vocab_size": 128256, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
            "num_query_groups": 8, "num_layers": 32, "seq_length": 8192, "micro_batch_size": 1,
            "pipeline_model_parallel_size": 8, "world_size": 8}
    layout = memory.layout_from_args(args)
    assert "logits" not in allocator.largest_allocation(layout, {}, stage="first").what
    p = plan(args, gpu_mb=None)
    need = p.memory["allocator_need_mb"]
    assert need["expandable_segments"] == p.memory["planned_peak_mb"]  # the first stage peaks ...
    assert need["fixed_segments"] - need["expandable_segments"] < 1000  # ... and its largest is not the logits


def test_a_default_that_needs_expandable_segments_where_stock_does_not_is_backed_off():
    """Stock fits with fixed segments; the native fusion's fp32 copy would make the job need
    expandable segments: backed off, and the reason says which case it is."""
    p = plan(CROSS_ENTROPY_FUSION_IMPL="native")
    ce = p.decisions["cross_entropy_loss_fusion"]
    assert (ce.value, ce.source) == (False, "guard")
    assert "the job fits only with expandable segments" in ce.reason and "to fit without expandable segments" in ce.reason
    assert p.decisions["gradient_accumulation_fusion"].source == "default"  # the stop: nothing more backed off
    assert p.memory["largest_allocation_mb"] == pytest.approx(4 * 40960 * 256000 / 2**20, abs=0.1)
    assert p.memory["allocator_need_mb"]["fixed_segments"] == pytest.approx(
        p.memory["planned_peak_mb"] + p.memory["largest_allocation_mb"], abs=0.2)
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


def test_a_back_off_that_does_not_help_is_skipped_and_the_goal_is_stocks():
    """Stock needs expandable segments; the defaults do not fit at all. Backing off the fusion brings
    the plan back to stock's verdict, and the guard stops there, saying so; the plan's record follows."""
    heavy = {**LOGITS, "micro_batch_size": 14}
    p = plan(heavy, gpu_mb=150 * 1024, CROSS_ENTROPY_FUSION_IMPL="native")
    ce = p.decisions["cross_entropy_loss_fusion"]
    assert ce.source == "guard" and ce.reason.endswith("to fit with expandable segments "
                                                       "(MEGATRON_PERF_TOGGLES_MEMORY_HEADROOM sets the headroom)")
    assert p.memory["verdict"] == {"stock": "fits_with_expandable_segments", "plan": "fits_with_expandable_segments"}
    assert p.memory["peak_memory_delta_mb"]["cross_entropy_loss_fusion"] == 0


@pytest.mark.parametrize("environ", [{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true"},
                                     {"PYTORCH_ALLOC_CONF": "expandable_segments:maybe"}])
def test_a_value_torch_refuses_is_one_clear_error(environ):
    with pytest.raises(EnvValueError, match="expandable_segments:True or expandable_segments:False"):
        read_env(environ)


def test_the_advice_keeps_the_users_own_options_in_the_variable_torch_reads():
    heavy = {**LOGITS, "micro_batch_size": 14}
    mine = plan(heavy, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512", **NATIVE).memory["launch_environment"][0]
    assert (mine["name"], mine["value"]) == ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    generic = plan(heavy, PYTORCH_ALLOC_CONF="", **NATIVE).memory["launch_environment"][0]
    assert (generic["name"], generic["value"]) == ("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    # Not the caching allocator: no fixed-segment rule, and the plan says so.
    asynchronous = plan(heavy, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync", **NATIVE).memory
    assert asynchronous["verdict"]["plan"] == "fits" and "cudaMallocAsync" in asynchronous["note"]


def test_expandable_segments_set_where_megatron_refuses_them_is_a_warning():
    heavy = {**LOGITS, "micro_batch_size": 14, "nccl_ub": True}
    p = plan(heavy, megatron=MAIN, **ES, **NATIVE)
    assert any("Megatron will stop this launch" in m.text for m in p.messages if m.level == "warning")


# --- the H200 runs -----------------------------------------------------------------------------------

VALIDATION = json.loads((REPO / "docs" / "benchmarks" / "allocator_validation.json").read_text())


def test_the_committed_runs_cover_three_layouts_and_every_verdict_held():
    layouts = {r["layout"] for r in VALIDATION}
    assert len(layouts) >= 3
    for layout in layouts:
        cells = {(r["arm"], r["alloc"]) for r in VALIDATION if r["layout"] == layout}
        assert cells == {(a, b) for a in ("stock", "defaults") for b in ("fixed", "expandable")}, layout
    # The GPU ran out of memory exactly where the plan said it would ...
    assert all((r["expected"] == "out of memory") == (r["outcome"] == "out of memory") for r in VALIDATION)
    assert {"ran", "out of memory"} <= {r["outcome"] for r in VALIDATION}
    # ... and a job that failed for another reason says where.
    assert all(r.get("failed_in") for r in VALIDATION if r["outcome"] not in ("ran", "out of memory"))


def test_the_committed_runs_name_no_machine_path():
    import re

    for path in [*(REPO / "docs" / "benchmarks" / "raw" / "allocator").glob("*.json"),
                 REPO / "docs" / "benchmarks" / "allocator_validation.json"]:
        assert not re.search(r"/(work|root|opt|tmp|home|usr)/", path.read_text()), path
