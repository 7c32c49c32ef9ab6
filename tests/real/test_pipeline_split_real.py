"""The memory model's pipeline split against Megatron's own: for each command line, every tree in
MEGATRON_LM_TREES parses, validates and builds its TransformerConfig (stock, on CPU), and its
``get_num_layers_to_build`` / ``get_transformer_layer_offset`` say which layers each pipeline rank
builds (tests/support/pp_split_cases.py). The plugin's pure ``pipeline_split.rank_layers``, reading the
namespace as parsed, must name the same layers on every rank; where Megatron refuses the command
line, the plugin must not price a split either (it says unknown).

The expected answer is Megatron's, never the plugin's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tree_driver
from conftest import megatron_trees

TREES = megatron_trees()
pytestmark = pytest.mark.real_megatron


def _layers(n: int, pp: int, *extra: str) -> list[str]:
    return ["--num-layers", str(n), "--pipeline-model-parallel-size", str(pp), *extra]


# id -> (world size, argv on top of parse_cases.COMMON)
CASES: dict[str, tuple[int, list[str]]] = {
    "even": (4, _layers(8, 4)),
    "first_last": (4, _layers(12, 4, "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2")),
    "first_only": (4, _layers(10, 4, "--decoder-first-pipeline-num-layers", "1")),
    "last_only": (3, _layers(10, 3, "--decoder-last-pipeline-num-layers", "2")),
    "first_last_vp2": (4, _layers(12, 4, "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers",
                                  "2", "--num-virtual-stages-per-pipeline-rank", "2")),
    "account_both": (4, _layers(6, 4, "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")),
    "account_embedding_vp2": (4, _layers(7, 4, "--account-for-embedding-in-pipeline-split",
                                         "--num-virtual-stages-per-pipeline-rank", "2")),
    "account_both_vp2": (4, _layers(6, 4, "--account-for-embedding-in-pipeline-split",
                                    "--account-for-loss-in-pipeline-split", "--num-virtual-stages-per-pipeline-rank", "2")),
    "even_layers_per_virtual_stage": (4, _layers(8, 4, "--num-layers-per-virtual-pipeline-stage", "1")),
    "layout": (4, _layers(12, 4, "--pipeline-model-parallel-layout", "Et|t*5|t*5|tL")),
    "layout_groups": (4, _layers(7, 4, "--pipeline-model-parallel-layout", "Et*2|(tt|)*2,tL")),
    "layout_vp2": (4, _layers(12, 4, "--pipeline-model-parallel-layout", "Et|tt|tt|t|t|tt|tt|tL")),
    "layout_embedding_alone": (4, _layers(8, 4, "--pipeline-model-parallel-layout", "E|t*3|t*3|t*2,L")),
    # Megatron refuses these: the plugin must not price them
    "refused_middle_uneven": (4, _layers(12, 4, "--decoder-first-pipeline-num-layers", "3",
                                         "--decoder-last-pipeline-num-layers", "2")),
    "refused_not_divisible": (4, _layers(10, 4)),
    "refused_layout_count": (4, _layers(10, 4, "--pipeline-model-parallel-layout", "Et|t*5|t*5|tL")),
    "refused_first_with_account": (4, _layers(11, 4, "--decoder-first-pipeline-num-layers", "2",
                                              "--account-for-embedding-in-pipeline-split")),
}


def _build(tree: str, work: Path) -> list[dict]:
    cases = [{"kind": "pp_split", "name": f"pp_split:{cid}", "id": cid, "world": world, "argv": argv}
             for cid, (world, argv) in CASES.items()]
    return [{"tree": tree, "cases": cases}]


SUITE = tree_driver.SESSION.suite("pp_split", _build)


@pytest.fixture(params=TREES, ids=lambda p: p.name)
def results(request) -> dict[str, dict]:
    by_name = tree_driver.SESSION.results(SUITE, str(request.param))
    return {name.removeprefix("pp_split:"): result for name, result in by_name.items()}


@pytest.mark.parametrize("cid", [c for c in CASES if not c.startswith("refused_")])
def test_each_rank_builds_the_layers_the_memory_model_prices(results, cid):
    result = results[cid]
    assert "error" not in result, result
    assert "megatron_refused" not in result, result["megatron_refused"]
    assert "plugin_unknown" not in result, result["plugin_unknown"]
    assert result["plugin"] == result["megatron"], result


@pytest.mark.parametrize("cid", [c for c in CASES if c.startswith("refused_")])
def test_what_megatron_refuses_the_memory_model_does_not_price(results, cid):
    result = results[cid]
    assert "error" not in result, result
    assert "megatron_refused" in result, f"Megatron built {result.get('megatron')}: the case is not a refusal"
    assert "plugin_unknown" in result and "plugin" not in result, result
