"""Megatron's rules about the toggles: the table is consistent, every rule has its declared answer, and
the recorded versions of each rule match what the real trees (MEGATRON_LM_TREES) carry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import megatron_trees

from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.core.rules import megatron_rules
from megatron_perf_toggles.core.rules.guard_base import rule
from megatron_perf_toggles.core.rules.guards import GUARDS, NEEDS
from megatron_perf_toggles.errors import RegistryError
from megatron_perf_toggles.runtime.machine.capabilities import detect_rules

PLUGIN_DESTS = set(BY_DEST) | {"first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"}


def test_rule_ids_are_unique_and_name_known_toggles():
    ids = [r.id for r in megatron_rules.RULES]
    assert len(ids) == len(set(ids))
    for r in megatron_rules.RULES:
        assert set(r.toggles) <= PLUGIN_DESTS, r.id
        assert r.versions and set(r.versions) <= set(megatron_rules.SUPPORTED), r.id
        assert r.handling.split(":")[0] in ("guard", "dependency", "none needed", "plan"), r.id
        assert r.toggles or r.handling.startswith("plan:"), r.id  # a rule about no toggle is the plan's


def test_every_rule_has_its_declared_answer():
    """A rule handled by a guard is answered by a declared guard, a dependency by a declared Need,
    and a guard or Need answers only rules marked so (the declarations, not the prose, are read)."""
    by_guard = {r.id for g in GUARDS for r in g.answers}
    by_need = {n.rule.id for n in NEEDS}
    kind = {r.id: r.handling.split(":")[0] for r in megatron_rules.RULES}
    assert {i for i, k in kind.items() if k == "guard"} == by_guard
    assert {i for i, k in kind.items() if k == "dependency"} == by_need
    for g in GUARDS:
        assert set(g.moves) <= PLUGIN_DESTS, g.name
        for r in g.answers:
            assert megatron_rules.BY_ID[r.id] is r, (g.name, r.id)


def test_a_rule_is_named_by_its_declaration():
    with pytest.raises(RegistryError, match="no Megatron rule 'no_such_rule'"):
        rule("no_such_rule")


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


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREES, ids=[t.name for t in TREES])
def test_detected_rules_match_the_recorded_versions(tree: Path):
    label = _label(tree)
    expected = {r.id for r in megatron_rules.RULES if r.phrase and label in r.versions}
    assert set(detect_rules(tree) or ()) == expected
