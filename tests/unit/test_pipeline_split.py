"""Uneven pipeline splits in the memory model (core/memory/pipeline_split.py, core/memory/memory_layout.py):
each pipeline rank's layers as Megatron builds them from --decoder-first/last-pipeline-num-layers,
--account-for-embedding/loss-in-pipeline-split and --pipeline-model-parallel-layout, the busiest
stage priced with its own layers, and no number where the split cannot be read. Every expected
number is worked out here by hand; tests/real/test_pipeline_split_real.py holds the split against
Megatron's own functions on every tree."""

from __future__ import annotations

import enum
import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from conftest import explain_in_process, full_caps

from megatron_perf_toggles.core.decision.decide import decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.memory import allocator
from megatron_perf_toggles.core.memory import model as memory
from megatron_perf_toggles.core.memory.memory_words import fit_failure, summary
from megatron_perf_toggles.core.memory.pipeline_split import SplitUnknown, parse_layout, rank_layers

MB = 2**20


def ids(*ranks: range | tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r) for r in ranks)


# --- each rank's layers --------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "layers", "pp", "expected"), [
    ({}, 8, 4, ids(range(0, 2), range(2, 4), range(4, 6), range(6, 8))),
    ({}, 5, 1, ids(range(5))),
    # first 2, last 2, the 8 between them over the two middle ranks
    ({"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2}, 12, 4,
     ids(range(0, 2), range(2, 6), range(6, 10), range(10, 12))),
    ({"decoder_first_pipeline_num_layers": 1}, 10, 4, ids(range(0, 1), range(1, 4), range(4, 7), range(7, 10))),
    ({"decoder_last_pipeline_num_layers": 2}, 10, 3, ids(range(0, 4), range(4, 8), range(8, 10))),
    # a configuration object's TransformerConfig names
    ({"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}, 12, 4,
     ids(range(0, 2), range(2, 6), range(6, 10), range(10, 12))),
    # two virtual stages: chunks of 1, 2, 2, 1 layers, numbered chunk by chunk over the ranks
    ({"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2,
      "num_virtual_stages_per_pipeline_rank": 2}, 12, 4, ids((0, 6), (1, 2, 7, 8), (3, 4, 9, 10), (5, 11))),
    # the embedding and the loss count as layers: (6 + 2) / 4 = 2 a rank, one less on the first and the last
    ({"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}, 6, 4,
     ids((0,), (1, 2), (3, 4), (5,))),
    # ... and with two virtual stages only the first chunk of rank 0 and the last chunk of the last rank lose one
    ({"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True,
      "num_virtual_stages_per_pipeline_rank": 2}, 6, 4, ids((3,), (0, 4), (1, 5), (2,))),
    # --num-layers-per-virtual-pipeline-stage 1 with 2 layers a rank: two chunks
    ({"num_layers_per_virtual_pipeline_stage": 1}, 8, 4, ids((0, 4), (1, 5), (2, 6), (3, 7))),
    ({"virtual_pipeline_model_parallel_size": 2}, 8, 4, ids((0, 4), (1, 5), (2, 6), (3, 7))),  # as validate_args leaves it
    ({"pipeline_model_parallel_layout": "Et|t*5|t*5|tL"}, 12, 4, ids((0,), range(1, 6), range(6, 11), (11,))),
    ({"pipeline_model_parallel_layout": "E|t*3|t*3|t*2,L"}, 8, 4, ids((), range(0, 3), range(3, 6), (6, 7))),
    # eight stages over four ranks: stage k is chunk k // 4 of rank k % 4
    ({"pipeline_model_parallel_layout": "Et|tt|tt|t|t|tt|tt|tL"}, 12, 4, ids((0, 6), (1, 2, 7, 8), (3, 4, 9, 10), (5, 11))),
    ({"pipeline_model_parallel_layout": [["embedding", "decoder"], [" Decoder", "decoder", "LOSS"]]}, 3, 2,
     ids((0,), (1, 2))),
])
def test_each_rank_holds_the_layers_megatron_builds_there(args, layers, pp, expected):
    assert rank_layers(args, layers, pp) == expected


def test_the_layout_grammar_unrolls_groups_then_letters():
    assert parse_layout("Et*2|(t|)*3,tt|L") == ["Ett", "t", "t", "t", "tt", "L"]
    assert parse_layout("E|(t*2|)*2,L") == ["E", "tt", "tt", "L"]  # a group's letters repeat inside it first
    assert parse_layout("Et*2|(tt|)*2,tL") == ["Ett", "tt", "tt", "tL"]
    assert parse_layout("E|t*0|L") == ["E", "", "L"]


class LayerType(enum.Enum):
    """Stands in for Megatron's enum: members whose names are the layout's layer kinds."""

    embedding = 1
    decoder = 2
    loss = 3


def test_a_built_layout_object_is_read_per_rank_and_chunk():
    """A TransformerConfig holds the layout as an object whose ``layout[rank][chunk]`` lists layer kinds."""
    built = SimpleNamespace(layout=[[[LayerType.embedding, LayerType.decoder], [LayerType.decoder]],
                                    [[LayerType.decoder, LayerType.decoder], [LayerType.decoder, LayerType.loss]]])
    assert rank_layers({"pipeline_model_parallel_layout": built}, 5, 2) == ids((0, 3), (1, 2, 4))


@pytest.mark.parametrize(("args", "layers", "pp", "words"), [
    ({"pipeline_model_parallel_layout": "Et*2|x*2|L"}, 4, 3, "holds 'x', outside the layout's letters"),
    ({"pipeline_model_parallel_layout": "((t)*2)*2"}, 4, 1, "nested (...) group"),  # Megatron refuses it too
    ({"pipeline_model_parallel_layout": "(t*1000)*2000000"}, 4, 1, "count of 1 to 6 digits"),  # refused unread
    ({"pipeline_model_parallel_layout": "(t*999)*999999"}, 4, 1, "more than 100000 letters"),
    ({"pipeline_model_parallel_layout": "E(tt)|L"}, 2, 2, "needs a *n repeat"),
    ({"pipeline_model_parallel_layout": "Et|t|tm|L"}, 3, 4, "multi-token prediction"),
    ({"pipeline_model_parallel_layout": "Et|t*5|t*5|tL"}, 10, 4, "names 12 transformer layers, the model has 10"),
    ({"pipeline_model_parallel_layout": "Et|tt|tL"}, 4, 2, "3 stages, not a multiple of the 2"),
    ({"pipeline_model_parallel_layout": "tE|tL"}, 2, 2, "embedding (E) first"),
    ({"pipeline_model_parallel_layout": "|Et|tL"}, 2, 3, "first stage holds the embedding"),
    ({"pipeline_model_parallel_layout": {"stages": 2}}, 2, 2, "of type dict is not read"),
    ({"pipeline_model_parallel_layout": [["E", "t"], ["t", "L"]]}, 2, 2, "names a layer 'E'"),  # a list names kinds
    ({"pipeline_model_parallel_layout": [["embedding", "encoder"], ["decoder", "loss"]]}, 1, 2, "'encoder'"),
    ({"pipeline_model_parallel_layout": "Et|tL", "decoder_first_pipeline_num_layers": 1}, 2, 2, "other pipeline split"),
    ({"decoder_first_pipeline_num_layers": 3, "decoder_last_pipeline_num_layers": 2}, 12, 4, "leave 7 layers for 2"),
    ({"decoder_first_pipeline_num_layers": 0}, 12, 4, "needs 1 or more"),
    ({"decoder_first_pipeline_num_layers": 2, "account_for_loss_in_pipeline_split": True}, 12, 4, "account-for-loss"),
    ({"decoder_first_pipeline_num_layers": 3, "num_virtual_stages_per_pipeline_rank": 2}, 9, 4, "3 layers, not a multiple of 2"),
    ({"decoder_first_pipeline_num_layers": 2, "num_layers_per_virtual_pipeline_stage": 1}, 8, 4, "uneven first or last"),
    ({}, 10, 4, "10 layers do not split evenly over 4"),
    ({"account_for_embedding_in_pipeline_split": True}, 8, 4, "(the embedding and the loss counted as layers)"),
])
def test_a_split_megatron_would_refuse_or_the_model_cannot_read_is_unknown(args, layers, pp, words):
    with pytest.raises(SplitUnknown) as why:
        rank_layers(args, layers, pp)
    assert words in str(why.value) and "\n" not in str(why.value)


def test_a_layout_keeps_only_its_own_split():
    lay = memory.layout_from_args({**SMALL, "decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 1})
    with pytest.raises(ValueError, match="not this layout's"):
        replace(lay, pp=2)
    assert [replace(lay, pp=2, split=None).layer_count(s) for s in ("first", "last")] == [6, 6]


# --- the busiest stage, priced with its own layers -------------------------------------------------

# A small dense GPT: no TP, no sequence parallelism, no recompute, no SwiGLU, fp32 optimizer state
# everywhere (no distributed optimizer: 18 B a parameter), 12 layers over 4 pipeline stages.
H, FFN, HEADS, SEQ, VOCAB = 1024, 4096, 8, 1024, 32000
SMALL = {"hidden_size": H, "ffn_hidden_size": FFN, "num_attention_heads": HEADS, "seq_length": SEQ,
         "micro_batch_size": 1, "vocab_size": VOCAB, "untie_embeddings_and_output_weights": True, "num_layers": 12,
         "pipeline_model_parallel_size": 4, "world_size": 4}
LAYER = (3 * H * H + H * H + 2 * FFN * H + 2 * H) * 18 / MB  # qkv, projection, fc1, fc2, two norms
EMBEDDING = VOCAB * H * 18 / MB
ACTIVATION = SEQ * H * (10 + 8 + 4 * FFN / H) / MB  # one layer, one micro-batch, no SP: s*b*h*34 bytes
LOGITS = 6 * SEQ * VOCAB / MB + 4 * SEQ * H / MB  # the bf16 logits and their fp32 copy; the output layer's input
EMBEDDING_OUTPUT = 2 * SEQ * H / MB  # one micro-batch's


def stock(args: dict) -> memory.Estimate:
    return memory.stock_peak(memory.layout_from_args({**SMALL, **args}), False, True)


@pytest.mark.parametrize("split", [
    {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 1},
    {"pipeline_model_parallel_layout": "Et|t*5|t*5|tL"},
])
def test_a_middle_rank_with_more_layers_is_the_peak(split):
    """1, 5, 5, 1 layers: rank 1 holds five layers with three micro-batches in flight, more than the
    first stage's one layer with four, or the last's one layer, output layer and logits. Rank 2
    holds the same layers with fewer in flight, so it is not priced on its own."""
    est = stock(split)
    first = LAYER + EMBEDDING + 4 * ACTIVATION + 4 * EMBEDDING_OUTPUT
    rank1 = 5 * LAYER + 3 * 5 * ACTIVATION
    last = LAYER + (H + VOCAB * H) * 18 / MB + ACTIVATION + LOGITS
    assert est.stages == pytest.approx({"last": last, "first": first, "rank 1": rank1}, abs=0.1)
    assert est.peak_mb == pytest.approx(rank1, abs=0.1)
    assert est.parts == pytest.approx({"weights_and_optimizer": 5 * LAYER, "activations": 15 * ACTIVATION}, abs=0.1)


def test_the_even_split_is_priced_as_before():
    """Three layers a stage: the first stage peaks, and no middle rank is priced (each holds what
    the first holds, with fewer micro-batches in flight and no embedding)."""
    est = stock({})
    first = 3 * LAYER + EMBEDDING + 4 * 3 * ACTIVATION + 4 * EMBEDDING_OUTPUT
    assert list(est.stages) == ["last", "first"]
    assert est.peak_mb == pytest.approx(first, abs=0.1)


def test_a_heavy_last_stage_is_the_peak():
    """1, 1, 1, 9 layers: the last stage's nine layers (one micro-batch), output layer and logits."""
    est = stock({"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 9})
    last = 9 * LAYER + (H + VOCAB * H) * 18 / MB + 9 * ACTIVATION + LOGITS
    assert max(est.stages, key=est.stages.__getitem__) == "last"
    assert est.peak_mb == pytest.approx(last, abs=0.1)
    assert set(est.stages) == {"last", "first"}  # ranks 1 and 2 hold what the first holds, fewer in flight


def test_an_embedding_alone_stage_holds_no_layer():
    est = stock({"pipeline_model_parallel_layout": "E|t*4|t*4|t*4,L"})
    assert est.stages["first"] == pytest.approx(EMBEDDING + 4 * EMBEDDING_OUTPUT, abs=0.1)
    lay = memory.layout_from_args({**SMALL, "pipeline_model_parallel_layout": "E|t*4|t*4|t*4,L"})
    assert allocator.largest_allocation(lay, {}, stage="first").what == "the embedding's output"
    assert memory.dummy_wgrads_mb(lay, stage="first") == 0  # no layer, no output layer: no placeholder


def test_moe_layers_follow_the_interleaved_numbering():
    """Four dense layers then four MoE layers, two ranks of two virtual stages: rank 0 builds layers
    0, 1, 4, 5 and rank 1 layers 2, 3, 6, 7, two MoE layers each (a contiguous split would give
    rank 1 all four)."""
    moe = {**SMALL, "num_layers": 8, "pipeline_model_parallel_size": 2, "world_size": 2, "num_experts": 4,
           "moe_layer_freq": "([0]*4+[1]*4)", "num_virtual_stages_per_pipeline_rank": 2}
    lay = memory.layout_from_args(moe)
    assert (lay.moe_layers("first"), lay.moe_layers("last")) == (2, 2)
    assert lay.stage_layer_ids("first") == (0, 1, 4, 5)


# --- the plan: its words, its record, the guard ----------------------------------------------------

LARGE = ["--num-layers", "40", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
         "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192", "--max-position-embeddings",
         "8192", "--global-batch-size", "64", "--swiglu", "--untie-embeddings-and-output-weights", "--bf16",
         "--use-distributed-optimizer", "--pipeline-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--position-embedding-type", "rope", "--micro-batch-size", "2"]


def plan(capsys, *extra: str, vocab: str = "128256") -> tuple[int, dict, str]:
    code, out, err = explain_in_process(capsys, "--json", "--world-size", "32", "--gpu", "h100", "--",
                                        *LARGE, "--vocab-size", vocab, *extra)
    return code, json.loads(out)["memory"], err


@pytest.mark.usefixtures("clean_environment")
def test_the_plan_names_the_busiest_stage_and_its_layers(capsys):
    code, record, err = plan(capsys, "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1")
    assert code == 0, err
    assert record["pipeline_stage_layers"] == [1, 19, 19, 1]
    assert record["planned_peak_at"] == "on the rank 1 pipeline stage, in forward and backward"
    assert record["largest_allocation_stage"] == "rank 1"
    assert "largest allocation 448 MB on the rank 1 pipeline stage" in summary(record)
    _, even, _ = plan(capsys)
    assert even["pipeline_stage_layers"] == [10, 10, 10, 10]
    assert even["planned_peak_at"].startswith("on the first pipeline stage")
    assert record["stock_peak_mb"] > even["stock_peak_mb"] + 15 * 1024  # 19 layers with 3 in flight, against 10 with 4


@pytest.mark.usefixtures("clean_environment")
def test_fail_if_no_fit_acts_on_the_busiest_stage(capsys):
    """Even, 10 layers a stage fit an H100; a layout putting 26 on rank 1 does not, and the plan says so."""
    code, record, _ = plan(capsys, "--pipeline-model-parallel-layout", "E|t*26|t*13|tL")
    assert code == 0 and record["verdict"]["plan"] == "does_not_fit"
    assert fit_failure(record) is not None
    _, even, _ = plan(capsys)
    assert even["verdict"] == {"stock": "fits", "plan": "fits"} and fit_failure(even) is None


@pytest.mark.usefixtures("clean_environment")
def test_the_guard_backs_off_on_a_heavy_last_stage(capsys):
    """28 layers on the last stage with a 256000 vocabulary: the fused cross entropy's fp32 logits
    there tip the job, so the guard backs the default off. Priced as an even split, the first
    stage would peak and the fusion's term, on the last, would change nothing there."""
    code, record, err = plan(capsys, "--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers",
                             "28", vocab="256000")
    assert code == 0, err
    assert record["planned_peak_at"].startswith("on the last pipeline stage")
    args = json.loads(explain_in_process(capsys, "--json", "--world-size", "32", "--gpu", "h100", "--", *LARGE,
                                         "--vocab-size", "256000", "--decoder-first-pipeline-num-layers", "4",
                                         "--decoder-last-pipeline-num-layers", "28")[1])
    assert args["decisions"]["cross_entropy_loss_fusion"]["source"] == "guard"
    _, even, _ = plan(capsys, vocab="256000")
    assert even["peak_memory_notes"]["cross_entropy_loss_fusion"].endswith("is on the last stage")


@pytest.mark.usefixtures("clean_environment")
def test_an_unreadable_split_is_unknown_and_no_guard_acts(capsys):
    code, record, err = plan(capsys, "--pipeline-model-parallel-layout", "Et|t*19|t*19|tXL")
    assert code == 0, err
    assert record["stock_peak_mb"] is None and record["verdict"] is None and fit_failure(record) is None
    assert record["pipeline_stages"] == 4  # the job's pipeline, said though no estimate follows
    assert record["note"].startswith("no memory estimate: --pipeline-model-parallel-layout 'Et|t*19|t*19|tXL' holds 'X'")
    assert set(record["peak_memory_delta_mb"].values()) == {None}
    assert summary(record).count("\n") == 0


def test_decide_prices_no_split_it_cannot_read():
    """The same through ``decide`` on a card far too small for any job: no decision is backed off
    by memory, and the record says why there is no number."""
    args = {**SMALL, "decoder_first_pipeline_num_layers": 3, "decoder_last_pipeline_num_layers": 2, "bf16": True}
    result = decide(args, {}, read_env({}), full_caps(gpu_memory_mb=1.0))
    assert result.memory is not None and result.memory["stock_peak_mb"] is None and result.memory["verdict"] is None
    assert "leave 7 layers for 2 middle stages" in result.memory["note"]
    assert not any(d.reason.startswith("memory:") for d in result.decisions.values())
    tight = decide({**args, "decoder_first_pipeline_num_layers": 2}, {}, read_env({}), full_caps(gpu_memory_mb=1.0))
    assert tight.memory is not None and tight.memory["verdict"]["stock"] == "does_not_fit"  # read, so judged


def test_virtual_stages_over_uneven_ranks_are_unknown_even_ones_priced():
    """The interleaved schedule keeps more passes on the first ranks than 1F1B's PP - rank, so where
    the ranks hold different layer counts which one peaks is not known; with every rank alike the
    count is the one the model has always used (the even split, priced)."""
    even = {**SMALL, "num_virtual_stages_per_pipeline_rank": 3}
    assert memory.layout_from_args(even).rank_layers(0) == (0, 4, 8)
    for uneven in ({"decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2},
                   {"pipeline_model_parallel_layout": "Et|tt|tt|t|t|tt|tt|tL"}):
        args = {**SMALL, **uneven, **({} if "pipeline_model_parallel_layout" in uneven
                                      else {"num_virtual_stages_per_pipeline_rank": 2})}
        assert len({len(r) for r in rank_layers(args, 12, 4)}) > 1  # Megatron builds it: the split reads
        with pytest.raises(memory.Unknown, match="virtual pipeline stages over ranks of different layer counts"):
            memory.layout_from_args(args)
    one_chunk = {**SMALL, "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 2}
    assert memory.layout_from_args(one_chunk).rank_layers(1) == (2, 3, 4, 5)  # no virtual stages: priced


def test_a_layout_that_would_unroll_past_any_model_is_refused_at_once():
    """Its size is counted before it is unrolled (a billion letters would take seconds and
    gigabytes to build); the reason is one short line."""
    for text in ("(t*999)*999999", "t*" + "9" * 5000, "(tt)*900000"):
        with pytest.raises(SplitUnknown) as error:
            parse_layout(text)
        assert "\n" not in str(error.value) and len(str(error.value)) < 200
