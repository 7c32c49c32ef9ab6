"""Each fact is declared in one place, and everything else reads it there: capabilities (the
registry's records), the features that need a toggle (``guards_grads.NEEDS``), Megatron's rules
(``megatron_rules.RULES``) and the guards (their ``@guard`` declarations). A second list anywhere
would drift; these tests fail where one appears or where a declaration is not read."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil

import pytest
from conftest import REPO

from megatron_perf_toggles.core import facts, registry
from megatron_perf_toggles.core.decision.plan import Context
from megatron_perf_toggles.core.env import read_env
from megatron_perf_toggles.core.facts import Capabilities, MegatronFacts, megatron_facts_from_surface, parse_assume
from megatron_perf_toggles.core.memory import memory_guard
from megatron_perf_toggles.core.rules import guard_base, guards
from megatron_perf_toggles.core.rules.megatron_rules import RULES
from megatron_perf_toggles.runtime.machine import capabilities as probing

CORE = REPO / "megatron_perf_toggles" / "core"
EXAMPLE = registry.Capability("te_example_kernel", "import:transformer_engine.pytorch.example:kernel", "te>=2.9",
                              "TE {te_version} has no example kernel")


# --- capabilities -------------------------------------------------------------------------------------


def test_capabilities_has_no_field_of_a_capability_of_its_own() -> None:
    """The registry's records are the only list: Capabilities keeps their values, not their names."""
    names = {f.name for f in dataclasses.fields(Capabilities)}
    assert not names & set(registry.BY_CAPABILITY), names & set(registry.BY_CAPABILITY)


@pytest.mark.parametrize("cap", registry.CAPABILITY_RECORDS, ids=lambda c: c.name)
def test_every_declared_capability_is_answered_recorded_and_assumed(cap: registry.Capability) -> None:
    if not cap.stored:  # a Megatron fact: the Megatron at hand answers it
        field = cap.detected.removeprefix("megatron:")
        assert Capabilities(megatron=MegatronFacts(**{field: True})).value_of(cap.name) is True
        assert getattr(Capabilities(), cap.name) is None  # no Megatron: unknown
        return
    assert getattr(Capabilities(), cap.name) is False and getattr(Capabilities(**{cap.name: True}), cap.name) is True
    assert cap.name in Capabilities(**{cap.name: True}).to_record()
    assert parse_assume("none")[cap.name] is False
    by_name = {"apex": "apex", "gpu": "cuda", "grouped_gemm": "grouped_gemm"}
    entry = by_name.get(cap.assumed) or f"te={'.'.join(map(str, cap.te_minimum or ()))}"
    assert parse_assume(entry)[cap.name] is True


def test_a_capability_declared_in_the_registry_alone_is_answered_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BY_CAPABILITY, EXAMPLE.name, EXAMPLE)
    caps = Capabilities(te_example_kernel=True)
    assert caps.te_example_kernel is True and caps.to_record()["te_example_kernel"] is True
    assert dataclasses.replace(caps, te_version="2.9").te_example_kernel is True
    assert parse_assume("te=2.9")["te_example_kernel"] is True and parse_assume("te=2.8")["te_example_kernel"] is False
    assert parse_assume("none")["te_example_kernel"] is False
    stale = facts.with_assumptions(Capabilities(notes={"te_example_kernel": "old"}), "te=2.9")
    assert "te_example_kernel" not in stale.notes
    detected = probing.detect()  # this machine has no Transformer Engine: missing, and "te" says why
    assert detected.te_example_kernel is False and "te_example_kernel" in detected.to_record()


def test_an_undeclared_capability_is_no_attribute() -> None:
    with pytest.raises(AttributeError):
        _ = Capabilities().warp_drive


# --- the features that need a toggle -------------------------------------------------------------------


def _ctx(caps: Capabilities | None = None, **args: object) -> Context:
    return Context(args=args, values={}, caps=caps or Capabilities(te_version="2.20"), env=read_env({}))


@pytest.mark.parametrize("dest, ctx, needed", [
    # Megatron needs fusion for --defer-embedding-wgrad-compute; for --delay-wgrad-compute only with an
    # old TE or with attention CUDA graphs under --overlap-grad-reduce; its fp32 local accumulation needs
    # bf16 gradients. The memory guard keeps a toggle on exactly there (guards_grads.NEEDS says so).
    ("gradient_accumulation_fusion", _ctx(defer_embedding_wgrad_compute=True), True),
    ("gradient_accumulation_fusion", _ctx(Capabilities(te_version="2.6"), delay_wgrad_compute=True), True),
    ("gradient_accumulation_fusion", _ctx(delay_wgrad_compute=True), False),
    ("gradient_accumulation_fusion", _ctx(delay_wgrad_compute=True, overlap_grad_reduce=True,
                                          cuda_graph_modules=["attn"]), True),
    ("grad_reduce_in_bf16", _ctx(ddp_param_name_patterns_for_fp32_local_accumulation=["x"]), True),
    ("grad_reduce_in_bf16", _ctx(), False),
])
def test_the_memory_guard_keeps_what_a_declared_need_keeps(dest: str, ctx: Context, needed: bool) -> None:
    assert memory_guard._needed(dest, ctx) is needed


def test_the_memory_guard_reads_the_needs_it_has_no_list_of_its_own() -> None:
    assert memory_guard.NEEDS is guards.NEEDS
    lists = [n for n, v in vars(memory_guard).items() if isinstance(v, tuple) and v and all(
        isinstance(x, str) and x.endswith(("_compute", "_accumulation")) for x in v)]
    assert not lists, lists


# --- Megatron's rules -----------------------------------------------------------------------------------


# What MegatronFacts holds besides its rules' facts: which release, where, and which parse entry it has.
NOT_RULES = {"version", "path", "rules", "has_parse_and_validate_args"}


def test_every_megatron_fact_is_a_rules_own() -> None:
    """Each of MegatronFacts' other fields states a rule, and is declared by that rule
    (``MegatronRule.fact``): found by the rule's phrase, never by a check of its own."""
    stated = {f.name for f in dataclasses.fields(MegatronFacts)} - NOT_RULES
    assert stated == {r.fact for r in RULES if r.fact}


def test_read_rules_decide_their_facts() -> None:
    facts = MegatronFacts(rules=("fqr_field",), asserts_te_cross_entropy=True)
    assert facts.fused_single_qkv_rope_field is True and facts.asserts_te_cross_entropy is False
    assert facts.asserts_ddp_average_with_gtp is False


def test_no_guard_reads_a_rule_other_than_through_its_declaration() -> None:
    facts_of_rules = {r.fact for r in RULES if r.fact}
    for path in [*(CORE / "rules").glob("guards*.py"), CORE / "rules" / "guard_base.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                assert node.attr not in facts_of_rules, f"{path.name}:{node.lineno} reads .{node.attr}: use carries(rule)"


def test_a_rules_detection_decides_its_fact_and_a_stated_fact_stands_in_for_unknown_rules() -> None:
    assert MegatronFacts(rules=(), asserts_te_cross_entropy=True).has_rule("ce_te_impl_stability") is False
    assert MegatronFacts(asserts_te_cross_entropy=True).has_rule("ce_te_impl_stability") is True
    assert MegatronFacts().has_rule("ce_te_impl_stability") is False  # its if_unknown
    assert MegatronFacts().has_rule("ddp_average_vs_gtp") is True
    fork = megatron_facts_from_surface({"facts": {"rules": ["ce_te_impl_stability", "ddp_average_vs_gtp"],
                                                  "asserts_te_cross_entropy": False}})
    assert fork.rules == ("ddp_average_vs_gtp",)


def test_the_checkout_reader_finds_a_rule_by_its_phrase_alone(tmp_path) -> None:
    rule = next(r for r in RULES if r.fact)
    for rel in rule.where:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rule.phrase}\n")
    (tmp_path / "megatron" / "training" / "arguments.py").touch()
    assert rule.id in (probing.detect_rules(tmp_path) or ())


# --- the guards -----------------------------------------------------------------------------------------


def test_every_declared_guard_runs_once_and_none_is_listed_by_hand() -> None:
    declared = {}
    for info in pkgutil.walk_packages([str(CORE)], prefix="megatron_perf_toggles.core."):
        module = importlib.import_module(info.name)
        declared.update({id(v): v for v in vars(module).values() if isinstance(v, guard_base.Guard)})
    assert len(guards.GUARDS) == len({id(g) for g in guards.GUARDS})
    assert {id(g) for g in guards.GUARDS} == set(declared), "a guard is declared but does not run"
    source = (CORE / "rules" / "guards.py").read_text()
    assert not [g.name for g in guards.GUARDS if g.name in source], "guards.py names a guard: list none by hand"
