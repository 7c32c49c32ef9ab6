"""Never worse than stock Megatron, on command lines nobody here wrote.

Every functional-test config of every tree in MEGATRON_LM_TREES that pretrain_gpt.py runs (see
tests/megatron_corpus.py for which ones and how they become argv) goes through Megatron's real
parse_args + validate_args + core_transformer_config_from_args on CPU:

- A: stock Megatron, no provider;
- B: the plugin with MEGATRON_PERF_TOGGLES=0; its namespace must equal A's apart from what the
  plugin documents (corpus_cases.ALLOWED_B_DIFFERENCES);
- C1: plugin defaults, MEGATRON_PERF_TOGGLES_ASSUME=apex,te=<TE>,cuda; C2: ...ASSUME=none.

Whatever A accepts, B, C1 and C2 accept; a toggle flag in the config keeps its value, with source
cli. Configs stock Megatron rejects are counted separately, grouped by reason. The per-tree
summary is printed into the pytest output (``-rs`` shows it with the skips).

The expected outcome comes from stock Megatron itself (mode A), never from the plugin.
"""

from __future__ import annotations

import pytest

pytest.importorskip("yaml", reason="reading Megatron's functional-test configs needs pyyaml, which the megatron-cpu extra installs")
import megatron_corpus as corpus
from conftest import megatron_trees

TREES = megatron_trees()
needs_trees = pytest.mark.real_megatron


def _failure_text(tree: str, failures: list[tuple[str, str, str]]) -> str:
    lines = [f"{len(failures)} corpus failure(s) on {corpus.tree_id(tree)} (config, mode, error):"]
    lines += [f"  {cid} [{mode}]: {text}" for cid, mode, text in failures[:60]]
    if len(failures) > 60:
        lines.append(f"  ... and {len(failures) - 60} more")
    return "\n".join(lines)


@needs_trees
@pytest.mark.parametrize("tree", [str(t) for t in TREES] or ["no-trees"], ids=lambda t: corpus.tree_id(t))
def test_corpus_stock_accepted_holds_with_plugin(tree: str, capsys: pytest.CaptureFixture[str]) -> None:
    payload = corpus.CORPUS.get(tree)
    stats = corpus.judge(payload)
    with capsys.disabled():
        print("\n[corpus] " + "\n[corpus] ".join(corpus.summary_lines(tree, payload, stats)))
    assert stats["run"] > 0, f"no pretrain_gpt.py functional-test config found under {tree}"
    assert stats["accepted"] > 0, "stock Megatron accepted no config: the harness, not the plugin, is broken"
    assert not stats["failures"], _failure_text(tree, stats["failures"])


def test_ci_words_follow_megatron_ci() -> None:
    """true -> bare flag, "" -> dropped, false/null -> passed on as words, [a b] -> split, spaces -> one word."""
    words = corpus.ci_words({"--a": True, "--b": "", "--c": False, "--d": None, "--e": "[2 2]", "--f": "2 2",
                             "--g": "3e-4", "--h": [1, 2]})
    assert words == ["--a", "--c", "false", "--d", "null", "--e", "2", "2", "--f", "2 2", "--g", "3e-4", "--h", "1", "2"]


def test_command_line_replaces_data_and_sets_world_size(tmp_path) -> None:
    argv, env, dirs = corpus.command_line(
        {"--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "4", "--expert-model-parallel-size": "16",
         "--expert-tensor-parallel-size": "1", "--data-path": "${DATA_PATH}/x ${DATA_PATH}/y", "--save": "${CHECKPOINT_SAVE_PATH}",
         "--vocab-file": "${DATA_PATH}/vocab.json", "--tokenizer-type": "GPT2BPETokenizer", "--seed": "${REPEAT}",
         "--fim-data": True, "--fim-rate": "0.5"},
        {"NCCL_ALGO": "Ring"}, tmp_path)
    assert "--data-path" not in argv and "--vocab-file" not in argv and "--fim-data" not in argv
    assert argv[-len(corpus.MOCK_DATA):] == corpus.MOCK_DATA
    assert argv[argv.index("--save") + 1] in dirs and argv[argv.index("--seed") + 1] == "1"
    assert env["NCCL_ALGO"] == "Ring"
    assert int(env["WORLD_SIZE"]) == 64  # lcm(8, tp2*pp4 = 8, etp1*ep16*pp4 = 64)
