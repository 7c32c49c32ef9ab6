"""The run-time safety net: a plugin default rejected by Megatron's validation is backed off.

Two layers: a fake ``megatron.training.arguments`` module with a rule of our choosing (any
machine, milliseconds), and real trees from MEGATRON_LM_TREES whose copy gets a rule injected
into ``validate_args`` that rejects a plugin default (tests/launcher_cases.py, the injected copy's phase).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import launcher_cases as runs
import pytest

from megatron_perf_toggles.core.facts import Capabilities
from megatron_perf_toggles.runtime import provider, safety_net

TREE_PARAMS = [pytest.param(t, id=runs.tree_id(t)) for t in runs.trees()] or [
    pytest.param(None, id="no-trees")
]
CAPS = Capabilities(apex_fused_wgrad=True, te_version="2.20", te_cross_entropy=True, te_fused_qkv_rope=True)


class FakeMegatron:
    """A module shaped like megatron.training.arguments, with one rule and visible side effects."""

    def __init__(self, rule, side_effects: bool = True) -> None:
        self.module = types.ModuleType("megatron.training.arguments")
        self.module.__file__ = "/nonexistent/megatron/training/arguments.py"
        self.calls = 0

        def validate_args(args, defaults={}):  # noqa: B006 - Megatron's own signature
            self.calls += 1
            if side_effects:
                os.environ[f"PTT_NET_SIDE_EFFECT_{self.calls}"] = "1"
            args.validated = True
            rule(args)
            if side_effects:
                print("megatron chatter")  # like print_arguments: only a validation that passes prints

        self.module.validate_args = validate_args
        self.original = validate_args

    def __enter__(self):
        sys.modules["megatron.training.arguments"] = self.module
        return self

    def __exit__(self, *exc):
        sys.modules.pop("megatron.training.arguments", None)
        safety_net.NET.uninstall()
        for name in [n for n in os.environ if n.startswith("PTT_NET_SIDE_EFFECT_")]:
            del os.environ[name]


def parse(argv, environ=None, controller=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion")
    parser.add_argument("--grad-reduce-in-bf16", action="store_true")
    parser.add_argument("--cross-entropy-loss-fusion", action="store_true")
    parser.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"])
    provider.attach(parser, environ=environ or {}, announce=False, capabilities=CAPS, controller=controller)
    return parser.parse_args(argv)


def reject_bf16_reduce(args):
    assert not args.grad_reduce_in_bf16, "new rule: no bf16 reduction here"


def test_a_rejected_default_is_backed_off_with_megatrons_message(capsys):
    with FakeMegatron(reject_bf16_reduce) as fake:
        args = parse(["--bf16"])
        capsys.readouterr()
        fake.module.validate_args(args, {})
        d = args.perf_toggles["grad_reduce_in_bf16"]
        assert (args.grad_reduce_in_bf16, d["value"], d["source"]) == (False, False, "guard")
        assert safety_net.FOUND_AT_RUN_TIME in d["reason"] and "new rule: no bf16 reduction here" in d["reason"]
        # Other defaults stay as decided: only the rejected one is backed off.
        assert args.perf_toggles["cross_entropy_loss_fusion"]["value"] is True
        assert args.validated is True
        out = capsys.readouterr().out
        # Trials are silent: the chatter appears once, from the final real validation.
        assert out.count("megatron chatter") == 1


def _backed_off_warning(environ):
    """The warning the net adds to the plan when Megatron rejects grad_reduce_in_bf16 on."""
    from megatron_perf_toggles.runtime.controller import Controller

    controller = Controller(environ, mode="plan", capabilities=CAPS)
    with FakeMegatron(reject_bf16_reduce) as fake:
        args = parse(["--bf16"], controller=controller)
        source = args.perf_toggles["grad_reduce_in_bf16"]["source"]
        fake.module.validate_args(args, {})
        assert args.grad_reduce_in_bf16 is False
    (warning,) = [m.text for m in controller.last.plan.messages if safety_net.FOUND_AT_RUN_TIME in m.text]
    return source, warning


def test_a_backed_off_profile_value_is_called_the_profiles(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "megatron-perf-toggles/profile", "schema": 1,
                                "toggles": {"grad_reduce_in_bf16": {"value": True}}}))
    source, warning = _backed_off_warning({"MEGATRON_PERF_TOGGLES_PROFILE": str(path)})
    assert source == "profile"
    assert warning.startswith("Megatron rejected the profile's value of grad_reduce_in_bf16") and "default of" not in \
        warning.split(",")[0]
    source, warning = _backed_off_warning({})
    assert source == "default" and warning.startswith("Megatron rejected the plugin default of grad_reduce_in_bf16")


def test_trials_leave_no_state_behind():
    with FakeMegatron(reject_bf16_reduce) as fake:
        args = parse(["--bf16"])
        fake.module.validate_args(args, {})
        # Trials ran (first + >= 2 trials + final) but only the two real calls left their mark.
        assert fake.calls >= 4
        left = sorted(int(n.rsplit("_", 1)[1]) for n in os.environ if n.startswith("PTT_NET_SIDE_EFFECT_"))
        assert left == [1, fake.calls]


def test_explicit_values_are_never_backed_off():
    for argv, environ in ((["--bf16", "--grad-reduce-in-bf16"], {}), (["--bf16"], {"GRAD_REDUCE_IN_BF16": "1"})):
        with FakeMegatron(reject_bf16_reduce) as fake:
            args = parse(argv, environ)
            with pytest.raises(AssertionError, match="new rule: no bf16 reduction here"):
                fake.module.validate_args(args, {})


def test_stock_rejection_surfaces_megatrons_error_unchanged():
    def always(args):
        raise ValueError("stock says no")

    with FakeMegatron(always) as fake:
        args = parse(["--bf16"])
        with pytest.raises(ValueError, match=r"^stock says no$"):
            fake.module.validate_args(args, {})


def test_success_path_validates_once():
    with FakeMegatron(lambda args: None) as fake:
        fake.module.validate_args(parse(["--bf16"]), {})
        assert fake.calls == 1


def test_a_rule_on_two_defaults_backs_off_both_and_no_more():
    def rule(args):
        assert not (args.grad_reduce_in_bf16 or args.cross_entropy_loss_fusion), "two at once"

    with FakeMegatron(rule) as fake:
        args = parse(["--bf16"])
        fake.module.validate_args(args, {})
        backed = {d for d, r in args.perf_toggles.items() if safety_net.FOUND_AT_RUN_TIME in r["reason"]}
        assert backed == {"grad_reduce_in_bf16", "cross_entropy_loss_fusion"}


def test_uninstall_puts_megatrons_function_back():
    with FakeMegatron(lambda args: None) as fake:
        parse(["--bf16"])
        assert fake.module.validate_args is not fake.original
        safety_net.NET.uninstall()
        assert fake.module.validate_args is fake.original


def test_namespaces_the_plugin_did_not_parse_pass_straight_through():
    with FakeMegatron(reject_bf16_reduce) as fake:
        parse(["--bf16"])
        other = argparse.Namespace(grad_reduce_in_bf16=True)
        with pytest.raises(AssertionError):
            fake.module.validate_args(other, {})
        assert fake.calls == 1


# --- real trees with an injected rule --------------------------------------------------------------


def _decisions(result):
    assert result["error"] is None, result["error"]
    assert result["code"] == 0, result["stderr"][-3000:]
    return json.loads(result["stdout"])["decisions"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_injected_rule_is_backed_off_through_the_launcher_dry_run(tree):
    d = _decisions(runs.results(tree)["net-launcher"])["ddp_average_in_collective"]
    assert (d["value"], d["source"]) == (False, "guard")
    assert runs.INJECTED_RULE in d["reason"] and safety_net.FOUND_AT_RUN_TIME in d["reason"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_injected_rule_is_backed_off_through_the_provider_path(tree):
    r = runs.results(tree)["net-provider"]
    assert r["error"] is None and r["code"] == 0, (r["error"], r["stderr"][-3000:])
    line = next(ln for ln in r["stdout"].splitlines() if ln.startswith("NET-RESULT "))
    found = json.loads(line.split(" ", 1)[1])
    assert found["ddp_average_in_collective"] is False
    assert runs.INJECTED_RULE in found["perf_toggles"]["ddp_average_in_collective"]["reason"]
    # The table was printed at parse time; the net adds the changed line and one warning, once each,
    # and Megatron's own output of the rejected first validation is not shown a second time.
    warnings = [ln for ln in r["stdout"].splitlines() if safety_net.FOUND_AT_RUN_TIME in ln and "warning" in ln]
    assert len(warnings) == 1, r["stdout"]
    assert r["stdout"].count(runs.INJECTED_CHATTER) == 1, r["stdout"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
@pytest.mark.parametrize("case", ["net-env-explicit", "net-cli-explicit"])
def test_injected_rule_against_an_explicit_value_surfaces_megatrons_error(tree, case):
    r = runs.results(tree)[case]
    assert r["code"] != 0 or r["error"] is not None
    assert runs.INJECTED_RULE in (r["error"] or "") + r["stderr"]


@pytest.mark.real_megatron
@pytest.mark.parametrize("tree", TREE_PARAMS)
def test_master_switch_off_is_stock_and_the_net_has_nothing_to_do(tree):
    r = runs.results(tree)["net-stock-off"]
    decisions = _decisions(r)
    assert (decisions["ddp_average_in_collective"]["value"], decisions["ddp_average_in_collective"]["source"]) \
        == (False, "default")
    assert not any(safety_net.FOUND_AT_RUN_TIME in d["reason"] for d in decisions.values())
    assert r["stderr"].count(runs.INJECTED_CHATTER) == 1  # validated once: no trials


def test_output_before_the_failing_rule_is_shown_once(capsys):
    def chatty(args):
        print("using world size: 1")  # Megatron prints before most of its asserts
        reject_bf16_reduce(args)

    with FakeMegatron(chatty) as fake:
        args = parse(["--bf16"])
        capsys.readouterr()
        fake.module.validate_args(args, {})
        assert capsys.readouterr().out.count("using world size: 1") == 1


def test_stock_rejection_still_shows_megatrons_output(capsys):
    def chatty_always(args):
        print("using world size: 1")
        raise ValueError("stock says no")

    with FakeMegatron(chatty_always) as fake:
        args = parse(["--bf16"])
        capsys.readouterr()
        with pytest.raises(ValueError):
            fake.module.validate_args(args, {})
        assert capsys.readouterr().out.count("using world size: 1") == 1


def test_a_back_off_at_transformer_config_redoes_what_validation_derived():
    def derive(args):  # like validate_args: fp32 accumulation follows the bf16 reduction toggle
        args.accumulate_allreduce_grads_in_fp32 = bool(args.bf16 and not args.grad_reduce_in_bf16)

    with FakeMegatron(derive) as fake:
        def config_from_args(args, config_class=None):
            assert not args.grad_reduce_in_bf16, "config-time rule: no bf16 reduction"
            return "config"

        fake.module.core_transformer_config_from_args = config_from_args
        args = parse(["--bf16"])  # the provider wraps both functions as it installs
        fake.module.validate_args(args, {})
        assert args.accumulate_allreduce_grads_in_fp32 is False
        assert fake.module.core_transformer_config_from_args(args) == "config"
        assert args.grad_reduce_in_bf16 is False
        assert args.accumulate_allreduce_grads_in_fp32 is True  # re-derived, not stale
        assert "config-time rule" in args.perf_toggles["grad_reduce_in_bf16"]["reason"]


def test_a_launch_rewrites_its_own_history_line(tmp_path):
    from megatron_perf_toggles.runtime import resume

    first = {"grad_reduce_in_bf16": {"value": True}}
    resume.record_launch(str(tmp_path), first, "bf16", launch_id="a")
    resume.record_launch(str(tmp_path), {"grad_reduce_in_bf16": {"value": False}}, "bf16", launch_id="a")
    resume.record_launch(str(tmp_path), first, "bf16", launch_id="b")
    lines = [json.loads(x) for x in (tmp_path / resume.HISTORY_NAME).read_text().splitlines()]
    assert [(e["launch"], e["decisions"]["grad_reduce_in_bf16"]) for e in lines] == [("a", False), ("b", True)]


def test_a_run_prints_its_table_once_after_validation_with_the_back_off(capsys):
    """The start-up table waits for Megatron's validation, so a run-time back-off shows as the
    final value in the one table, not as "on" followed by a correction."""
    from megatron_perf_toggles.runtime.controller import Controller

    controller = Controller({}, mode="run", capabilities=CAPS)
    with FakeMegatron(reject_bf16_reduce) as fake:
        args = parse(["--bf16"], controller=controller)
        assert "grad_reduce_in_bf16" not in capsys.readouterr().out  # nothing before validation
        fake.module.validate_args(args, {})
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[perf-toggles] grad_reduce_in_bf16:")]
    assert len(lines) == 1 and lines[0].startswith("[perf-toggles] grad_reduce_in_bf16: off (guard;")
    assert out.count("[perf-toggles] cross_entropy_loss_fusion: on") == 1
