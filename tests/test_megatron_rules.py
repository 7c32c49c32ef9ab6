"""Megatron's rules about the toggles: the table is consistent, the guards name real rules, and
the recorded versions of each rule match what the real trees (MEGATRON_LM_TREES) carry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO, megatron_trees

from megatron_perf_toggles.core import megatron_rules
from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.runtime.capabilities import detect_rules

PLUGIN_DESTS = set(BY_DEST) | {"first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"}


def test_rule_ids_are_unique_and_name_known_toggles():
    ids = [r.id for r in megatron_rules.RULES]
    assert len(ids) == len(set(ids))
    for r in megatron_rules.RULES:
        assert set(r.toggles) <= PLUGIN_DESTS, r.id
        assert r.versions and set(r.versions) <= set(megatron_rules.SUPPORTED), r.id
        assert r.handling.split(":")[0] in ("guard", "dependency", "none needed"), r.id


def test_every_rule_a_guard_consults_is_declared():
    source = (REPO / "megatron_perf_toggles" / "core" / "decide.py").read_text()
    consulted = set(re.findall(r'has_rule\("([a-z0-9_]+)"\)', source))
    consulted |= set(re.findall(r'^\s*\("[a-z_]+", (?:True|False), "([a-z0-9_]+)",', source, re.M))
    assert consulted, "the guards consult no rule: the pattern above no longer matches decide.py"
    missing = consulted - set(megatron_rules.BY_ID)
    assert not missing
    undetectable = {r.id for r in megatron_rules.RULES if not r.phrase}
    assert not consulted & undetectable, "a guard consults a rule no phrase can detect"


def test_unknown_checkout_is_unknown_not_empty(tmp_path: Path):
    assert detect_rules(tmp_path) is None
    assert detect_rules(None) is None


def _label(tree: Path) -> str:
    text = (tree / "megatron" / "core" / "package_info.py").read_text()
    major, minor, patch = (int(re.search(rf"^{k} = (\d+)", text, re.M).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))
    label = f"{major}.{minor}.{patch}"
    if label in megatron_rules.SUPPORTED:
        return label
    same_minor = [v for v in megatron_rules.SUPPORTED if v.startswith(f"{major}.{minor}.")]
    return same_minor[0] if same_minor and patch < 2 else "main"


TREES = megatron_trees()


@pytest.mark.skipif(not TREES, reason="MEGATRON_LM_TREES is not set: rule detection on real trees skipped")
@pytest.mark.parametrize("tree", TREES, ids=[t.name for t in TREES])
def test_detected_rules_match_the_recorded_versions(tree: Path):
    label = _label(tree)
    expected = {r.id for r in megatron_rules.RULES if r.phrase and label in r.versions}
    assert set(detect_rules(tree) or ()) == expected
