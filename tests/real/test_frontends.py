"""The front ends' shared parts without Bridge or Primus: the field mapping, the ``config`` tier of
``decide``, and Megatron's facts for an installed megatron-core without ``megatron.training``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, full_caps

from megatron_perf_toggles.core.config_fields import BRIDGE_OVERRIDES, PRIMUS_HOMES, Home, bridge_homes
from megatron_perf_toggles.core.decision.decide import FP4_LAYER_DESTS, Decision, decide
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import MegatronFacts, megatron_facts_from_surface, surface_release
from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.core.rules.guard_base import rule
from megatron_perf_toggles.core.rules.megatron_rules import RULES, SUPPORTED
from megatron_perf_toggles.frontends import adapter as frontend
from megatron_perf_toggles.frontends.bridge import adapter as bridge  # the adapter behind megatron_perf_toggles.bridge
from megatron_perf_toggles.runtime.machine import probe
from megatron_perf_toggles.tools import cli
from megatron_perf_toggles.tools.surfaces import replay

ROPE = {"position_embedding_type": "rope", "bf16": True}


def test_every_toggle_and_fp4_field_has_a_home_in_each_front_end():
    dests = {t.dest for t in TOGGLES} | set(FP4_LAYER_DESTS)
    assert set(bridge_homes()) == dests == set(PRIMUS_HOMES)
    assert set(BRIDGE_OVERRIDES) <= dests


def test_grad_reduce_lives_in_both_bridge_fields_the_other_way_up():
    homes = bridge_homes()["grad_reduce_in_bf16"]
    assert [h.path for h in homes] == ["mixed_precision.grad_reduce_in_fp32", "ddp.grad_reduce_in_fp32"]
    assert all(h.inverted and h.to_field(True) is False and h.from_field(True) is False for h in homes)
    assert bridge_homes()["fused_single_qkv_rope"] == (Home("model.fused_single_qkv_rope"),)


def config(value, where="cfg.model.x"):
    return Decision(value, "config", f"set in the configuration ({where})")


def test_config_tier_stands_over_the_plugin_default(env):
    plan = decide(ROPE, {}, env(), full_caps(), preset={"ddp_average_in_collective": config(False)})
    assert plan.decisions["ddp_average_in_collective"].value is False
    assert plan.decisions["ddp_average_in_collective"].source == "config"


def test_environment_outranks_the_config_tier(env):
    plan = decide(ROPE, {}, env(DDP_AVERAGE_IN_COLLECTIVE=1), full_caps(),
                  preset={"ddp_average_in_collective": config(False)})
    assert (plan.decisions["ddp_average_in_collective"].value, plan.decisions["ddp_average_in_collective"].source) \
        == (True, "env")


def test_a_guard_changes_a_config_value_with_a_warning(env):
    caps = full_caps(megatron=MegatronFacts(version="0.18.2", asserts_te_cross_entropy=True,
                                            fused_single_qkv_rope_field=True))
    plan = decide(ROPE, {}, env(), caps, preset={"cross_entropy_fusion_impl": config("te"),
                                                 "cross_entropy_loss_fusion": config(True)})
    assert plan.decisions["cross_entropy_fusion_impl"].value == "native"
    assert any("overridden to native" in m.text for m in plan.messages)


@pytest.mark.parametrize("installed, recorded", [("0.18.1", "0.18.0"), ("0.18.2", "0.18.2"), ("0.19.2", "0.19.0")])
def test_facts_for_an_installed_megatron_core(installed, recorded):
    facts = frontend.facts_for_version(installed)
    assert facts.version == installed and facts.path is None
    assert ("ce_te_impl_stability" in facts.rules) == (recorded >= "0.18.2")
    assert facts.asserts_te_cross_entropy is (recorded >= "0.18.2")


def test_facts_older_than_every_recorded_release_are_unknown():
    facts = frontend.facts_for_version("0.9.0")
    assert facts.rules is None and facts.asserts_te_cross_entropy is None


def test_declared_default_calls_a_factory_and_knows_a_missing_one():
    @dataclasses.dataclass
    class Section:
        plain: bool = True
        made: list = dataclasses.field(default_factory=lambda: [1])
        required: int = dataclasses.field(default=0, init=True)

    s = Section()
    assert bridge.declared_default(s, "plain") is True
    assert bridge.declared_default(s, "made") == [1]
    assert bridge.declared_default(s, "absent") is bridge._MISSING
    assert bridge.declared_default(object(), "plain") is bridge._MISSING


@dataclasses.dataclass
class _MegatronConfig:  # declared where Megatron's core declares its config (module set below)
    cross_entropy_loss_fusion: bool = False
    gradient_accumulation_fusion: bool = False


@dataclasses.dataclass
class _FamilyProvider(_MegatronConfig):  # a Bridge model family redeclaring a toggle field
    cross_entropy_loss_fusion: bool = False


_MegatronConfig.__module__ = "megatron.core.transformer.transformer_config"
_FamilyProvider.__module__ = "megatron.bridge.models.family.family_provider"


def test_a_model_providers_own_default_counts_as_set():
    # The provider turns the fusion off for its model, the same value as Megatron's default: the
    # plugin must keep it. A field only Megatron declares stays the plugin's to decide.
    from types import SimpleNamespace

    found = bridge.read(SimpleNamespace(model=_FamilyProvider()))
    assert found.configured["cross_entropy_loss_fusion"][0] is False
    assert "gradient_accumulation_fusion" not in found.configured
    generic = bridge.read(SimpleNamespace(model=_MegatronConfig()))
    assert "cross_entropy_loss_fusion" not in generic.configured


@pytest.mark.parametrize("dataset, packed", [
    ({"enable_offline_packing": True}, True), ({"enable_in_batch_packing": True}, True),  # Bridge 0.6
    ({"enable_offline_packing": False, "enable_in_batch_packing": False}, False),
    ({"packed_sequence_specs": {"packed_sequence_size": 4096}}, True),  # Bridge 0.5 and older
    ({"packed_sequence_specs": {"packed_sequence_size": -1}}, False),  # -1: packing off
])
def test_packed_sequences_are_read_as_the_guards_blocker(dataset, packed):
    from types import SimpleNamespace

    def ns(d):
        return SimpleNamespace(**{k: ns(v) if isinstance(v, dict) else v for k, v in d.items()})

    args, _ = bridge._args(SimpleNamespace(dataset=ns(dataset)))
    assert bool(args.get("sft")) is packed


def test_the_primus_pth_hook_loads_nothing_else():
    # A .pth line runs in every interpreter of the environment: the hook alone, not the decision core.
    import json
    import subprocess
    import sys

    from conftest import REPO

    code = ("import json, sys, megatron_perf_toggles.primus_hook\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('megatron_perf_toggles.'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["megatron_perf_toggles._version", "megatron_perf_toggles.errors",
                                 "megatron_perf_toggles.frontends", "megatron_perf_toggles.frontends.primus",
                                 "megatron_perf_toggles.frontends.primus.hook",
                                 "megatron_perf_toggles.primus_hook"]  # the name the .pth imports, and the hook


def test_primus_explicit_names_a_toggle_or_refuses_in_one_line():
    # As bridge.apply does: a misspelt name would otherwise hold nothing, silently.
    from types import SimpleNamespace

    from megatron_perf_toggles import primus
    from megatron_perf_toggles.errors import PerfTogglesError

    ns = SimpleNamespace(ddp_average_in_collective=False)
    assert primus.read(ns, {}, explicit=["ddp_average_in_collective"]).explicit["ddp_average_in_collective"][0] is False
    with pytest.raises(PerfTogglesError, match="ddp_average_in_colective") as error:
        primus.read(ns, {}, explicit=["ddp_average_in_colective"])
    assert "\n" not in str(error.value)


def test_primus_defaults_without_primus_is_one_line():
    import importlib.util

    from megatron_perf_toggles import primus
    from megatron_perf_toggles.errors import PerfTogglesError

    if importlib.util.find_spec("primus") is not None:
        pytest.skip("Primus is importable here: its absence cannot be shown")
    with pytest.raises(PerfTogglesError, match="Primus is not importable") as error:
        primus.primus_defaults()
    assert "\n" not in str(error.value)


# --- recorded surfaces cannot drift from the rules table -------------------------------------------

SURFACES = replay.available()


@pytest.mark.parametrize("name", SURFACES)
def test_every_rule_the_table_records_for_a_release_binds_its_recorded_surface(name):
    # explain --megatron-version and Bridge on a megatron-core wheel read Megatron's rules from a
    # recorded surface: a rule the table says the release carries must bind there, whether or not
    # the recorder could detect it by its phrase, or its guard would never fire.
    surface = replay.load_surface(name)
    facts = megatron_facts_from_surface(surface)
    release = surface_release(surface)
    assert release in SUPPORTED, f"{name}: the rules table knows no release {release!r}"
    # (a fork's record that states it lacks a rule, through the rule's declared fact, decides that rule)
    stated = surface.get("facts", {})
    # (a commit between releases, one a framework pins: its tree's phrases decide; the table adds the rest)
    pinned = bool(surface.get("commit"))
    missing = [r.id for r in RULES if release in r.versions and not facts.has_rule(r.id)
               and not (r.fact and stated.get(r.fact) is False) and not (pinned and r.phrase)]
    assert not missing, f"{name} lacks {missing}"
    # and what a guard answers, it does there: packed sequences turn fused single-QKV RoPE off
    if release in rule("fqr_packed_sequences").versions:
        plan = decide({"sft": True, "position_embedding_type": "rope", "bf16": True}, {}, read_env({}),
                      full_caps(megatron=facts))
        assert (plan.decisions["fused_single_qkv_rope"].value, plan.decisions["fused_single_qkv_rope"].source) \
            == (False, "guard")


PINNED_TREES = "MEGATRON_PINNED_TREES"


def _pinned_tree(name: str) -> Path | None:
    """A checkout of a pinned commit: a folder named as its surface in MEGATRON_PINNED_TREES (':'-separated;
    kept apart from MEGATRON_LM_TREES, whose every tree each real suite runs on) or MEGATRON_LM_TREES."""
    raw = os.pathsep.join(os.environ.get(v, "") for v in (PINNED_TREES, "MEGATRON_LM_TREES"))
    return next((Path(p) for p in raw.split(os.pathsep) if p.strip() and Path(p).name == name), None)


@pytest.mark.parametrize("name", sorted(replay.commits().values()))
def test_a_pinned_commits_surface_is_what_its_tree_records(name, tmp_path):
    surface = replay.load_surface(name)
    tree = _pinned_tree(name)
    if tree is None:
        pytest.skip(f"no checkout of Megatron-LM {surface['commit'][:8]} given: export one with `git -C MEGATRON_GIT "
                    f"archive {surface['commit'][:8]} | tar x -C DIR/{name}` and set {PINNED_TREES}=DIR/{name}")
    out = tmp_path / "surface.json"
    proc = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "surface", str(tree), "--commit",
                           surface["commit"], "--release", surface["release"], "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    fresh = json.loads(out.read_text())
    assert fresh["actions"] == surface["actions"] and fresh["facts"] == surface["facts"]
    assert (fresh["name"], fresh["commit"]) == (name, surface["commit"])


def test_bridge_on_a_megatron_core_wheel_gets_the_tables_rules():
    facts = frontend.facts_for_version("0.19.2")  # PyPI's megatron-core: the 0.19.0 surface's facts
    assert facts.version == "0.19.2"
    assert all(facts.has_rule(r.id) for r in RULES if "0.19.0" in r.versions)


# --- explain --bridge-recipe / --primus-config: a bad input is one line, exit 2, before any import ----


def _checkout_without_megatron(root):
    (root / "primus" / "core" / "patches").mkdir(parents=True)
    (root / "exp.yaml").write_text("modules: {}\n")
    return str(root / "exp.yaml")


@pytest.mark.parametrize("argv, says", [
    (["--bridge-recipe", "nonsense"], "name it MODULE:FUNCTION"),
    (["--bridge-recipe", "no_such_bridge.recipes:x"], "no_such_bridge.recipes is not importable here"),
    (["--primus-config", "/no/such/file.yaml"], "no such file"),
    (["--bridge-recipe", "a.b:c", "--", "not-a-keyword"], "KEY=VALUE"),
])
def test_explain_front_end_bad_input_is_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["explain", *argv])
    assert done.value.code == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and says in said[0], said


def test_explain_primus_config_without_a_megatron_is_one_line(tmp_path, capsys, monkeypatch):
    """No Megatron-LM here: Primus builds on a recorded surface's parser (tests/real/test_bare_venv.py
    plans a real experiment so); a checkout that lacks Primus's Megatron backend is then one line."""
    monkeypatch.setattr(probe, "installed", lambda name: False)  # no Megatron importable here either
    with pytest.raises(SystemExit) as done:
        cli.main(["explain", "--primus-config", _checkout_without_megatron(tmp_path)])
    said = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(said) == 1 and "No module named 'primus.backends'" in said[0], said
