"""Contract tests: the plugin against the recorded argparse surface of every supported Megatron.

The surfaces are facts recorded from real trees by ``python -m megatron_perf_toggles.tools.surfaces.record``
(plus the ROCm fork's recorded delta). Expectations below are derived from those facts, so a new
Megatron release that adds, moves or removes a flag shows up here as a deliberate diff.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_perf_toggles.core.registry import TOGGLES
from megatron_perf_toggles.runtime import provider
from megatron_perf_toggles.tools.surfaces import replay

SURFACES = replay.available()
UPSTREAM_REQUIRED = ["core_v0.13.0", "core_v0.15.0", "core_v0.16.0", "core_v0.17.0", "core_v0.18.2",
                     "core_v0.19.0", "main"]
ASSUME_ALL = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"}
BASE = ["--bf16", "--position-embedding-type", "rope", "--num-layers", "32"]


def test_every_supported_version_is_recorded():
    assert set([*UPSTREAM_REQUIRED, "rocm_fork"]) <= set(SURFACES)


def _by_flag(surface):
    return {f: a for a in surface["actions"] for f in a["flags"]}


def _installed(name, environ=None):
    surface = replay.load_surface(name)
    parser = replay.parser_from_surface(surface)
    provider.attach(parser, environ={**ASSUME_ALL, **(environ or {})}, announce=False)
    return surface, parser


def _group_title_of(parser, flag):
    action = parser._option_string_actions[flag]
    return next(g.title for g in parser._action_groups if action in g._group_actions)


@pytest.mark.parametrize("name", SURFACES)
def test_registration_adds_exactly_the_missing_forms(name):
    surface, parser = _installed(name)
    recorded = _by_flag(surface)
    expected_added = [f for t in TOGGLES for f in t.flags if f not in recorded]
    assert provider.registration(parser).added_flags == expected_added
    for t in TOGGLES:
        for flag in t.flags:
            assert parser._option_string_actions[flag].dest == t.dest, (name, flag)


@pytest.mark.parametrize("name", SURFACES)
def test_added_flags_join_their_neighbours_group(name):
    surface, parser = _installed(name)
    recorded = _by_flag(surface)
    for t in TOGGLES:
        anchor = next((a for a in t.anchors if a in recorded), None)
        for flag in t.flags:
            if flag in recorded:
                continue
            if anchor is not None:
                assert _group_title_of(parser, flag) == recorded[anchor]["group"], (name, flag)
            else:
                assert _group_title_of(parser, flag) in {g.title for g in parser._action_groups}


@pytest.mark.parametrize("name", SURFACES)
def test_defaults_and_version_guards_follow_recorded_facts(name):
    surface, parser = _installed(name)
    facts = replay.surface_facts(surface)
    args = parser.parse_args(BASE)
    assert args.gradient_accumulation_fusion is True
    assert args.grad_reduce_in_bf16 is True and args.ddp_average_in_collective is True
    assert args.cross_entropy_loss_fusion is True
    # Planning with recorded facts: the replayed parser has no Megatron behind it, so the
    # capabilities come from the record (as `explain --megatron-version` does).
    from megatron_perf_toggles.core.decision.decide import decide
    from megatron_perf_toggles.core.env import read_env
    from megatron_perf_toggles.core.facts import megatron_facts_from_surface
    from megatron_perf_toggles.runtime.machine.capabilities import resolve

    caps = resolve("apex,te=2.20")
    caps = dataclasses.replace(caps, megatron=megatron_facts_from_surface(surface))
    plan = decide(vars(args), {}, read_env(ASSUME_ALL), caps)
    impl = plan.decisions["cross_entropy_fusion_impl"]
    assert impl.value == ("native" if facts["asserts_te_cross_entropy"] else "te"), name
    rope = plan.decisions["fused_single_qkv_rope"]
    assert rope.value is bool(facts["fused_single_qkv_rope_field"]), name


@pytest.mark.parametrize("name", SURFACES)
def test_plugin_off_keeps_recorded_stock_defaults(name):
    surface, parser = _installed(name, {"MEGATRON_PERF_TOGGLES": "0"})
    recorded = {a["dest"]: a["default"] for a in surface["actions"]}
    args = parser.parse_args(BASE)
    for t in TOGGLES:
        if t.dest in recorded:
            assert getattr(args, t.dest) == recorded[t.dest], (name, t.dest)


@pytest.mark.parametrize("name", SURFACES)
@pytest.mark.parametrize("t", TOGGLES, ids=lambda t: t.dest)
def test_cli_overrides_both_directions(name, t):
    _, parser = _installed(name, {t.env: "native" if t.kind == "choice" else "0"})
    on = t.flag_for(True if t.kind == "bool" else "te")
    args = parser.parse_args([*BASE, *on])
    assert args.perf_toggles[t.dest]["source"] in ("cli", "guard")
    _, parser = _installed(name)
    off = t.flag_for(False if t.kind == "bool" else "native")
    args = parser.parse_args([*BASE, *off])
    assert getattr(args, t.dest) == (False if t.kind == "bool" else "native")
    assert args.perf_toggles[t.dest]["source"] == "cli"


def test_rocm_fork_delta():
    surface, parser = _installed("rocm_fork")
    recorded = _by_flag(surface)
    assert recorded["--fused-single-qkv-rope"]["dest"] == "fused_single_qkv_rope"
    assert "--fused-single-qkv-rope" not in provider.registration(parser).added_flags
    assert "--no-fused-single-qkv-rope" in provider.registration(parser).added_flags
    assert "mxfp4" in recorded["--fp4-recipe"]["choices"]
    assert recorded["--cross-entropy-fusion-impl"]["default"] == "te"
    assert replay.surface_facts(surface)["asserts_te_cross_entropy"] is False
    args = parser.parse_args([*BASE, "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4", "--no-grad-reduce-in-bf16"])
    assert args.grad_reduce_in_bf16 is True and args.perf_toggles["grad_reduce_in_bf16"]["source"] == "guard"
    assert args.first_last_layers_bf16 is False and args.perf_toggles_precision == "mxfp4"


WITH_FP4 = [n for n in SURFACES if n != "rocm_fork" and "--fp4-recipe" in _by_flag(replay.load_surface(n))]


def test_fp4_recorded_from_core_0_15():
    assert "core_v0.13.0" not in WITH_FP4 and "core_v0.15.0" in WITH_FP4


@pytest.mark.parametrize("name", WITH_FP4)
def test_upstream_rejects_mxfp4_recipe(name):
    _surface, parser = _installed(name)
    with pytest.raises(SystemExit):
        parser.parse_args([*BASE, "--fp4-format", "e2m1", "--fp4-recipe", "mxfp4"])


# --- enum choices: recorded by name, as the command line spells them -------------------------------

@pytest.mark.parametrize("name", SURFACES)
def test_no_placeholder_values_in_recorded_choices(name):
    for action in replay.load_surface(name)["actions"]:
        for value in [*(action["choices"] or []), action["default"]]:
            assert not isinstance(value, dict), (action["dest"], value)


@pytest.mark.parametrize("name", SURFACES)
def test_attention_backend_fused_parses(name):
    # Every ROCm launch script passes --attention-backend fused (or --use-flash-attn).
    _surface, parser = _installed(name)
    args = parser.parse_args([*BASE, "--attention-backend", "fused"])
    assert args.attention_backend == "fused"
    with pytest.raises(SystemExit):
        parser.parse_args([*BASE, "--attention-backend", "fastest"])
