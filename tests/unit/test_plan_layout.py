"""Every plan shows the parallel layout it is for: TP, PP, CP, EP and DP, in the text and the JSON.

A Bridge recipe's layout was learnt only from an error; a command line's had to be read back from
the flags. ``core.layout.parallel`` says it once for explain (every front end) and the dry run.
"""

from __future__ import annotations

import json

import pytest

from megatron_perf_toggles.core import layout
from megatron_perf_toggles.tools import cli

pytestmark = pytest.mark.usefixtures("clean_environment")


@pytest.mark.parametrize(("world", "args", "words"), [
    (8, {}, "TP 1, PP 1, CP 1, EP 1, DP 8 (world 8)"),
    (64, {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4, "sequence_parallel": True},
     "TP 8, PP 4, CP 1, EP 1, DP 2 (world 64), sequence parallel"),
    (64, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
          "virtual_pipeline_model_parallel_size": 2, "context_parallel_size": 2},
     "TP 2, PP 4, VPP 2, CP 2, EP 1, DP 4 (world 64)"),
    (32, {"tensor_model_parallel_size": 4, "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1},
     "TP 4, PP 1, CP 1, EP 8, ETP 1, DP 8 (world 32)"),
    (6, {"tensor_model_parallel_size": 4}, "TP 4, PP 1, CP 1, EP 1, DP - (world 6)"),  # a world it does not divide
    (8, {"sequence_parallel": True}, "TP 1, PP 1, CP 1, EP 1, DP 8 (world 8)"),  # no TP: nothing to split
])
def test_the_layout_in_one_line(world, args, words):
    assert layout.words(layout.parallel(world, args)) == words


def _explain(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["explain", *argv])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("verbose", [[], ["--verbose"]])
def test_explain_shows_a_command_lines_layout(capsys, verbose):
    argv = ["--world-size", "64", "--gpu", "h100", *verbose, "--", "--num-layers", "8", "--hidden-size", "1024",
            "--num-attention-heads", "16", "--seq-length", "1024", "--max-position-embeddings", "1024",
            "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"]
    code, out = _explain(capsys, *argv)
    assert code == 0
    assert "Layout:   TP 4, PP 2, CP 1, EP 1, DP 8 (world 64)" in out.splitlines()
    code, out = _explain(capsys, "--json", *argv)
    shown = json.loads(out)["layout"]
    assert (shown["tp"], shown["pp"], shown["cp"], shown["ep"], shown["dp"], shown["world"]) == (4, 2, 1, 1, 8, 64)
