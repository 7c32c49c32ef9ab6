"""``tune``: the decision rule on synthetic results, which arms it plans, and the command end to end
with a stand-in Megatron: the profile it writes, resume after an interruption, the budget, bad input."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import types

import pytest
from conftest import REPO, full_caps

from megatron_perf_toggles.core.profile import Choice, Evidence
from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.runtime import profile_file, provider
from megatron_perf_toggles.runtime.controller import Controller
from megatron_perf_toggles.tools.ablate import analysis, execution, stats
from megatron_perf_toggles.tools.ablate import runs as ablate_runs
from megatron_perf_toggles.tools.ablate.design import Arm
from megatron_perf_toggles.tools.ablate.spec import ExperimentSpec, launch_world_size
from megatron_perf_toggles.tools.surfaces import replay
from megatron_perf_toggles.tools.tune import command as tune
from megatron_perf_toggles.tools.tune import evidence as tune_evidence
from megatron_perf_toggles.tools.tune import phases, rule

FAKE = f"{sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"
THREE = "grad_reduce_in_bf16,ddp_average_in_collective,cross_entropy_loss_fusion"


# --- the decision rule ------------------------------------------------------------------------------


def row(arm, verdict=None, low=None, baseline=False):
    out = {"arm": arm, "baseline": baseline}
    if verdict is not None:
        out["speedup"] = {"verdict": verdict, "low": low, "estimate": low, "high": low}
    return out


def test_leave_one_out_keeps_what_removal_slows_and_drops_what_removal_speeds_up():
    rows = [row("all-on", baseline=True), row("without:a", stats.SLOWER), row("without:b", stats.FASTER),
            row("without:c", stats.NO_DIFFERENCE), row("without:d", stats.TOO_FEW)]
    decided, unresolved = rule.decide_leave_one_out(rule.leave_one_out_verdicts(rows))
    assert {d: x.value for d, x in decided.items()} == {"a": True, "b": False}
    assert unresolved == ["c", "d"]
    assert (decided["a"].chosen, decided["a"].against) == ("all-on", "without:a")
    assert (decided["b"].chosen, decided["b"].against) == ("without:b", "all-on")


def test_the_factorial_varies_the_unresolved_and_pins_the_resolved():
    decided, unresolved = rule.decide_leave_one_out({"grad_reduce_in_bf16": stats.FASTER,
                                                     "ddp_average_in_collective": stats.NO_DIFFERENCE,
                                                     "fused_single_qkv_rope": stats.NO_DIFFERENCE})
    arms = rule.factorial_arms(unresolved, decided)
    assert len(arms) == 2 ** len(unresolved)
    assert {tuple(sorted(a.toggles.items())) for a in arms} == {
        (("ddp_average_in_collective", x), ("fused_single_qkv_rope", y)) for x in (False, True) for y in (False, True)}
    (base,) = [a for a in arms if a.baseline]
    assert all(base.toggles.values())  # compared with the defaults it would otherwise keep
    for arm in arms:
        assert arm.env[BY_DEST["grad_reduce_in_bf16"].env] == "0"  # resolved: pinned to its value


def test_the_factorial_confidence_is_corrected_for_its_comparisons():
    assert rule.family_confidence(0.95, 8) == pytest.approx(1 - 0.05 / 7)
    assert rule.family_confidence(0.95, 2) == pytest.approx(0.95)
    assert stats.t_quantile(1 - (1 - rule.family_confidence(0.95, 8)) / 2, 2) > stats.t_quantile(0.975, 2)


def test_a_combination_wins_only_when_detectably_faster():
    arms = rule.factorial_arms(["grad_reduce_in_bf16", "ddp_average_in_collective"], {})
    names = [a.name for a in arms]
    rows = [row(n, stats.NO_DIFFERENCE, 1.0, baseline=a.baseline) for n, a in zip(names, arms, strict=True)]
    assert rule.pick_combination(rows, arms).baseline
    off_ddp = next(i for i, a in enumerate(arms) if a.toggles == {"grad_reduce_in_bf16": True,
                                                                   "ddp_average_in_collective": False})
    all_off = next(i for i, a in enumerate(arms) if not any(a.toggles.values()))
    rows[off_ddp] = row(names[off_ddp], stats.FASTER, 1.02)
    rows[all_off] = row(names[all_off], stats.FASTER, 1.01)
    chosen = rule.pick_combination(rows, arms)
    assert chosen is arms[off_ddp]  # the higher lower bound
    decided = rule.decide_factorial(["grad_reduce_in_bf16", "ddp_average_in_collective"], arms, chosen)
    assert decided["ddp_average_in_collective"].value is False and decided["grad_reduce_in_bf16"].value is True
    against = next(a for a in arms if a.name == decided["ddp_average_in_collective"].against)
    assert against.toggles == {"grad_reduce_in_bf16": True, "ddp_average_in_collective": True}


def _run(arm, block, ms, loss):
    return {"arm": arm, "block": block, "status": "done", "summary": {"ms_per_iter": {"median": ms}},
            "iterations": [{"iteration": 5, "lm_loss": loss}]}


def test_turning_a_toggle_off_in_leave_one_out_is_corrected_for_the_toggles_compared():
    logs = [0.02, 0.025, 0.015]  # faster at 95 % over 3 blocks, not at 99 %
    runs = [_run("all-on", b, 1000.0, 2.0) for b in range(3)]
    runs += [_run(f"without:{d}", b, 1000.0 / math.exp(x), 2.0) for d in "abcde" for b, x in enumerate(logs)]
    first = {"blocks_run": 3, "runs": runs, "confidence": 0.95}
    raw = {"a": stats.FASTER, "b": stats.SLOWER, "c": stats.NO_DIFFERENCE, "d": stats.NO_DIFFERENCE,
           "e": stats.NO_DIFFERENCE}
    verdicts, confidence = rule.correct_turn_offs(first, "all-on", raw, 0.95)
    assert confidence == pytest.approx(1 - 0.05 / 5)
    assert verdicts["a"] == stats.NO_DIFFERENCE and verdicts["b"] == stats.SLOWER  # "keep on" is not corrected
    decided, unresolved = rule.decide_leave_one_out(verdicts, confidence)
    assert "a" in unresolved and "a" not in decided
    only_one, _ = rule.correct_turn_offs(first, "all-on", {"a": stats.FASTER}, 0.95)
    assert only_one["a"] == stats.FASTER  # one comparison: nothing to correct for


def test_the_confirmation_falls_back_to_the_defaults_unless_the_chosen_set_holds():
    choices = {"a": Choice(False, Evidence(True, 1.1, 1.05, 1.15, "faster")), "b": Choice(True)}
    for verdict in (stats.FASTER, stats.NO_DIFFERENCE):
        kept, record = rule.settle(choices, {"estimate": 1.0, "low": 0.99, "high": 1.01, "confidence": 0.95,
                                             "verdict": verdict, "blocks": 3})
        assert kept == choices and record.outcome.startswith("kept") and record.low == 0.99
    for verdict in (stats.SLOWER, stats.TOO_FEW):
        back, record = rule.settle(choices, {"estimate": 0.97, "low": 0.95, "high": 0.99, "confidence": 0.95,
                                             "verdict": verdict, "blocks": 3})
        assert {d: c.value for d, c in back.items()} == {"a": True, "b": True}
        assert record.outcome.startswith("fell back to the defaults") and back["a"].evidence.verdict == "not confirmed"


def _phase(runs, names, baseline, blocks=3):
    """A phase result as tune keeps it: its runs and the table ``analysis.compare`` makes of them
    (the arms' toggle values play no part in the loss and step-time columns)."""
    arms = [Arm(n, {"fused_single_qkv_rope": i % 2 == 0}, baseline=n == baseline) for i, n in enumerate(names)]
    done = {a.name: stats.by_block(runs, a.name, blocks) for a in arms}
    return {"blocks_run": blocks, "runs": runs, "confidence": 0.95, "rows": analysis.compare(arms, runs, done, None, 1)}


def test_evidence_is_the_chosen_value_against_the_other_paired_by_block():
    chosen_ms, against_ms = [900.0, 950.0, 910.0], [1000.0, 1040.0, 1000.0]
    runs = [_run("without:x", b, ms, 2.0) for b, ms in enumerate(chosen_ms)]
    runs += [_run("all-on", b, ms, 2.0 + 0.01 * b) for b, ms in enumerate(against_ms)]
    decided = rule.Decided("x", False, "turned off", "leave-one-out", "without:x", "all-on")
    ev = tune_evidence.evidence(decided, _phase(runs, ["all-on", "without:x"], "all-on"))
    logs = [math.log(a / c) for a, c in zip(against_ms, chosen_ms, strict=True)]
    assert ev.speedup == pytest.approx(math.exp(sum(logs) / 3))
    assert ev.low < ev.speedup < ev.high and ev.verdict == stats.FASTER and ev.against is True
    assert ev.blocks == 3 and ev.design == "leave-one-out" and ev.rule == "turned off"
    assert ev.loss_ratio == pytest.approx(2.0 / 2.01)
    # per block, chosen less other in % of the other's mean 2.01: 0, -0.4975, -0.995; a 90 % t-interval
    # (t(0.95, 2) = 2.92 from a table) of about [-1.34, +0.34]: holds 0 and reaches past -1 %
    assert ev.loss_verdict == "inconclusive"


def _run_losses(arm, block, losses, status="done"):
    return {"arm": arm, "block": block, "status": status, "summary": {"ms_per_iter": {"median": 1000.0}},
            "iterations": [{"iteration": i, "lm_loss": v} for i, v in losses.items()]}


# Pairs with the baseline: each run logs iterations 9 and 10 unless the case says otherwise.
_EDGE_CASES = {
    "all done": ({}, {}),
    "a baseline run without iteration 10": ({("all-on", 1): {9: 2.0}}, {}),
    "an arm run without iteration 10": ({("without:x", 2): {9: 2.0}}, {}),
    "a baseline run without any loss": ({("all-on", 0): {}}, {}),
    "an arm run without any loss": ({("without:x", 0): {}}, {}),
    "a failed baseline run that logged iteration 10": ({("all-on", 2): {9: 2.0, 10: 2.02}}, {("all-on", 2): "failed"}),
    "a failed arm run that logged iteration 10": ({("without:x", 1): {9: 2.0, 10: 2.003}},
                                                  {("without:x", 1): "failed"}),
}


@pytest.mark.parametrize("case", sorted(_EDGE_CASES))
@pytest.mark.parametrize("factor", [0.9997, 0.99970001, 0.99969999, 1.0003, 1.00030001, 0.999, 1.0, 0.97])
def test_the_profile_says_what_the_table_says_for_every_pair_with_the_baseline(case, factor):
    """The profile states the table's pair from either side (the chosen value may be the baseline's
    or the arm's) and must give the same ratio, with missing, short or failed runs."""
    base_loss = [2.0, 2.0006, 1.9994]  # a band of 0.03 %
    losses, statuses = _EDGE_CASES[case]
    runs = []
    for arm, f in (("all-on", 1.0), ("without:x", factor)):
        for b, x in enumerate(base_loss):
            runs.append(_run_losses(arm, b, losses.get((arm, b), {9: 2.1, 10: x * f}), statuses.get((arm, b), "done")))
    result = _phase(runs, ["all-on", "without:x"], "all-on")
    table = next(r for r in result["rows"] if r["arm"] == "without:x").get("loss")
    for chosen, against in (("all-on", "without:x"), ("without:x", "all-on")):
        ev = tune_evidence.evidence(rule.Decided("x", chosen == "all-on", "r", "leave-one-out", chosen, against), result)
        if table is None:
            assert ev.loss_ratio is None
            continue
        # chosen over other: the median of the per-block ratios that way up, exactly
        mine, other = ((table["arm_losses"], table["baseline_losses"]) if chosen == "without:x"
                       else (table["baseline_losses"], table["arm_losses"]))
        by_block = [c / o for c, o in zip(mine, other, strict=True) if c is not None and o]
        assert ev.loss_ratio == pytest.approx(statistics.median(by_block), rel=1e-12)


@pytest.mark.parametrize("factor, expected", [
    (1.0, "equivalent within +-1 %"), (1.03, "different: worse"), (0.97, "different: better")])
def test_the_profile_carries_ablate_s_loss_test_of_the_chosen_value_against_the_other(factor, expected):
    """Per block the chosen value's loss against the other's, as ablate's loss test (margin 1 %):
    a planted 3 % rise is worse, a fall better, none equivalent, whichever arm is the baseline."""
    wiggle = [1.0, 1.001, 0.999]
    runs = [_run("all-on", b, 1000.0, 2.0 * w) for b, w in enumerate(wiggle)]
    runs += [_run("without:x", b, 1005.0, 2.0 * w * factor) for b, w in enumerate(wiggle)]
    result = _phase(runs, ["all-on", "without:x"], "all-on")
    off = tune_evidence.evidence(rule.Decided("x", False, "r", "leave-one-out", "without:x", "all-on"), result)
    assert off.loss_verdict == expected and off.loss_ratio == pytest.approx(factor)
    flipped = {"different: worse": "different: better", "different: better": "different: worse"}.get(expected, expected)
    on = tune_evidence.evidence(rule.Decided("x", True, "r", "leave-one-out", "all-on", "without:x"), result)
    assert on.loss_verdict == flipped
    silent = [dict(r, iterations=[]) for r in runs]
    assert tune_evidence.evidence(rule.Decided("x", True, "r", "leave-one-out", "all-on", "without:x"),
                                  _phase(silent, ["all-on", "without:x"], "all-on")).loss_verdict == ""


def test_the_chosen_baseline_s_loss_ratio_is_the_median_its_own_way_up():
    """Over an even number of blocks the median of the inverted ratios is not the inverted median:
    the profile gives the chosen value's loss over the other's, block by block, then the median."""
    runs = [_run("all-on", b, 1000.0, 2.0) for b in range(2)]
    runs += [_run("without:x", b, 1000.0, x) for b, x in enumerate([2.0, 2.04])]
    result = _phase(runs, ["all-on", "without:x"], "all-on", blocks=2)
    ev = tune_evidence.evidence(rule.Decided("x", True, "r", "leave-one-out", "all-on", "without:x"), result)
    assert ev.loss_ratio == pytest.approx((1.0 + 2.0 / 2.04) / 2, rel=1e-12)


def test_a_failed_run_takes_no_part_in_the_table_loss():
    runs = [_run_losses("all-on", b, {10: x}) for b, x in enumerate([2.0, 2.0006, 1.9994])]
    runs += [_run_losses("without:x", b, {10: 2.0}) for b in range(2)]
    runs.append(_run_losses("without:x", 2, {10: 9.0}, status="failed"))  # it logged a loss, then failed
    loss = next(r for r in _phase(runs, ["all-on", "without:x"], "all-on")["rows"] if r["arm"] == "without:x")["loss"]
    assert loss["arm_losses"][2] is None and loss["max"] < 1.001


def test_a_factorial_pair_without_the_baseline_is_compared_as_a_pair():
    runs = [_run("a+b", blk, 1000.0, x) for blk, x in enumerate([2.0, 2.002, 1.998])]  # baseline: band 0.1 %
    runs += [_run("a", blk, 990.0, 2.0005) for blk in range(3)]  # tight repeats of their own
    runs += [_run("b", blk, 995.0, 2.0) for blk in range(3)]
    decided = rule.Decided("b", False, "r", "factorial", "a", "b")  # neither arm is the baseline
    ev = tune_evidence.evidence(decided, _phase(runs, ["a+b", "a", "b"], "a+b"))
    assert ev.loss_ratio == pytest.approx(2.0005 / 2.0) and ev.loss_verdict == "equivalent within +-1 %"
    other = tune_evidence.evidence(decided, _phase(runs, ["b", "a"], "b"))  # which arm is the baseline: no matter
    assert other.loss_ratio == ev.loss_ratio and other.loss_verdict == ev.loss_verdict
    # a baseline run that logged no loss takes nothing from the pair's ratio
    silent = [dict(r, iterations=[]) if r["arm"] == "a+b" and r["block"] == 0 else r for r in runs]
    ev2 = tune_evidence.evidence(decided, _phase(silent, ["a+b", "a", "b"], "a+b"))
    assert ev2.loss_ratio == pytest.approx(2.0005 / 2.0)
    # a phase result without rows: the pair alone decides
    bare = tune_evidence.evidence(decided, {"blocks_run": 3, "runs": runs, "confidence": 0.95})
    assert bare.loss_ratio == pytest.approx(2.0005 / 2.0) and bare.loss_verdict == ev.loss_verdict


# --- end to end, with a stand-in Megatron --------------------------------------------------------------


def stand_in_resolver(guarded=(), calls=None, others=None, environs=None, worlds=None):
    """Megatron's parser and the plugin, as a dry run would report them: each pinned toggle as asked,
    except those in ``guarded``, which a guard keeps off; ``others``: what it decides for toggles
    no arm pins."""
    def resolver(script, args, arm, environ, world=None):
        if calls is not None:
            calls.append(arm.name)
        if worlds is not None:
            worlds.append(world)
        if environs is not None:
            environs.append(dict(environ))
        decisions = {d: {"value": v, "source": "default", "reason": "x"} for d, v in (others or {}).items()}
        decisions.update({d: {"value": v, "source": "env", "reason": "x"} for d, v in arm.pinned.items()})
        for dest in guarded:
            decisions[dest] = {"value": False, "source": "guard", "reason": "no TE kernel here"}
        effective = {"seq_length": 4096, "train_iters": 6, **{d: r["value"] for d, r in decisions.items()}}
        return {"decisions": decisions, "effective_args": effective, "megatron": {"version": "0.20.0"},
                "capabilities": {"te_version": "2.20.2", "torch_version": "2.11.0+cu128"},
                "gpu_visible": "NVIDIA H200"}
    return resolver


def tune_main(tmp_path, *extra, toggles=THREE, resolver=None, clock=None):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--toggles", toggles, "--out", str(tmp_path / "out"), "--launch", FAKE, "--iters", "8", "--warmup", "2",
            *extra, str(script), "--", "--seq-length", "4096"]
    kwargs = {"clock": clock} if clock else {}
    return tune.main(argv, resolver=resolver or stand_in_resolver(), **kwargs)


@pytest.fixture
def costs(monkeypatch):
    """Cross-entropy fusion costs 100 ms here; bf16 reduction saves 100 (the stand-in's own rule)."""
    monkeypatch.setenv("FAKE_EXTRA_MS", "CROSS_ENTROPY_LOSS_FUSION=100")
    monkeypatch.delenv("FAKE_DRIFT", raising=False)


def test_tune_writes_a_profile_the_plugin_accepts(tmp_path, costs, capsys):
    assert tune_main(tmp_path) == 0
    out = tmp_path / "out"
    loo = json.loads((out / "leave-one-out" / "results.json").read_text())
    assert sorted(r["arm"] for r in loo["rows"]) == sorted(
        ["all-on", *(f"without:{d}" for d in THREE.split(","))])
    fac = json.loads((out / "factorial" / "results.json").read_text())
    assert sorted(r["arm"] for r in fac["rows"]) == ["all-off", "ddp_average_in_collective"]  # the unresolved one
    assert all(r["env"]["CROSS_ENTROPY_LOSS_FUSION"] == "0" and r["env"]["GRAD_REDUCE_IN_BF16"] == "1"
               for r in fac["rows"])  # the resolved ones pinned
    profile = profile_file.load(str(out / "profile.json"))
    assert {d: c.value for d, c in profile.toggles.items()} == {
        "grad_reduce_in_bf16": True, "ddp_average_in_collective": True, "cross_entropy_loss_fusion": False}
    ev = profile.toggles["cross_entropy_loss_fusion"].evidence
    assert ev.verdict == stats.FASTER and ev.against is True and ev.speedup == pytest.approx(1000 / 900)
    assert profile.toggles["grad_reduce_in_bf16"].evidence.speedup == pytest.approx(1100 / 1000)
    assert profile.toggles["ddp_average_in_collective"].evidence.design == "factorial"
    assert profile.environment.to_record() == {"megatron": "0.20.0", "transformer_engine": "2.20.2",
                                               "torch": "2.11.0+cu128", "gpu": "NVIDIA H200", "world_size": 1}
    assert "pretrain_gpt.py" in profile.command and profile.created
    conf = profile.confirmation  # the chosen set (fusion off) against the defaults: 1000 ms over 900 ms
    assert conf.verdict == stats.FASTER and conf.speedup == pytest.approx(1000 / 900) and conf.outcome.startswith("kept")
    confirmation = json.loads((out / "confirmation" / "results.json").read_text())
    assert sorted(r["arm"] for r in confirmation["rows"]) == ["chosen", "defaults"]
    md = (out / "profile.md").read_text()
    assert "Confirmation (defaults over chosen" in md
    assert "| cross_entropy_loss_fusion | off |" in md and "removing it is detectably faster" in md
    # the round trip: the plugin reads the file and takes its values, with source 'profile'
    parser = replay.parser_from_surface(replay.load_surface("main"))
    environ = {"MEGATRON_PERF_TOGGLES_PROFILE": str(out / "profile.json")}
    provider.attach(parser, controller=Controller(environ, mode="plan", capabilities=full_caps()))
    args = parser.parse_args(["--bf16", "--position-embedding-type", "rope"])
    for dest, choice in profile.toggles.items():
        assert (getattr(args, dest), args.perf_toggles[dest]["source"]) == (choice.value, "profile")
    assert not args.perf_toggles["cross_entropy_loss_fusion"]["value"]


def test_runs_leave_out_a_profile_in_use_and_pin_the_toggles_not_taking_part(tmp_path, costs, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES_PROFILE", str(tmp_path / "team.json"))
    monkeypatch.setenv("MEGATRON_PERF_TOGGLES_ASSUME", "cuda")
    environs, executed = [], []
    original = execution.execute

    def spy(run, environ, *args, **kwargs):
        executed.append(dict(environ))
        return original(run, environ, *args, **kwargs)

    monkeypatch.setattr(execution, "execute", spy)
    others = {"ddp_average_in_collective": False, "cross_entropy_loss_fusion": True}  # as the baseline decides
    assert tune_main(tmp_path, "--repeats", "2", toggles="grad_reduce_in_bf16",
                     resolver=stand_in_resolver(others=others, environs=environs)) == 0
    err = capsys.readouterr().err
    assert err.count("MEGATRON_PERF_TOGGLES_PROFILE is set here and left out of every run") == 1
    for environ in environs + executed:
        assert "MEGATRON_PERF_TOGGLES_PROFILE" not in environ and environ["MEGATRON_PERF_TOGGLES_ASSUME"] == "cuda"
    loo = json.loads((tmp_path / "out" / "leave-one-out" / "results.json").read_text())
    for r in loo["rows"]:
        assert (r["env"]["DDP_AVERAGE_IN_COLLECTIVE"], r["env"]["CROSS_ENTROPY_LOSS_FUSION"]) == ("0", "1")


def test_a_guarded_toggle_takes_no_part(tmp_path, costs, capsys):
    calls = []
    resolver = stand_in_resolver(guarded=("fused_single_qkv_rope",), calls=calls)
    assert tune_main(tmp_path, "--repeats", "2", toggles="grad_reduce_in_bf16,fused_single_qkv_rope",
                     resolver=resolver) == 0
    assert "fused_single_qkv_rope takes no part: a guard keeps it off here" in capsys.readouterr().err
    profile = profile_file.load(str(tmp_path / "out" / "profile.json"))
    assert list(profile.toggles) == ["grad_reduce_in_bf16"]
    assert "a guard keeps it off here: guard: no TE kernel here" in (tmp_path / "out" / "profile.md").read_text()
    assert not any("fused_single_qkv_rope" in name for name in calls[1:])  # no arm asks for it


def test_resume_after_an_interruption_runs_only_what_is_missing(tmp_path, costs, monkeypatch, capsys):
    counter = tmp_path / "counter"
    monkeypatch.setenv("FAKE_COUNTER", str(counter))
    original, done = execution.execute, []

    def interrupted(*args, **kwargs):
        if len(done) == 5:
            raise KeyboardInterrupt
        done.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(execution, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tune_main(tmp_path)
    assert not (tmp_path / "out" / "profile.json").exists()
    monkeypatch.setattr(execution, "execute", original)
    capsys.readouterr()
    assert tune_main(tmp_path) == 0
    assert capsys.readouterr().err.count("done earlier, skipped") == 5
    ran = len(counter.read_text().split())
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    counter.write_text("")
    assert tune_main(fresh) == 0
    assert ran == len(counter.read_text().split())  # every run once, over the two calls
    again = profile_file.load(str(fresh / "out" / "profile.json"))
    resumed = profile_file.load(str(tmp_path / "out" / "profile.json"))
    assert {d: c.value for d, c in again.toggles.items()} == {d: c.value for d, c in resumed.toggles.items()}


def test_a_baseline_that_never_finishes_writes_no_profile(tmp_path, costs, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_CRASH_ARM", "1")  # all on (bf16 reduction on) crashes in every block
    with pytest.raises(SystemExit) as info:
        tune_main(tmp_path, "--repeats", "2", "--no-warmup-run")
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and "no profile was written" in err[-1] and err[-1].startswith("[perf-toggles] error:")
    assert not (tmp_path / "out" / "profile.json").exists() and not (tmp_path / "out" / "factorial").exists()


@pytest.mark.parametrize("budget, factorial, confirmation", [
    ("4.8", "did not run (--budget 4.8 min: block 1 (about 1.0 min)", "did not run"),
    ("6", "stopped after 1 block(s), too few to compare (--budget 6 min: block 2", "did not run"),
    ("7", None, "did not run (--budget 7 min: block 1 (about 1.0 min)"),
    ("8", None, "stopped after 1 block(s), too few to compare (--budget 8 min: block 2"),
])
def test_later_phases_are_priced_by_the_leave_one_out_runs_and_a_cut_short_one_decides_nothing(
        tmp_path, costs, monkeypatch, budget, factorial, confirmation):
    """The factorial and the confirmation have no warm-up run: their first block is priced by the
    leave-one-out runs. A first call ran every phase; the second changes --iters, so every run is
    new (the forecast from the pins alone said "done earlier"), and each run takes 30 s: leave-one-out
    ends at 4.5 min, the factorial (2 arms) at 6.5, the confirmation (2 arms) at 8.5. Whatever the
    budget cuts short keeps the defaults of the unresolved (factorial) or leaves the chosen values
    unconfirmed (confirmation), as a phase that could not start would."""
    assert tune_main(tmp_path, "--repeats", "2") == 0
    first = profile_file.load(str(tmp_path / "out" / "profile.json"))
    assert first.toggles["cross_entropy_loss_fusion"].value is False and first.confirmation.blocks == 2
    now, reads = [0.0], [0]

    def monotonic():  # execute reads it as a run starts and as it ends: each run takes 30 s
        reads[0] += 1
        now[0] += 30.0 if reads[0] % 2 == 0 else 0.0
        return now[0]

    monkeypatch.setattr(execution, "time", types.SimpleNamespace(monotonic=monotonic))
    assert tune_main(tmp_path, "--repeats", "2", "--iters", "9", "--budget", budget, clock=lambda: now[0]) == 0
    assert now[0] <= float(budget) * 60  # nothing ran past the budget
    out = tmp_path / "out"
    assert json.loads((out / "leave-one-out" / "results.json").read_text())["blocks_run"] == 2
    profile = profile_file.load(str(out / "profile.json"))
    unresolved = profile.toggles["ddp_average_in_collective"]
    assert unresolved.value is True
    if factorial:
        assert f"the factorial {factorial}" in unresolved.evidence.rule
    else:
        assert unresolved.evidence.design == "factorial" and unresolved.evidence.blocks == 2
    assert profile.toggles["cross_entropy_loss_fusion"].value is False  # chosen, kept, but unconfirmed
    assert confirmation in profile.confirmation.outcome and "unconfirmed" in profile.confirmation.outcome
    md = (out / "profile.md").read_text()
    assert f"Confirmation (defaults over chosen): {profile.confirmation.outcome}." in md
    assert "with no warm-up run." in (out / "confirmation" / "results.md").read_text()


def _spec(tmp_path):
    """tune's spec for ``--budget 10 --out tmp_path s.py``, as the command builds it."""
    return ExperimentSpec.from_options(tune.build_tune_parser().parse_args(["--budget", "10", "--out", str(tmp_path),
                                                                           "s.py"]))


def test_a_failed_run_prices_nothing(tmp_path, costs):
    setup = phases.Setup(_spec(tmp_path), {}, None, lambda: 0.0, 0.0)
    done = [{"block": b, "status": "done", "seconds": 120.0} for b in (0, 1)]
    crashed = [{"block": 0, "status": "failed", "seconds": 1.0}] * 5  # a quick crash: no run time
    assert phases.timed_runs({"runs": done + crashed}) == [120.0, 120.0]
    assert "would not fit" in phases.phase_fits(setup, {"runs": done + crashed}, "factorial", _factorial(3))


def test_a_budget_that_starts_no_block_says_so_rather_than_blaming_the_runs(tmp_path, costs, capsys):
    ticks = iter(range(0, 10**6, 400))  # every look at the clock: 400 s later
    with pytest.raises(SystemExit) as info:
        tune_main(tmp_path, "--repeats", "2", "--budget", "5", clock=lambda: next(ticks))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and err[-1].startswith("[perf-toggles] error: no block of leave-one-out could start")
    assert "--budget 5 min: block 1" in err[-1] and "larger --budget" in err[-1] and "logs" not in err[-1]
    assert not (tmp_path / "out" / "profile.json").exists()


def test_a_crashed_warm_up_is_not_blamed_on_the_budget(tmp_path, costs, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_CRASH_ARM", "1")  # all on crashes, its warm-up run too
    with pytest.raises(SystemExit) as info:
        tune_main(tmp_path, "--repeats", "2", "--budget", "0.0001", clock=lambda: 0.0)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 1 and "did not finish a single measured run" in err[-1] and "logs" in err[-1]
    assert "larger --budget" not in err[-1]


def test_a_toggle_whose_arm_failed_is_not_measured_and_kept_out_of_the_factorial(tmp_path, costs, monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_ARM", "0")  # only the arm without bf16 reduction crashes
    assert tune_main(tmp_path, "--repeats", "2", "--no-warmup-run") == 1
    out = tmp_path / "out"
    profile = profile_file.load(str(out / "profile.json"))
    choice = profile.toggles["grad_reduce_in_bf16"]
    assert choice.value is True and choice.evidence.speedup is None and choice.evidence.verdict == "not measured"
    assert "failed in 2 of 2 block(s)" in choice.evidence.rule
    fac = json.loads((out / "factorial" / "results.json").read_text())
    assert all("grad_reduce_in_bf16" not in r["arm"] for r in fac["rows"])
    assert "| grad_reduce_in_bf16 | on | - | not measured |" in (out / "profile.md").read_text()


def test_resume_reruns_a_run_whose_pinned_toggles_changed(tmp_path, costs, capsys):
    assert tune_main(tmp_path, "--repeats", "2") == 0  # fusion turned off, pinned off in the factorial
    capsys.readouterr()
    resolver = stand_in_resolver(others={"cross_entropy_loss_fusion": True})  # now not tuned: pinned on
    assert tune_main(tmp_path, "--repeats", "2", toggles="grad_reduce_in_bf16,ddp_average_in_collective",
                     resolver=resolver) == 0
    statuses = [json.loads(p.read_text()) for p in (tmp_path / "out" / "factorial" / "runs").glob("*/*/status.json")]
    assert statuses and all(s["env"]["CROSS_ENTROPY_LOSS_FUSION"] == "1" for s in statuses)
    assert "done earlier, skipped" in capsys.readouterr().err  # what did not change was not run again


@pytest.mark.parametrize("launch, expected", [
    (None, 1), ("torchrun --nproc-per-node 8", 8), ("torchrun --nproc_per_node=4 --nnodes 2", 8),
    ("python -m torch.distributed.run --nproc-per-node 2", 2), ("python3", 1),
    ("torchrun --nproc-per-node gpu", None), ("torchrun --nproc-per-node 8 --nnodes 1:2", None),
    ("srun -n 16", 16), ("srun --ntasks=4", 4), ("srun -N 2", None), ("mpirun -np 8", 8), ("mpiexec -n 3", 3),
    ("mpirun --hostfile h", None), ("deepspeed --num_gpus 8", None),
])
def test_the_launchers_world_size_or_none_where_it_is_not_plain(launch, expected):
    assert launch_world_size(launch) == expected


def test_the_world_size_is_the_runs_own_where_megatron_logged_it(tmp_path, costs, monkeypatch):
    monkeypatch.setenv("FAKE_WORLD_SIZE", "16")  # what the launch really started, whatever --launch reads as
    assert tune_main(tmp_path, "--repeats", "2", toggles="grad_reduce_in_bf16") == 0
    assert profile_file.load(str(tmp_path / "out" / "profile.json")).environment.world_size == 16


def test_the_budget_stops_before_a_block_that_would_not_fit(tmp_path, costs):
    ticks = iter(range(0, 10**6, 50))  # every look at the clock: 50 s later
    assert tune_main(tmp_path, "--repeats", "5", "--budget", "3", clock=lambda: next(ticks)) == 0
    out = tmp_path / "out"
    loo = json.loads((out / "leave-one-out" / "results.json").read_text())
    assert loo["blocks_run"] < 5 and "--budget 3 min" in loo["stop_reason"]
    assert not (out / "factorial").exists()
    profile = profile_file.load(str(out / "profile.json"))
    assert profile.toggles["ddp_average_in_collective"].value is True
    assert "the factorial did not run (--budget 3 min" in profile.toggles["ddp_average_in_collective"].evidence.rule


def _factorial(n):
    toggles = ("grad_reduce_in_bf16", "ddp_average_in_collective", "cross_entropy_loss_fusion")[:n]
    return rule.factorial_arms(toggles, {}, {})


def test_the_factorial_is_skipped_when_one_block_would_not_fit(tmp_path, costs):
    setup = phases.Setup(_spec(tmp_path), {}, None, lambda: 0.0, 0.0)
    first = {"runs": [{"block": b, "status": "done", "seconds": 120.0} for b in (-1, 0, 1)]}
    assert len(_factorial(2)) == 4 and len(_factorial(3)) == 8
    assert phases.phase_fits(setup, first, "factorial", _factorial(2)) is None  # 8 min of 10
    assert "one block of 8 arms (about 16.0 min) would not fit" in phases.phase_fits(setup, first, "factorial",
                                                                                   _factorial(3))


def test_a_resumed_phase_is_priced_by_the_runs_not_done_earlier(tmp_path, costs):
    """A factorial whose first block mostly ran in an earlier call still fits what is left."""
    setup = phases.Setup(_spec(tmp_path), {}, None, lambda: 0.0, 0.0)
    first = {"runs": [{"block": b, "status": "done", "seconds": 120.0} for b in (-1, 0, 1)]}
    arms = _factorial(3)
    for arm in arms[:4]:
        here = ablate_runs.run_dir(tmp_path / "factorial", arm, 0)
        here.mkdir(parents=True)
        (here / "status.json").write_text(json.dumps({"status": "done", "env": arm.env, "seconds": 120.0}))
    assert phases.phase_fits(setup, first, "factorial", arms) is None  # 4 runs to go: 8 min of 10
    failed = ablate_runs.run_dir(tmp_path / "factorial", arms[0], 0) / "status.json"
    failed.write_text(json.dumps({"status": "failed", "env": arms[0].env, "seconds": 120.0}))
    other = ablate_runs.run_dir(tmp_path / "factorial", arms[1], 0) / "status.json"
    other.write_text(json.dumps({"status": "done", "env": {**arms[1].env, "GRAD_REDUCE_IN_BF16": "x"}}))
    why = phases.phase_fits(setup, first, "factorial", arms)  # a failed run and another pin run again
    assert "the 6 runs of its first block not done earlier (about 12.0 min) would not fit" in why
    late = phases.Setup(setup.spec, {}, None, lambda: 3600.0, 0.0)  # an hour in: 10 min budget long spent
    pair = [Arm("defaults", {"grad_reduce_in_bf16": True}, baseline=True),
            Arm("chosen", {"grad_reduce_in_bf16": False})]
    assert "would not fit" in phases.phase_fits(late, first, "confirmation", pair)
    for arm in pair:  # a confirmation done in an earlier call costs nothing, however late
        here = ablate_runs.run_dir(tmp_path / "confirmation", arm, 0)
        here.mkdir(parents=True)
        (here / "status.json").write_text(json.dumps({"status": "done", "env": arm.env, "seconds": 120.0}))
    assert phases.phase_fits(late, first, "confirmation", pair) is None
    assert "would not fit" in phases.phase_fits(late, first, "factorial", arms)  # its own directory


@pytest.mark.parametrize("extra, words", [
    (["--max-factorial", "9"], "--max-factorial 9"),
    (["--repeats", "0"], "--repeats 0"),
    (["--budget", "0"], "--budget 0.0"),
    (["--iters", "2", "--warmup", "2"], "nothing would be measured"),
    (["--toggles", "warp_drive"], "unknown toggle 'warp_drive'"),
    (["--toggles", "cross_entropy_fusion_impl"], "unknown toggle"),
    (["--launch", "no-such-torchrun --nproc-per-node 8"], "'no-such-torchrun' is not an executable"),
    (["--world-size", "0"], "--world-size 0: at least 1"),
    (["--launch", f"env GRAD_REDUCE_IN_BF16=0 {sys.executable}"], "--launch sets GRAD_REDUCE_IN_BF16 for every run"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, words):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--out", str(tmp_path / "o"), "--launch", FAKE, *extra, str(script)]
    with pytest.raises(SystemExit) as info:
        tune.main(argv, resolver=lambda *a: pytest.fail("no dry run on bad input"))
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and words in err[0] and err[0].startswith("[perf-toggles] error:")


def test_the_command_line_refuses_bad_input_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for argv, words in ((["tune"], "the following arguments are required: script"),
                        (["tune", "--budget", "soon", "x.py"], "invalid float value"),
                        (["tune", str(tmp_path / "missing.py")], "script not found")):
        proc = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", *argv], capture_output=True, text=True,
                              cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    help_text = subprocess.run([sys.executable, "-m", "megatron_perf_toggles", "tune", "--help"], capture_output=True,
                               text=True, env={**env, "PYTHONPATH": str(REPO)}, timeout=120).stdout
    assert "leave-one-out" in help_text and "MEGATRON_PERF_TOGGLES_PROFILE" in help_text and "--budget" in help_text


def test_every_dry_run_plans_for_the_stated_world_and_the_profile_records_it(tmp_path, capsys):
    """The stand-in launch is `python fake.py`, one process as far as the launch says; --world-size 2
    wins: the guard probe and every phase's dry runs plan for it, and with no world in the runs'
    logs the profile records the stated one."""
    worlds = []
    assert tune_main(tmp_path, "--world-size", "2", "--repeats", "1", resolver=stand_in_resolver(worlds=worlds)) == 0
    assert len(worlds) >= 4 and set(worlds) == {2}
    assert profile_file.load(str(tmp_path / "out" / "profile.json")).environment.world_size == 2
    assert "dry runs plan for a world of 2 (from --world-size; --launch looks like 1)" in capsys.readouterr().err


# --- memory: each choice's measured change, and --memory-limit-gb -----------------------------------


def test_the_profile_records_each_choice_s_memory_change(tmp_path, costs, monkeypatch):
    monkeypatch.setenv("FAKE_EXTRA_MB", "CROSS_ENTROPY_LOSS_FUSION=4008,GRAD_REDUCE_IN_BF16=-3668")
    assert tune_main(tmp_path, "--repeats", "2") == 0
    profile = profile_file.load(str(tmp_path / "out" / "profile.json"))
    evidence = {d: c.evidence for d, c in profile.toggles.items()}
    assert evidence["cross_entropy_loss_fusion"].peak_memory_delta_mb == -4008  # chosen off, against on
    assert evidence["grad_reduce_in_bf16"].peak_memory_delta_mb == -3668  # chosen on, against off
    md = (tmp_path / "out" / "profile.md").read_text()
    assert "peak memory vs the other (MB)" in md and "| -4008 |" in md
    loo = (tmp_path / "out" / "leave-one-out" / "results.md").read_text()
    assert "vs baseline MB" in loo and "| +3668 |" in loo  # without:grad_reduce_in_bf16 against all-on
    rows = {r["arm"]: r for r in json.loads((tmp_path / "out" / "leave-one-out" / "results.json").read_text())["rows"]}
    assert rows["without:cross_entropy_loss_fusion"]["max_allocated_delta_mb"] == -4008
    assert rows["all-on"]["max_allocated_delta_mb"] == 0


def test_a_memory_limit_turns_off_what_saves_most_until_the_choices_fit(tmp_path, monkeypatch):
    # Fusion costs 4008 MB, the DDP average 1000 MB (stand-in numbers); bf16 reduction is the fast one.
    monkeypatch.setenv("FAKE_EXTRA_MB", "CROSS_ENTROPY_LOSS_FUSION=4008,DDP_AVERAGE_IN_COLLECTIVE=1000")
    monkeypatch.setenv("FAKE_EXTRA_MS", "GRAD_REDUCE_IN_BF16=100")
    limit_gb = (200.5 + 1000 + 500) / 1024  # all on peaks at 5208.5 MB: both must go to fit
    assert tune_main(tmp_path, "--repeats", "2", "--memory-limit-gb", f"{limit_gb:.6f}") == 0
    profile = profile_file.load(str(tmp_path / "out" / "profile.json"))
    ce, ddp = profile.toggles["cross_entropy_loss_fusion"], profile.toggles["ddp_average_in_collective"]
    assert ce.value is False and "--memory-limit-gb" in ce.evidence.rule and "saves 4008 MB" in ce.evidence.rule
    assert ddp.value is True  # 5208.5 - 4008 = 1200.5 MB fits 1700.5: the cheaper one stays
    assert "peak at 1.2 GB per GPU" in profile.notes


def test_a_memory_limit_must_be_positive(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        tune_main(tmp_path, "--memory-limit-gb", "0")
    assert stop.value.code == 2 and "--memory-limit-gb 0" in capsys.readouterr().err


def test_a_memory_report_without_max_allocated_gives_no_peak_and_no_error():
    runs = [_run("all-on", b, 1000.0, 2.0) for b in range(3)] + [_run("without:a", b, 950.0, 2.0) for b in range(3)]
    for r in runs:
        r["summary"]["memory_mb"] = {"allocated": 100.0}
    runs[-1]["summary"]["memory_mb"]["max_allocated"] = 300.0
    rows = {r["arm"]: r for r in _phase(runs, ["all-on", "without:a"], "all-on")["rows"]}
    assert "max_allocated_mb" not in rows["all-on"] and rows["without:a"]["max_allocated_mb"] == 300.0
    assert "max_allocated_delta_mb" not in rows["without:a"]  # no baseline peak to subtract
