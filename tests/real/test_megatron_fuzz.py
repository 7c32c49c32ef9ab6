"""Seeded fuzzing: random combinations of flags that interact with the toggles and each other.

For each sample (tests/megatron_fuzz.py) on every tree in MEGATRON_LM_TREES: stock Megatron (A)
against plugin defaults on an assumed GPU box (C1) and with nothing installed (C2), and against the
plugin with MEGATRON_PERF_TOGGLES=0 (B, whose namespace must equal A's apart from what the plugin
documents), through real parse_args + validate_args + core_transformer_config_from_args. Whatever
stock accepts, the plugin accepts too; where the sample set a toggle flag explicitly, the plugin may instead refuse
with its own one-line error (exit 2, "[perf-toggles] ..."). Explicit settings end as they end in
stock Megatron.

PTT_FUZZ_SEED and PTT_FUZZ_COUNT choose the samples; CI runs the fixed default seed. A failure
prints the seed, each failing sample's environment and argv, and the errors.
"""

from __future__ import annotations

import pytest

pytest.importorskip("yaml", reason="reading Megatron's functional-test configs needs pyyaml, which the megatron-cpu extra installs")
import megatron_corpus as corpus
import megatron_fuzz
from conftest import megatron_trees

TREES = megatron_trees()
needs_trees = pytest.mark.real_megatron


@needs_trees
@pytest.mark.parametrize("tree", [str(t) for t in TREES] or ["no-trees"], ids=lambda t: corpus.tree_id(t))
def test_fuzz_stock_accepted_holds_with_plugin(tree: str, capsys: pytest.CaptureFixture[str]) -> None:
    payload = corpus.FUZZ.get(tree)
    stats = corpus.judge_fuzz(payload)
    with capsys.disabled():
        print("\n[fuzz] " + corpus.fuzz_summary(tree, payload, stats))
    assert stats["samples"] == payload["count"]
    assert stats["accepted"] > 0, "stock Megatron accepted no sample: the generator, not the plugin, is broken"
    assert not stats["failures"], corpus.fuzz_failure_text(tree, payload, stats["failures"])


def test_generator_is_seeded_and_uses_known_flags_only() -> None:
    known = ["--bf16", "--fp16", "--tensor-model-parallel-size", "--sequence-parallel", "--num-experts",
             "--moe-router-topk", "--deterministic-mode", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    first = megatron_fuzz.generate(7, 40, known, "/work")
    assert first == megatron_fuzz.generate(7, 40, known, "/work")
    assert first != megatron_fuzz.generate(8, 40, known, "/work")
    base = set(megatron_fuzz.BASE)
    for sample in first:
        flags = {w for w in sample["argv"] if w.startswith("--")} - base
        assert flags <= set(known), flags - set(known)


def test_a_refusal_counts_as_held_only_when_it_names_the_samples_explicit_flag():
    from megatron_corpus import judge_fuzz

    stock = {"ok": True, "perf_toggles": None, "explicit": {}, "final": {}}
    ok = {"ok": True, "perf_toggles": {"cross_entropy_loss_fusion": {"value": False, "source": "cli"}},
          "explicit": {}, "final": {}}
    refused = {"ok": False, "stage": "parse", "exit_code": 2,
               "error": "SystemExit(2): [perf-toggles] error: --defer-embedding-wgrad-compute needs ..."}
    sample = {"id": "s1", "argv": ["--no-cross-entropy-loss-fusion"], "env": {}}
    payload = {"cases": [sample], "results": [{"id": "s1", "modes": {"A": stock, "B": ok, "C1": refused}}]}
    assert len(judge_fuzz(payload)["failures"]) == 1  # refused for something the sample did not ask
    refused_own = dict(refused, error="SystemExit(2): [perf-toggles] error: --no-cross-entropy-loss-fusion was "
                                      "requested, but ...")
    payload["results"][0]["modes"]["C1"] = refused_own
    assert judge_fuzz(payload)["failures"] == []
