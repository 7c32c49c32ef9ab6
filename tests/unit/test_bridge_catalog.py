"""explain --bridge-recipe without Megatron-Bridge: the recorded catalog plans it, every mistake one line.

The catalog in the package (megatron_perf_toggles/data/bridge_recipes/) is recorded from the real
Bridge by frontends/bridge/catalog.py; tests/real/test_bridge_recorded_catalog.py records it again and compares,
and compares these plans with the real Bridge's. Here: the plans it gives where Bridge is absent.
"""

from __future__ import annotations

import json

import pytest
from conftest import explain_in_process

from megatron_perf_toggles.frontends.bridge import catalog as bridge_catalog
from megatron_perf_toggles.runtime.machine.probe import installed

LLAMA = "megatron.bridge.recipes.llama:llama3_8b_pretrain_config"
GPT175 = "megatron.bridge.recipes.gpt.gpt3_175b:gpt3_175b_pretrain_config"
pytestmark = [pytest.mark.skipif(installed("megatron.bridge"), reason="Megatron-Bridge is installed here: explain "
                                 "uses it, not the catalog (tests/real/test_bridge_recorded_catalog.py compares both)"),
              pytest.mark.usefixtures("clean_environment")]




def _one_line(code: int, err: str) -> str:
    said = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(said) == 1, err
    return said[0]


def test_the_catalog_is_a_recorded_bridge_with_its_core():
    catalog = bridge_catalog.load()
    assert catalog["bridge"] in bridge_catalog.versions() and catalog["megatron_core"]
    assert bridge_catalog.key(LLAMA) in catalog["aliases"]  # the package's re-export names a recorded recipe


def test_llama3_8b_plans_from_the_catalog(capsys):
    code, out, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--world-size", "64", "--gpu", "h100", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["target"]["world_size"] == 64 and "as recorded" in record["megatron"]
    decisions = record["decisions"]
    # What the recipe itself set stands as the recipe's (config), in Bridge's words.
    assert decisions["grad_reduce_in_bf16"]["source"] == "config"
    assert "cfg.mixed_precision.grad_reduce_in_fp32" in decisions["grad_reduce_in_bf16"]["reason"]
    assert decisions["gradient_accumulation_fusion"]["value"] is True  # the H100's stack: the torch fallback
    assert record["memory"]["stock_peak_mb"] > 0  # the recipe's shape is known: a memory plan


def test_the_175b_recipe_is_refused_on_eight_gpus_and_plans_on_32(capsys):
    line = _one_line(*explain_in_process(capsys, "--bridge-recipe", GPT175, "--world-size", "8", "--gpu", "h100")[::2])
    assert "world size 8 is not divisible by TP x PP x CP = 32" in line
    code, out, err = explain_in_process(capsys, "--bridge-recipe", GPT175, "--world-size", "32", "--gpu", "h100", "--json")
    assert code == 0, err
    assert json.loads(out)["decisions"]["gradient_accumulation_fusion"]["value"] is True  # deferral keeps it on


def test_a_recipe_that_needs_a_hugging_face_config_says_which_and_how(capsys):
    catalog = bridge_catalog.load()
    name, entry = next((k, v) for k, v in sorted(catalog["recipes"].items()) if "needs" in v)
    line = _one_line(*explain_in_process(capsys, "--bridge-recipe", name, "--world-size", "8")[::2])
    assert f"Hugging Face config of {entry['needs']}" in line and "HF_HOME" in line


def test_a_recipe_one_letter_off_gets_the_recipe_it_meant(capsys):
    """One letter off used to suggest the canonical module's 2-GPU recipe; the re-exported names
    count too, and the nearest function name wins."""
    line = _one_line(*explain_in_process(capsys, "--bridge-recipe", "megatron.bridge.recipes.llama:llama3_8b_pretrain_confg")[::2])
    assert "did you mean 'megatron.bridge.recipes.llama:llama3_8b_pretrain_config'?" in line


@pytest.mark.parametrize(("asked", "meant"), [
    ("m.llama:llama3_8b_pretrain_confg", "m.llama:llama3_8b_pretrain_config"),  # the function name first
    ("m.llama.llama3:llama3_8b_pretrain_confg", "m.llama.llama3:llama3_8b_pretrain_config"),  # then the whole name
    ("m.lama:llama3_8b_pretrain_2gpu_h100_bf16_config", "m.llama.h100.llama3:llama3_8b_pretrain_2gpu_h100_bf16_config"),
    ("m.llama:qwen3_8b_sft_config", None),  # nothing near: no guess
])
def test_the_nearest_function_name_wins(asked, meant):
    from megatron_perf_toggles.frontends.bridge.recipe import nearest

    known = ["m.llama.h100.llama3:llama3_8b_pretrain_2gpu_h100_bf16_config", "m.llama.llama3:llama3_8b_pretrain_config",
             "m.llama:llama3_8b_pretrain_config", "m:llama3_8b_pretrain_config", "m.llama:llama3_70b_pretrain_config"]
    assert nearest(asked, known) == meant


@pytest.mark.parametrize("verbose", [[], ["--verbose"]])
def test_the_plan_shows_the_recipes_layout(capsys, verbose):
    """TP, PP, CP, EP and DP were never shown: a user learnt the recipe's layout only from an error."""
    args = bridge_catalog.found(LLAMA, bridge_catalog.load()).args
    tp, pp, cp = (args[d] for d in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                    "context_parallel_size"))
    code, out, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--world-size", "64", "--gpu", "h100", *verbose)
    assert code == 0, err
    layout_line = next(line for line in out.splitlines() if line.startswith("Layout:"))
    assert f"TP {tp}, PP {pp}, CP {cp}, EP 1, DP {64 // (tp * pp * cp)} (world 64)" in layout_line
    code, out, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--world-size", "64", "--gpu", "h100", "--json", *verbose)
    shown = json.loads(out)["layout"]
    assert (shown["tp"], shown["pp"], shown["cp"], shown["dp"], shown["world"]) == (tp, pp, cp, 64 // (tp * pp * cp), 64)


@pytest.mark.parametrize(("argv", "words"), [
    (["--bridge-recipe", LLAMA, "--", "seq_length=4096"], "keyword arguments"),
])
def test_mistakes_without_bridge_are_one_line(capsys, argv, words):
    assert words in _one_line(*explain_in_process(capsys, *argv, )[::2])


def test_off_means_stock_from_the_catalog_too(capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES", "0")
    code, out, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--world-size", "64", "--gpu", "h100", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert all(mb in (0, None) for mb in record["memory"]["peak_memory_delta_mb"].values()), record["memory"]
    assert all(d["source"] in ("default", "config") for d in record["decisions"].values())


# The catalog is already imported in this process (a command starts without it): runpy says so.
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
def test_the_documented_recorder_command_is_the_catalogs(capsys, monkeypatch):
    """``python -m megatron_perf_toggles.frontends.bridge_catalog`` (docs/bridge.md) runs the
    recorder in frontends/bridge/catalog.py, and the old import name is that module."""
    import runpy
    import sys

    from megatron_perf_toggles.frontends import bridge_catalog as by_old_name

    assert by_old_name is bridge_catalog
    monkeypatch.delitem(sys.modules, "megatron_perf_toggles.frontends.bridge_catalog")  # as ``python -m`` finds it
    monkeypatch.setattr(sys, "argv", ["bridge_catalog", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("megatron_perf_toggles.frontends.bridge_catalog", run_name="__main__", alter_sys=True)
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m megatron_perf_toggles.frontends.bridge_catalog")


@pytest.mark.parametrize("version", bridge_catalog.versions())
def test_each_shipped_catalog_is_well_formed_and_plans_offline(capsys, version):
    catalog = bridge_catalog.load(version)
    assert catalog["bridge"] == version and catalog["megatron_core"]
    recipes = catalog["recipes"]
    assert set(catalog["aliases"].values()) <= set(recipes)
    built = [name for name, one in recipes.items() if "needs" not in one and "why" not in one]
    assert built and all(bridge_catalog.found(name, catalog).args for name in built)
    name = bridge_catalog.key(LLAMA)
    assert catalog["aliases"].get(name, name) in built  # the recipe the issue plans, in every version
    code, out, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--bridge-version", version, "--world-size", "64",
                              "--gpu", "h100", "--json")
    assert code == 0, err
    record = json.loads(out)
    assert f"Megatron-Bridge {version} as recorded (as --bridge-version asks" in record["megatron"]
    assert record["memory"]["stock_peak_mb"] > 0 and record["target"]["world_size"] == 64


def test_the_catalog_of_the_installed_bridge_serves_else_the_newest(monkeypatch):
    from importlib import metadata

    known = bridge_catalog.versions()
    installed: dict[str, str] = {}

    def version(dist: str) -> str:
        if dist in installed:
            return installed[dist]
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", version)
    assert bridge_catalog.chosen()[0]["bridge"] == known[-1]
    installed["megatron-bridge"] = known[0]
    catalog, why = bridge_catalog.chosen()
    assert catalog["bridge"] == known[0] and "installed" in why
    installed["megatron-bridge"] = "0.0.1"
    catalog, why = bridge_catalog.chosen()
    assert catalog["bridge"] == known[-1] and "0.0.1 has none" in why


def test_a_catalog_not_recorded_is_one_line(capsys):
    line = _one_line(*explain_in_process(capsys, "--bridge-recipe", LLAMA, "--bridge-version", "0.0.1")[::2])
    assert "no recorded catalog for Megatron-Bridge 0.0.1" in line and ", ".join(bridge_catalog.versions()) in line


def test_the_catalog_plans_with_the_empty_te_meta_package_installed(capsys, monkeypatch, tmp_path):
    """The plan is for the target's stack: a laptop's ``pip install transformer-engine`` (a package
    whose import raises) changes nothing of it."""
    import importlib

    import broken_te

    code, plain, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--world-size", "64", "--gpu", "h100", "--json")
    assert code == 0, err
    monkeypatch.syspath_prepend(str(broken_te.meta_package(tmp_path)))
    importlib.invalidate_caches()
    code, beside, err = explain_in_process(capsys, "--bridge-recipe", LLAMA, "--world-size", "64", "--gpu", "h100", "--json")
    assert code == 0, err
    assert json.loads(beside)["decisions"] == json.loads(plain)["decisions"]
