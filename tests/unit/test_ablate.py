"""The ablation harness: design expansion, bad input, confound check, running, resume, measuring."""

from __future__ import annotations

import argparse
import io
import json
import sys

import pytest
from conftest import REPO

from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.tools.ablate import analysis, confounds, execution, report, schedule
from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate import runs as ablate_runs
from megatron_perf_toggles.tools.ablate.design import (
    DEFAULT_TOGGLES,
    Arm,
    DesignError,
    design_of,
    expand,
    known_args,
    parse_candidates,
    parse_vary,
)
from megatron_perf_toggles.tools.ablate.spec import ExperimentSpec, launch_world_size, parse_toggles
from megatron_perf_toggles.tools.megatron_log import parse_file


def test_one_at_a_time():
    arms = expand("one-at-a-time", DEFAULT_TOGGLES, [])
    assert len(arms) == len(DEFAULT_TOGGLES) + 1
    assert arms[0].baseline and not any(arms[0].toggles.values())
    for arm, dest in zip(arms[1:], DEFAULT_TOGGLES, strict=True):
        assert [d for d, v in arm.toggles.items() if v] == [dest]


def test_leave_one_out():
    arms = expand("leave-one-out", DEFAULT_TOGGLES, [])
    assert len(arms) == len(DEFAULT_TOGGLES) + 1 and all(arms[0].toggles.values())
    for arm, dest in zip(arms[1:], DEFAULT_TOGGLES, strict=True):
        assert [d for d, v in arm.toggles.items() if not v] == [dest]


def test_factorial_reproduces_the_2x2():
    arms = expand("factorial", ("grad_reduce_in_bf16",), parse_vary(["adam_eps=1e-8,1e-5"], {"adam_eps"}))
    got = {(a.toggles["grad_reduce_in_bf16"], a.settings["adam_eps"]) for a in arms}
    assert got == {(False, "1e-8"), (True, "1e-8"), (False, "1e-5"), (True, "1e-5")}
    assert sum(a.baseline for a in arms) == 1
    assert arms[1].extra_args == ["--adam-eps", "1e-8"]
    assert arms[1].env == {"GRAD_REDUCE_IN_BF16": "1"}


def test_factorial_over_three_toggles():
    assert len(expand("factorial", DEFAULT_TOGGLES[:3], [])) == 8


def test_headline_is_all_off_against_all_on():
    arms = expand("headline", DEFAULT_TOGGLES, [])
    assert [a.name for a in arms] == ["all-off", "all-on"] and arms[0].baseline
    assert not any(arms[0].toggles.values()) and all(arms[1].toggles.values())


def test_others_pins_the_toggles_that_take_no_part():
    arms = expand("one-at-a-time", ("ddp_average_in_collective",), [], others="off")
    assert [a.name for a in arms] == ["all-off", "only:ddp_average_in_collective"]
    for arm in arms:
        env = arm.env
        assert set(env) == {BY_DEST[d].env for d in DEFAULT_TOGGLES}
        assert [k for k, v in env.items() if v == "1"] == (["DDP_AVERAGE_IN_COLLECTIVE"] if not arm.baseline else [])
    inherit = expand("one-at-a-time", ("ddp_average_in_collective",), [])
    assert set(inherit[0].env) == {"DDP_AVERAGE_IN_COLLECTIVE"}


def test_every_arm_sets_every_design_toggle_explicitly():
    for design in ("one-at-a-time", "leave-one-out", "factorial", "headline"):
        for arm in expand(design, DEFAULT_TOGGLES[:2], []):
            assert set(arm.env) == {"GRADIENT_ACCUMULATION_FUSION", "GRAD_REDUCE_IN_BF16"}


@pytest.mark.parametrize("call, words", [
    (lambda: parse_vary(["adam_epz=1e-8,1e-5"], {"adam_eps"}), "unknown name 'adam_epz'"),
    (lambda: parse_vary(["grad_reduce_in_bf16=0,1"], {"adam_eps"}), "through --toggles"),
    (lambda: parse_vary(["adam_eps=1e-8"], {"adam_eps"}), "at least two values"),
    (lambda: parse_vary(["adam_eps"], {"adam_eps"}), "NAME=V1,V2"),
    (lambda: parse_toggles("grad_reduce_in_bf16,warp_speed"), "unknown toggle 'warp_speed'"),
    (lambda: parse_toggles(","), "empty"),
    (lambda: expand("random", DEFAULT_TOGGLES, []), "unknown design"),
    (lambda: expand("one-at-a-time", (), []), "nothing to compare"),
    (lambda: expand("headline", (), []), "nothing to compare"),
    (lambda: expand("headline", DEFAULT_TOGGLES, [], others="sideways"), "--others 'sideways'"),
    (lambda: expand("one-at-a-time", DEFAULT_TOGGLES, parse_vary(["lr=1e-4,2e-4"], {"lr"})), "--design factorial"),
    (lambda: expand("candidates", DEFAULT_TOGGLES, []), "needs --candidate"),
    (lambda: expand("headline", DEFAULT_TOGGLES, [], candidates={"x": ("--manual-gc",)}), "needs --design candidates"),
    (lambda: parse_candidates(["overlap"]), "expected NAME="),
    (lambda: parse_candidates(["overlap="]), "expected NAME="),
    (lambda: parse_candidates(["gc=manual-gc"]), "must start with a --flag"),
    (lambda: parse_candidates(["g c=--manual-gc"]), "letters, digits"),
    (lambda: parse_candidates(["gc=--manual-gc", "gc=--manual-gc-interval 10"]), "given twice"),
    (lambda: parse_candidates(["gc=--manual-gc --manual-gc-intervall 10"], {"--manual-gc", "--manual-gc-interval"}),
     "not a Megatron argument: --manual-gc-intervall"),
    (lambda: parse_candidates(["gc=--manual-gc 'x"]), "--candidate"),
    (lambda: parse_candidates(["alloc=A=1 manual-gc"]), "must start with a --flag, not 'manual-gc'"),
    (lambda: parse_candidates(["alloc=A=1 A=2"]), "set twice"),
    (lambda: parse_candidates(["bf16=GRAD_REDUCE_IN_BF16=0"]), "GRAD_REDUCE_IN_BF16 is this plugin's own"),
    (lambda: parse_candidates(["p=MEGATRON_PERF_TOGGLES_PROFILE=x.json --manual-gc"]), "plugin's own setting"),
    (lambda: parse_candidates(["p=MEGATRON_PERF_TOGGLES_FUTURE=1"]), "plugin's own setting"),
    (lambda: parse_candidates(["gpu=CUDA_VISIBLE_DEVICES=1"]), "set by the runner and the launcher"),
    (lambda: parse_candidates(["r=RANK=3 --manual-gc"]), "set by the runner and the launcher"),
    # a flag with its -- missing is not an environment variable (only upper-case names are)
    (lambda: parse_candidates(["bucket=ddp_bucket_size=8e7"]), "must start with a --flag, not 'ddp_bucket_size=8e7'"),
])
def test_bad_input_is_a_clear_error(call, words):
    with pytest.raises(DesignError, match=None) as info:
        call()
    assert words in str(info.value)


def test_cli_bad_input_exits_2(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    for argv, words in [
        (["--design", "factorial", "--vary", "adam_epz=1,2", str(script)], "unknown name 'adam_epz'"),
        (["--design", "factorial", "--out", "/proc/forbidden/x", str(script)], "not writable"),
        (["--design", "one-at-a-time", str(tmp_path / "missing.py")], "script not found"),
        (["--design", "headline", "--repeats", "0", str(script)], "--repeats 0"),
        (["--design", "headline", "--iters", "3", "--warmup", "3", str(script)], "nothing would be measured"),
        (["--design", "headline", "--confidence", "95", str(script)], "--confidence 95.0"),
        (["--design", "headline", "--target-ci", "5", str(script)], "--target-ci 5.0"),
        (["--design", "headline", "--budget", "0", str(script)], "--budget 0.0"),
    ]:
        with pytest.raises(SystemExit) as info:
            ablate.main(argv, resolver=lambda *a: pytest.fail("must not resolve arms on bad input"))
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err



# --- confound check on synthetic records (the real-tree version is in test_ablate_real.py) -------


def _added(arm):
    """What a candidate's arguments set, as a parser would: ``--flag value`` or a switch."""
    out, words = {}, arm.added_args
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else "--"
            out[word[2:].replace("-", "_")] = True if nxt.startswith("--") else nxt
    return out


def _record(arm, **extra):
    effective = {"seq_length": 4096, "adam_eps": 1e-8, "seed": 1234, "train_iters": 6, **arm.pinned,
                 **arm.settings, **_added(arm), **extra}
    decisions = {d: {"value": v, "source": "env", "reason": "x"} for d, v in arm.pinned.items()}
    return {"decisions": decisions, "effective_args": effective}


def _fake_megatron(derives=None, calls=None):
    """A resolver standing in for Megatron's parser: each toggle that is on sets what ``derives`` says."""
    def resolver(script, args, arm, environ, world=None):
        if calls is not None:
            calls.append(arm.name)
        extra = {}
        for dest, (key, on, off) in (derives or {}).items():
            extra[key] = on if arm.pinned.get(dest) else off
        if "--adam-eps" in args:
            extra["adam_eps"] = float(args[args.index("--adam-eps") + 1])
        return _record(arm, **extra)
    return resolver


def test_clean_arms_pass():
    arms = expand("one-at-a-time", DEFAULT_TOGGLES[:2], [])
    confounds.check_confounds(design_of("t", arms), [_record(a) for a in arms])


def test_extra_difference_is_refused_with_a_diff():
    arms = expand("one-at-a-time", DEFAULT_TOGGLES[:2], [])
    records = [_record(a) for a in arms]
    records[2]["effective_args"]["adam_eps"] = 1e-5
    with pytest.raises(confounds.ConfoundError) as info:
        confounds.check_confounds(design_of("t", arms), records)
    assert "adam_eps: all-off=1e-08" in str(info.value) and "1e-05" in str(info.value)


def test_guard_forced_arm_is_refused_with_the_guard_reason():
    arms = expand("factorial", ("gradient_accumulation_fusion",), [])
    records = [_record(a) for a in arms]
    for rec in records:  # --use-torch-fsdp2: the guard turns fusion off in every arm
        rec["decisions"]["gradient_accumulation_fusion"] = {
            "value": False, "source": "guard", "reason": "--use-torch-fsdp2: FSDP does not support it"}
        rec["effective_args"]["gradient_accumulation_fusion"] = False
    with pytest.raises(confounds.ConfoundError, match="--use-torch-fsdp2"):
        confounds.check_confounds(design_of("t", arms), records)


def test_a_pinned_toggle_forced_by_a_guard_is_refused():
    arms = expand("one-at-a-time", ("ddp_average_in_collective",), [], others="off")
    records = [_record(a) for a in arms]
    records[1]["decisions"]["grad_reduce_in_bf16"] = {"value": True, "source": "guard", "reason": "mxfp4"}
    with pytest.raises(confounds.ConfoundError, match="grad_reduce_in_bf16 should be False but is True"):
        confounds.check_confounds(design_of("t", arms), records)


def test_what_a_toggle_derives_is_learnt_from_a_single_change_pair():
    derives = {"grad_reduce_in_bf16": ("megatron_fsdp_grad_comm_dtype", "torch.bfloat16", None)}
    arms = expand("headline", ("grad_reduce_in_bf16", "ddp_average_in_collective"), [])
    calls = []
    records, derived = confounds.resolve_and_check(_fake_megatron(derives, calls), "s.py", [], design_of("t", arms), {})
    assert derived == {"grad_reduce_in_bf16": {"megatron_fsdp_grad_comm_dtype"}, "ddp_average_in_collective": set()}
    # headline arms flip two toggles at once: the single-change probes are extra dry runs
    assert sorted(calls) == sorted(["all-off", "all-on", "probe:grad_reduce_in_bf16=True",
                                    "probe:ddp_average_in_collective=True"])
    # without what the pair taught, the same records are a confound
    with pytest.raises(confounds.ConfoundError, match="megatron_fsdp_grad_comm_dtype"):
        confounds.check_confounds(design_of("t", arms), records)


def test_one_at_a_time_probes_are_its_own_arms():
    calls = []
    arms = expand("one-at-a-time", DEFAULT_TOGGLES, [])
    confounds.resolve_and_check(_fake_megatron(calls=calls), "s.py", [], design_of("t", arms), {})
    assert sorted(calls) == sorted(a.name for a in arms)


def test_a_difference_no_changed_toggle_makes_alone_is_refused():
    # The difference comes with grad_reduce_in_bf16, but the arm did not change it.
    derives = {"grad_reduce_in_bf16": ("main_grads_dtype", "bf16", "fp32")}
    arms = expand("factorial", ("grad_reduce_in_bf16", "ddp_average_in_collective"), [])
    records, derived = confounds.resolve_and_check(_fake_megatron(derives), "s.py", [], design_of("t", arms), {})
    only_ddp = next(i for i, a in enumerate(arms) if a.name == "ddp_average_in_collective")
    records[only_ddp]["effective_args"]["main_grads_dtype"] = "bf16"
    with pytest.raises(confounds.ConfoundError, match="main_grads_dtype: all-off='fp32'"):
        confounds.check_confounds(design_of("t", arms), records, derived)


def test_an_interaction_only_difference_is_refused():
    arms = expand("factorial", ("grad_reduce_in_bf16", "ddp_average_in_collective"), [])

    def resolver(script, args, arm, environ, world=None):
        both = arm.toggles["grad_reduce_in_bf16"] and arm.toggles["ddp_average_in_collective"]
        return _record(arm, bucket_size=1 if both else 2)

    with pytest.raises(confounds.ConfoundError, match="bucket_size"):
        confounds.resolve_and_check(resolver, "s.py", [], design_of("t", arms), {})


def test_vary_settings_are_checked_and_carried_once():
    arms = expand("factorial", ("grad_reduce_in_bf16",), parse_vary(["adam_eps=1e-8,1e-5"], {"adam_eps"}))
    seen = []

    def resolver(script, args, arm, environ, world=None):
        seen.append(args)
        return _record(arm)

    confounds.resolve_and_check(resolver, "s.py", ["--adam-eps", "1e-3", "--lr", "1e-4"], design_of("t", arms), {})
    cmd = ablate_runs.dry_run_command("s.py", ["--adam-eps", "1e-3", "--lr", "1e-4"], arms[-1])
    assert cmd.count("--adam-eps") == 1 and cmd[cmd.index("--adam-eps") + 1] == "1e-5"


def test_candidates_are_the_command_as_given_against_each_addition():
    cands = parse_candidates(["overlap=--overlap-grad-reduce --overlap-param-gather", "bucket=--ddp-bucket-size 8e7"],
                             {"--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size"})
    arms = expand("candidates", DEFAULT_TOGGLES, [], candidates=cands)
    assert [a.name for a in arms] == ["baseline", "+overlap", "+bucket"] and arms[0].baseline
    assert all(a.toggles == {} for a in arms)  # the toggles keep their defaults (or the caller's env)
    assert arms[1].intended == {"+overlap": "--overlap-grad-reduce --overlap-param-gather"}
    assert arms[0].env == {} and arms[1].env == {}
    pinned = expand("candidates", DEFAULT_TOGGLES, [], others="on", candidates=cands)
    assert all(a.pinned == dict.fromkeys(DEFAULT_TOGGLES, True) for a in pinned)
    common = ["--lr", "1", "--ddp-bucket-size", "4e7", "--overlap-grad-reduce", "--bf16"]
    assert ablate_runs.arm_args(common, arms[2]) == ["--lr", "1", "--overlap-grad-reduce", "--bf16",
                                                 "--ddp-bucket-size", "8e7"]
    assert ablate_runs.arm_args(common, arms[1]) == ["--lr", "1", "--ddp-bucket-size", "4e7", "--bf16",
                                                 "--overlap-grad-reduce", "--overlap-param-gather"]


def test_a_candidate_sets_environment_variables_written_before_its_arguments():
    cands = parse_candidates(["alloc=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                              "both=NCCL_GRAPH_REGISTER=0 A_B=x=y --manual-gc --manual-gc-interval 5",
                              "value=--tensorboard-dir a=b"], {"--manual-gc", "--manual-gc-interval", "--tensorboard-dir"})
    arms = {a.name: a for a in expand("candidates", DEFAULT_TOGGLES, [], candidates=cands)}
    assert arms["+alloc"].env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert arms["+alloc"].added_args == []
    assert arms["+both"].added_env == {"NCCL_GRAPH_REGISTER": "0", "A_B": "x=y"}
    assert ablate_runs.arm_args(["--lr", "1"], arms["+both"]) == ["--lr", "1", "--manual-gc", "--manual-gc-interval", "5"]
    # only leading words are assignments: a flag's value may hold '='
    assert arms["+value"].added_env == {} and arms["+value"].added_args == ["--tensorboard-dir", "a=b"]
    pinned = expand("candidates", ("grad_reduce_in_bf16",), [], others="on", candidates=cands)
    assert pinned[1].env == {**{BY_DEST[d].env: "1" for d in DEFAULT_TOGGLES},
                               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert len({a.signature for a in arms.values()}) == 4  # the environment tells the arms apart


def test_an_environment_only_candidate_is_not_a_no_op_but_the_same_one_twice_is():
    arms = expand("candidates", DEFAULT_TOGGLES, [], candidates={"alloc": ("PYTORCH_CUDA_ALLOC_CONF=x",)})
    # its arguments equal the baseline's
    confounds.resolve_and_check(_fake_megatron(), "s.py", ["--bf16"], design_of("t", arms), {})
    twins = expand("candidates", DEFAULT_TOGGLES, [], candidates={"a": ("X=1",), "b": ("X=1",)})
    with pytest.raises(confounds.ConfoundError, match="identical Megatron arguments and environment"):
        confounds.resolve_and_check(_fake_megatron(), "s.py", ["--bf16"], design_of("t", twins), {})
    # the caller's environment already holds the candidate's value: the arm would change nothing
    with pytest.raises(confounds.ConfoundError, match="identical Megatron arguments and environment"):
        confounds.resolve_and_check(_fake_megatron(), "s.py", ["--bf16"], design_of("t", arms), {"PYTORCH_CUDA_ALLOC_CONF": "x"})
    confounds.resolve_and_check(_fake_megatron(), "s.py", ["--bf16"], design_of("t", arms), {"PYTORCH_CUDA_ALLOC_CONF": "y"})


def test_the_dry_run_gets_the_candidates_environment_as_rank_0(monkeypatch):
    seen = {}

    def run(cmd, **kwargs):
        seen.update(kwargs["env"])
        return argparse.Namespace(returncode=0, stdout="{}", stderr="")

    monkeypatch.setattr(ablate_runs.subprocess, "run", run)
    # built by hand: parse_candidates refuses RANK, and the dry run keeps rank 0 even so
    arm = Arm("+a", {}, adds={"a": ("RANK=3", "NCCL_ALGO=Ring", "--manual-gc")})
    ablate_runs.resolve_arm("s.py", ["--bf16"], arm, {"RANK": "3", "WORLD_SIZE": "8", "NCCL_ALGO": "Tree"})
    assert seen["NCCL_ALGO"] == "Ring" and seen["RANK"] == "0" and "WORLD_SIZE" not in seen


def test_results_record_the_callers_settings_that_change_every_arms_speed(tmp_path, monkeypatch):
    assert _run_main(tmp_path, "--repeats", "1", monkeypatch=monkeypatch,
                     env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
                          "NCCL_ALGO": "Ring", "FAKE_EXTRA_MS": "X=1"}) == 0
    env = json.loads((tmp_path / "out" / "results.json").read_text())["environment"]
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and env["NCCL_ALGO"] == "Ring"
    assert env["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1" and "FAKE_EXTRA_MS" not in env


def test_a_candidates_environment_reaches_its_runs_alone(tmp_path, monkeypatch):
    assert _run_main(tmp_path, "--repeats", "2", "--candidate", "slow=FAKE_SLOW=1",
                     env={"FAKE_EXTRA_MS": "FAKE_SLOW=100"}, monkeypatch=monkeypatch,
                     design=("--design", "candidates")) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {r["arm"]: r for r in data["rows"]}
    assert data["commands"]["+slow"]["env"] == {"FAKE_SLOW": "1"} and data["commands"]["baseline"]["env"] == {}
    assert data["commands"]["+slow"]["candidate_env"] == {"FAKE_SLOW": "1"}
    assert data["environment"]["FAKE_SLOW"] is None  # the caller's value of what a candidate sets: unset
    assert "- +slow: `FAKE_SLOW=1`" in (tmp_path / "out" / "results.md").read_text()
    assert rows["+slow"]["speedup"]["verdict"] == "slower"
    assert rows["+slow"]["speedup"]["estimate"] == pytest.approx(1000 / 1100, rel=1e-3)


def test_a_candidate_is_its_own_probe_and_a_no_op_candidate_is_refused():
    arms = expand("candidates", DEFAULT_TOGGLES, [], candidates={"gc": ("--manual-gc",), "noop": ("--bf16",)})

    def resolver(script, args, arm, environ, world=None):  # --manual-gc also derives an interval; --bf16 is given already
        noop = {"bf16": True} if "--bf16" in args else {}
        return _record(arm, **({"manual_gc_interval": 0} if "--manual-gc" in arm.added_args else {}), **noop)

    calls = []
    with pytest.raises(confounds.ConfoundError) as info:
        confounds.resolve_and_check(lambda *a: calls.append(a[2].name) or resolver(*a), "s.py", ["--bf16"],
                                    design_of("t", arms), {})
    assert sorted(calls) == ["+gc", "+noop", "baseline"]  # no extra probe runs
    assert "identical Megatron arguments" in str(info.value)
    _, derived = confounds.resolve_and_check(resolver, "s.py", ["--bf16"], design_of("t", arms[:2]), {})
    assert derived == {"+gc": {"manual_gc", "manual_gc_interval"}}


def test_candidates_end_to_end_carry_each_argument_once(tmp_path):
    assert _run_main(tmp_path, "--repeats", "2", "--candidate", "gc=--manual-gc --manual-gc-interval 5",
                     design=("--design", "candidates")) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["arm"] for r in data["rows"]] == ["baseline", "+gc"]
    argv = data["commands"]["+gc"]["argv"]
    assert argv[-3:] == ["--manual-gc", "--manual-gc-interval", "5"] and argv.count("--manual-gc") == 1
    assert "--manual-gc" not in data["commands"]["baseline"]["argv"]


def test_set_args_takes_switches_and_lists_whole():
    argv = ["--overlap-grad-reduce", "--lr", "1", "--data-path", "a", "b", "--bf16"]
    assert ablate_runs.set_args(argv, {"--overlap-grad-reduce": None, "--data-path": "c"}) == [
        "--lr", "1", "--bf16", "--data-path", "c"]


def test_set_args_replaces_each_flag_once():
    argv = ["--train-iters", "10", "--tensorboard-dir=/a", "--bf16", "--train_iters", "12", "--lr", "1"]
    got = ablate_runs.set_args(argv, {"--train-iters": "20", "--tensorboard-dir": "/b", "--save": None})
    assert got == ["--bf16", "--lr", "1", "--train-iters", "20", "--tensorboard-dir", "/b"]
    assert ablate_runs.repeated_flags(["--lr", "1", "--lr", "2", "--bf16"]) == ["--lr"]


# --- block order -----------------------------------------------------------------------------------


def test_block_order_is_a_seeded_shuffle_per_block():
    orders = [schedule.block_order(7, b, 6) for b in range(40)]
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert orders == [schedule.block_order(7, b, 6) for b in range(40)]  # the same seed: the same blocks
    assert orders != [schedule.block_order(8, b, 6) for b in range(40)]
    assert len({tuple(o) for o in orders}) > 20  # blocks are shuffled anew, not one order repeated
    first = [o[0] for o in orders]
    assert all(first.count(i) >= 2 for i in range(6))  # every arm gets to run first now and then


# --- the command end to end, with a stand-in Megatron -------------------------------------------------

FAKE = f"{sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"


def _run_main(tmp_path, *extra, env=None, monkeypatch=None, clock=None, design=("--design", "one-at-a-time",
              "--toggles", "grad_reduce_in_bf16")):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    if monkeypatch is not None:
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
    argv = [*design, "--out", str(tmp_path / "out"), "--launch", FAKE, *extra, str(script),
            "--", "--seq-length", "4096"]
    kwargs = {"clock": clock} if clock else {}
    return ablate.main(argv, resolver=_fake_megatron(), **kwargs)


def test_repeats_blocks_warmup_and_results(tmp_path, capsys):
    assert _run_main(tmp_path, "--repeats", "3", "--seed", "5", "--iters", "8", "--warmup", "2") == 0
    out = tmp_path / "out"
    data = json.loads((out / "results.json").read_text())
    assert data["seed"] == 5 and data["blocks_run"] == 3 and data["iters"] == 8 and data["warmup"] == 2
    arms = ["all-off", "only:grad_reduce_in_bf16"]
    assert data["block_order"] == [[arms[i] for i in schedule.block_order(5, b, 2)] for b in range(3)]
    runs = data["runs"]
    assert [r["block"] for r in runs] == [-1, 0, 0, 1, 1, 2, 2]  # one warm-up, then 3 blocks of 2
    assert [r["arm"] for r in runs[1:]] == [a for block in data["block_order"] for a in block]
    assert all(len(r["iterations"]) == 8 for r in runs)
    assert runs[1]["iterations"][0] == {"iteration": 1, "ms_per_iter": runs[1]["iterations"][0]["ms_per_iter"],
                                        "tflops_per_gpu": runs[1]["iterations"][0]["tflops_per_gpu"],
                                        "lm_loss": 9.5, "grad_norm": 1.234, "global_batch_size": 16.0}
    assert all(r["command"].count("--train-iters") == 1 for r in runs)
    base, fast = data["rows"]
    assert base["ms_per_iter"] == {"median": 1000.0, "min": 1000.0, "max": 1000.0, "runs": 3}
    assert fast["speedup"]["estimate"] == pytest.approx(1000 / 900) and fast["speedup"]["verdict"] == "faster"
    assert fast["loss"]["ratio"] == 1.0 and fast["loss"]["blocks"] == 3
    assert fast["tokens_per_s_per_gpu"] == pytest.approx(16 * 4096 / 0.9)
    assert fast["max_allocated_mb"] == 200.5
    md = (out / "results.md").read_text()
    assert "| only:grad_reduce_in_bf16 | 3 | 900.0 |" in md and "| faster |" in md and "verdict" in md
    assert "8 iterations per run; medians over iterations after the first 2" in md
    assert "seed 5" in md and "3 block(s)" in md
    err = capsys.readouterr().err
    assert "7 runs: 1 unmeasured warm-up run, then 3 block(s) x 2 arms (arm order: --seed 5); 8 iterations per run" in err
    # a second call resumes: every run is done with the same command
    assert _run_main(tmp_path, "--repeats", "3", "--seed", "5", "--iters", "8", "--warmup", "2") == 0
    err = capsys.readouterr().err
    assert err.count("done earlier, skipped") == 7
    assert "(in an earlier call): every run of the --repeats blocks is done" in err and "0 runs" not in err


def test_noise_gives_an_interval_and_a_no_op_no_verdict(tmp_path, monkeypatch):
    # ddp_average_in_collective does not change the stand-in's speed: a planted no-op under drift.
    assert _run_main(tmp_path, "--repeats", "4", env={"FAKE_DRIFT": "0.05"}, monkeypatch=monkeypatch,
                     design=("--design", "one-at-a-time", "--toggles", "ddp_average_in_collective")) == 0
    row = json.loads((tmp_path / "out" / "results.json").read_text())["rows"][1]
    sp = row["speedup"]
    assert sp["blocks"] == 4 and sp["low"] < sp["estimate"] < sp["high"]
    assert sp["verdict"] in ("no detectable difference", "faster", "slower")
    assert row["ms_per_iter"]["min"] < row["ms_per_iter"]["max"]  # the drift shows in the spread
    assert row["blocks_to_resolve"]["blocks"] >= 2


def test_failed_runs_are_named_with_their_last_lines(tmp_path, monkeypatch, capsys):
    code = _run_main(tmp_path, "--repeats", "2", "--no-warmup-run", env={"FAKE_CRASH_ARM": "1"},
                     monkeypatch=monkeypatch)
    assert code == 1
    err = capsys.readouterr().err
    assert "FAILED: only:grad_reduce_in_bf16 (block 1), exit code 1" in err
    assert "FAILED: only:grad_reduce_in_bf16 (block 2), exit code 1" in err
    assert "    RuntimeError: CUDA error: an illegal memory access" in err
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Failed runs" in md and "**only:grad_reduce_in_bf16 (block 1)**: exit code 1" in md
    assert "RuntimeError: CUDA error: an illegal memory access" in md
    assert "| only:grad_reduce_in_bf16 | 0 (2 failed) |" in md and "too few blocks" in md


def test_error_tail_starts_at_the_last_traceback():
    text = "\n".join([*(f"line {i}" for i in range(40)), "Traceback (most recent call last):", "  x",
                      "ValueError: boom"])
    assert execution.error_tail(text) == ["Traceback (most recent call last):", "  x", "ValueError: boom"]
    assert execution.error_tail("\n".join(f"l{i}" for i in range(30)), lines=3) == ["l27", "l28", "l29"]


def test_dry_run_writes_and_creates_nothing(tmp_path, capsys, monkeypatch):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code = ablate.main(["--design", "headline", "--toggles", "grad_reduce_in_bf16,ddp_average_in_collective",
                        "--out", str(tmp_path / "new" / "out"), "--launch", FAKE, "--dry-run", "--iters", "9",
                        str(script), "--", "--train-iters", "5", "--tensorboard-dir", "/tb", "--lr", "1e-4"],
                       resolver=_fake_megatron())
    assert code == 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    out = capsys.readouterr().out
    assert "block 1: " in out and "block 3: " in out
    commands = [ln for ln in out.splitlines() if "megatron_perf_toggles.run" in ln]
    assert len(commands) == 2
    for line in commands:
        words = line.split()
        for flag in ("--train-iters", "--tensorboard-dir", "--lr"):
            assert words.count(flag) == 1, (flag, line)
        assert words[words.index("--train-iters") + 1] == "9"


def test_target_ci_adds_blocks_until_max_repeats(tmp_path, monkeypatch, capsys):
    assert _run_main(tmp_path, "--repeats", "2", "--no-warmup-run", "--target-ci", "0.0001", "--max-repeats", "4",
                     env={"FAKE_DRIFT": "0.03"}, monkeypatch=monkeypatch) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 4 and "--max-repeats 4" in data["stop_reason"]


def test_target_ci_stops_when_narrow_enough(tmp_path):
    # no drift: the interval is a point after 2 blocks, so no block beyond --repeats runs
    assert _run_main(tmp_path, "--repeats", "2", "--no-warmup-run", "--target-ci", "0.01") == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 2 and "within +-1 %" in data["stop_reason"]


def test_budget_stops_before_a_block_that_would_not_fit(tmp_path):
    ticks = iter(range(0, 100000, 50))  # every look at the clock: 50 s later
    assert _run_main(tmp_path, "--repeats", "5", "--budget", "3", clock=lambda: next(ticks)) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert 0 < data["blocks_run"] < 5 and "--budget 3 min" in data["stop_reason"]
    assert "Stopped: --budget 3 min" in (tmp_path / "out" / "results.md").read_text()


def test_a_budget_spent_before_the_first_block_says_it_was_timed_by_the_warm_up(tmp_path):
    assert _run_main(tmp_path, "--repeats", "2", "--budget", "0.0001", clock=lambda: 0.0) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 0 and "block 1 (about" in data["stop_reason"]
    assert "timed by the warm-up run alone" in data["stop_reason"]


def test_a_resumed_block_is_priced_by_its_runs_not_done_earlier(tmp_path, capsys):
    """A second call after a first one used its budget up goes on: blocks done earlier cost
    nothing; only the runs still to do count against --budget."""
    assert _run_main(tmp_path, "--repeats", "2") == 0
    for status in (tmp_path / "out" / "runs").glob("*/*/status.json"):  # as if each run took 100 s
        data = json.loads(status.read_text())
        status.write_text(json.dumps({**data, "seconds": 100.0}))
    capsys.readouterr()
    assert _run_main(tmp_path, "--repeats", "3", "--budget", "1", clock=lambda: 0.0) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 2  # both done earlier, then block 3 (2 runs, 200 s) does not fit 60 s
    assert data["stop_reason"] == "--budget 1 min: block 3 (about 3.3 min) would not fit after 0.0 min"
    assert capsys.readouterr().err.count("done earlier, skipped") == 5
    (tmp_path / "out" / "runs" / "block02" / ablate_runs._slug("all-off") / "status.json").unlink()
    assert _run_main(tmp_path, "--repeats", "2", "--budget", "1", clock=lambda: 0.0) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 1
    assert data["stop_reason"] == ("--budget 1 min: block 2 (about 1.7 min, 1 of its 2 runs still to do) would not fit "
                                   "after 0.0 min")


def test_a_block_with_nothing_left_to_run_never_stops_the_call(tmp_path):
    assert _run_main(tmp_path, "--repeats", "2") == 0
    ticks = iter(range(0, 10**6, 1000))  # every look at the clock: 1000 s later, far past the budget
    assert _run_main(tmp_path, "--repeats", "3", "--budget", "1", clock=lambda: next(ticks)) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 2  # both done earlier: nothing to price; block 3 does not fit
    assert data["stop_reason"].startswith("--budget 1 min: block 3 (about")
    assert "warm-up" not in data["stop_reason"]


def test_the_warm_up_note_only_where_its_price_stopped_the_first_block(tmp_path):
    ticks = iter(range(0, 10**6, 1000))  # the time used is past the budget whatever the price
    assert _run_main(tmp_path, "--repeats", "2", "--budget", "1", clock=lambda: next(ticks)) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 0 and "block 1 (about" in data["stop_reason"]
    assert "warm-up" not in data["stop_reason"]


def test_without_a_warm_up_run_a_resumed_first_block_is_priced_by_its_runs_done_earlier(tmp_path):
    assert _run_main(tmp_path, "--repeats", "1", "--no-warmup-run") == 0
    for status in (tmp_path / "out" / "runs").glob("*/*/status.json"):  # as if each run took 100 s
        status.write_text(json.dumps({**json.loads(status.read_text()), "seconds": 100.0}))
    (tmp_path / "out" / "runs" / "block01" / ablate_runs._slug("all-off") / "status.json").unlink()
    assert _run_main(tmp_path, "--repeats", "1", "--no-warmup-run", "--budget", "1", clock=lambda: 0.0) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 0
    assert data["stop_reason"] == ("--budget 1 min: block 1 (about 1.7 min, 1 of its 2 runs still to do) would not "
                                   "fit after 0.0 min")


def test_a_resumed_call_without_a_warm_up_run_says_an_earlier_call_had_one(tmp_path):
    assert _run_main(tmp_path, "--repeats", "1") == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["warmup_run"] is True
    assert _run_main(tmp_path, "--repeats", "2", "--no-warmup-run") == 0  # resumes: block 2 only
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 2 and data["warmup_run"] is True  # the first call's warm-up run came first
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert _run_main(fresh, "--repeats", "1", "--no-warmup-run") == 0
    assert json.loads((fresh / "out" / "results.json").read_text())["warmup_run"] is False


def test_a_failed_warm_up_run_prices_nothing(tmp_path, monkeypatch, capsys):
    """A crash takes a second or two: as a price it would start a block of real runs that cannot
    fit. The first block then starts unpriced, and its failures are reported as any others."""
    code = _run_main(tmp_path, "--repeats", "1", "--budget", "0.0001", env={"FAKE_CRASH_ARM": "0"},
                     monkeypatch=monkeypatch, clock=lambda: 0.0)
    assert code == 1  # the baseline failed in every block
    err = capsys.readouterr().err
    assert "the warm-up run failed after" in err and "it prices nothing" in err
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["blocks_run"] == 1 and data["stop_reason"] is None
    assert data["warmup_run"] is False  # asked for, but it did not finish


def test_plot_or_clear_note(tmp_path):
    assert _run_main(tmp_path, "--repeats", "2") == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    note = report.plot(result, tmp_path / "p.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in note
    else:
        assert note is None and (tmp_path / "p.png").stat().st_size > 1000


def test_gpu_count_is_the_runs_logged_world_size_else_the_launchers(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("using world size: 16, data-parallel size: 16\n")
    measured, said = execution.measure({"arm": "all-off", "status": "done", "log": str(log)}, 3)
    assert said == parse_file(str(log)).world_size == 16  # the log is read once, its world with the rest

    def gpus(arm, launch):
        return analysis.runs_world(execution.logged_world([measured], [said], arm), ExperimentSpec(launch=launch))

    assert gpus("all-off", "srun -n 2") == 16  # what ran, not what the prefix says
    assert gpus("all-on", "torchrun --nnodes=2 --nproc_per_node=4") == 8  # not this arm's log
    assert analysis.runs_world(execution.logged_world([], [], "all-off"), ExperimentSpec()) == 1
    assert analysis.runs_world(None, ExperimentSpec(launch="deepspeed --num_gpus 8")) is None  # unknown, not guessed


def test_a_plain_python_launch_gets_what_torchrun_would_set():
    """Megatron initialises torch.distributed from the environment even for one process: a
    ``--launch python`` run without MASTER_ADDR fails at start-up, so ablate supplies it."""
    def single_process_env(launch, stated, environ):
        return ablate_runs.single_process_env(ExperimentSpec(launch=launch, world_size=stated), environ)

    given = single_process_env("python3", None, {"PATH": "/bin"})
    assert given["MASTER_ADDR"] == "127.0.0.1" and given["RANK"] == "0" and given["WORLD_SIZE"] == "1"
    assert given["MASTER_PORT"].isdigit() and given["LOCAL_RANK"] == "0"
    assert single_process_env(None, None, {}).keys() == given.keys()  # this python
    kept = single_process_env("env FOO=1 python", None, {"MASTER_PORT": "29611"})
    assert "MASTER_PORT" not in kept and kept["MASTER_ADDR"] == "127.0.0.1"  # the caller's value stands
    for launcher in ("torchrun --nproc-per-node 1", "python -m torch.distributed.run --nproc-per-node 1",
                     "srun -n 1", "bash wrapper.sh"):
        assert single_process_env(launcher, None, {}) == {}, launcher  # they set their own, or may
    assert single_process_env("python", 8, {}) == {}  # a stated world of 8 is not one process


def test_the_experiments_runs_get_the_single_process_variables(tmp_path):
    (tmp_path / "s.py").write_text("")
    spec = ExperimentSpec(script=str(tmp_path / "s.py"), launch="python3", out=str(tmp_path / "out"))
    arms = design_of("one-at-a-time", expand("one-at-a-time", ("grad_reduce_in_bf16",), []))
    environ = ablate_runs.resolved(spec, arms, {"PATH": "/bin", "RANK": "0"}, _fake_megatron()).environ
    assert environ["MASTER_ADDR"] == "127.0.0.1" and environ["PATH"] == "/bin"
    assert "MASTER_ADDR" not in ablate_runs.runs_environ(ExperimentSpec(launch="torchrun --nproc-per-node 1"),
                                                         {"PATH": "/bin"})


def test_each_run_gets_its_own_logs_and_checkpoints(tmp_path):
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])
    effective = {"save": "/ck", "load": "/ck", "wandb_save_dir": "/wb"}
    runs = [ablate_runs.make_run(tmp_path, a, b, None, "s.py", ["--save", "/ck", "--load", "/ck"], effective)
            for a in arms for b in (-1, 0, 1)]
    dirs = {str(r.directory) for r in runs}
    assert len(dirs) == 6
    for r in runs:
        c = r.command
        here = str(r.directory)
        assert c.count("--save") == 1 and c.count("--load") == 1 and c.count("--tensorboard-dir") == 1
        assert c[c.index("--save") + 1].startswith(here) and c[c.index("--load") + 1] == c[c.index("--save") + 1]
        assert c[c.index("--tensorboard-dir") + 1].startswith(here) and "--wandb-save-dir" in c
    shared = ablate_runs.arm_paths({"save": "/ck", "load": "/pretrained"}, tmp_path)
    assert "--load" not in shared  # a pretrained start is only read: shared by every run
    assert "--save" not in ablate_runs.arm_paths({}, tmp_path)  # no --save given: no checkpoints written


def test_dry_runs_run_as_rank_zero(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, capture_output, text, env, timeout):
        seen.update(env)
        return type("P", (), {"returncode": 0, "stdout": "{}", "stderr": ""})()

    monkeypatch.setattr(ablate_runs.subprocess, "run", fake_run)
    arm = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])[1]
    ablate_runs.resolve_arm("pretrain_gpt.py", [], arm, {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "PATH": "/bin"})
    assert seen["RANK"] == "0" and "LOCAL_RANK" not in seen and "WORLD_SIZE" not in seen
    assert seen["GRAD_REDUCE_IN_BF16"] == "1"


def test_dry_run_timeout_is_a_clear_error(monkeypatch):
    def slow(*a, **k):
        raise ablate_runs.subprocess.TimeoutExpired("x", 1)

    monkeypatch.setattr(ablate_runs.subprocess, "run", slow)
    arm = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])[0]
    with pytest.raises(confounds.ConfoundError, match="took over"):
        ablate_runs.resolve_arm("pretrain_gpt.py", [], arm, {})


def test_missing_launcher_is_refused_before_running(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    with pytest.raises(SystemExit) as info:
        ablate.main(["--design", "one-at-a-time", "--toggles", "grad_reduce_in_bf16", "--out", str(tmp_path / "o"),
                     "--launch", "no-such-torchrun --nproc-per-node 8", str(script)], resolver=_fake_megatron())
    assert info.value.code == 2 and "'no-such-torchrun' is not an executable" in capsys.readouterr().err


def _run_in_order(runs, environ, progress):
    """Each run in order, as experiment() runs a block (a crash is recorded and the rest go on)."""
    return [execution.execute(run, environ, progress, i, len(runs) - i) for i, run in enumerate(runs, start=1)]


def test_torn_status_file_reruns_the_run(tmp_path):
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])
    runs = [ablate_runs.make_run(tmp_path, a, 0, FAKE, "s.py", [], {}) for a in arms]
    runs[0].directory.mkdir(parents=True)
    (runs[0].directory / "status.json").write_text('{"status": "do')
    statuses = _run_in_order(runs, {"PATH": "/usr/bin:/bin"}, execution.Progress(2, io.StringIO()))
    assert [s["status"] for s in statuses] == ["done", "done"]


def test_progress_line(tmp_path):
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])
    runs = [ablate_runs.make_run(tmp_path, a, 0, FAKE, "s.py", [], {}) for a in arms]
    stream = io.StringIO()
    _run_in_order(runs, {"PATH": "/usr/bin:/bin"}, execution.Progress(2, stream, live=True))
    text = stream.getvalue()
    assert "[run 2/2]" in text and "(block 1)" in text and "it 6/6" in text and "ETA" in text
    assert text.count("\r") == 12  # redrawn at every iteration
    stream = io.StringIO()  # a log file: one line per run
    runs = [ablate_runs.make_run(tmp_path / "again", a, 0, FAKE, "s.py", [], {}) for a in arms]
    _run_in_order(runs, {"PATH": "/usr/bin:/bin"}, execution.Progress(2, stream))
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 2 and "it 6/6" in lines[1] and "done in" in lines[1]


def test_only_the_separating_double_dash_is_dropped():
    ns = argparse.Namespace(megatron_args=["--", "--num-layers", "4", "--", "x"], script="s.py")
    assert ExperimentSpec.from_options(ns).megatron_args == ["--num-layers", "4", "--", "x"]
    ns = argparse.Namespace(megatron_args=["--num-layers", "4"], script="s.py")
    assert ExperimentSpec.from_options(ns).megatron_args == ["--num-layers", "4"]


def test_candidate_flags_are_checked_as_flags_not_dests():
    """``--no-...`` switches store into a dest of another name: a candidate's flags are looked up
    among Megatron's option strings (the recorded surface), --vary names among its dests."""
    dests, flags = known_args()
    assert "--no-create-attention-mask-in-dataloader" in flags and "create_attention_mask_in_dataloader" in dests
    assert parse_candidates(["mask=--no-create-attention-mask-in-dataloader"], flags)
    with pytest.raises(DesignError, match="not a Megatron argument: --create-attention-mask-in-dataloader"):
        parse_candidates(["mask=--create-attention-mask-in-dataloader"], flags)


def test_dry_runs_plan_for_the_world_the_runs_will_have():
    def resolver(script, args, arm, environ, world=None):
        return world

    arm = expand("headline", ("grad_reduce_in_bf16",), [])[0]
    for launch, stated, planned, note in [
        (None, None, None, "one process"),
        ("torchrun --nproc-per-node 8", None, 8, "a world of 8 (from --launch)"),
        ("torchrun --nproc-per-node 4 --nnodes 2", 8, 8, "a world of 8 (from --world-size)"),
        ("srun python", None, None, "say it with --world-size"),
        ("srun python", 16, 16, "a world of 16 (from --world-size)"),
    ]:
        spec = ExperimentSpec(launch=launch, world_size=stated)
        bound, said = ablate_runs.planned(resolver, spec), spec.world_words
        assert bound("s.py", [], arm, {}) == planned and note in said
    # --world-size wins where given: the launcher's number may miss a launcher nested in a script
    spec = ExperimentSpec(launch="torchrun --nproc-per-node 8", world_size=16)
    bound, said = ablate_runs.planned(resolver, spec), spec.world_words
    assert bound("s.py", [], arm, {}) == 16 and said == "a world of 16 (from --world-size; --launch looks like 8)"
    assert launch_world_size("srun -n 2 torchrun --nproc-per-node 8") is None  # nodes x 8, not 2
    assert launch_world_size("mpirun -np 2 python -m torch.distributed.run --nproc-per-node 4") is None
    assert launch_world_size("torchrun --nproc-per-node 0") is None
    assert launch_world_size("env NCCL_DEBUG=INFO A=b torchrun --nproc-per-node 8") == 8
    assert launch_world_size("env -u A torchrun --nproc-per-node 8") is None  # env's options: not read
    assert ablate_runs.dry_run_command("s.py", ["--lr", "1"], arm, 8)[3:8] == ["--dry-run", "--json", "--world-size", "8",
                                                                          "s.py"]
    assert "--world-size" not in ablate_runs.dry_run_command("s.py", ["--lr", "1"], arm, 1)


def test_a_bad_world_size_is_exit_2_before_anything_is_created(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    with pytest.raises(SystemExit) as info:
        ablate.main(["--design", "headline", "--out", str(tmp_path / "o"), "--world-size", "0", str(script)],
                    resolver=_fake_megatron())
    assert info.value.code == 2 and "--world-size 0: at least 1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_runs_whose_logged_world_differs_from_the_planned_one_are_flagged(tmp_path, monkeypatch, capsys):
    assert _run_main(tmp_path, "--repeats", "1", env={"FAKE_WORLD_SIZE": "4"}, monkeypatch=monkeypatch) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["world_size"] == 4 and data["planned_world_size"] == 1
    assert "the runs had a world of 4, the dry runs planned for 1: say --world-size 4" in capsys.readouterr().err


def test_a_launch_prefix_may_not_set_what_an_arm_sets(tmp_path, capsys):
    script = str(tmp_path / "pretrain_gpt.py")
    (tmp_path / "pretrain_gpt.py").write_text("")
    common = ["--out", str(tmp_path / "o"), "--dry-run"]
    toggle = ["--design", "one-at-a-time", "--toggles", "grad_reduce_in_bf16", *common]
    candidate = ["--design", "candidates", "--candidate", "ring=NCCL_ALGO=Ring", *common]
    for design, launch, clash in [
        (toggle, f"env GRAD_REDUCE_IN_BF16=1 {sys.executable}", "GRAD_REDUCE_IN_BF16"),
        (candidate, f"env NCCL_ALGO=Tree {sys.executable}", "NCCL_ALGO"),
        (candidate, f"env NCCL_DEBUG=INFO {sys.executable}", None),  # not an arm's variable
        (candidate, f"env -u X NCCL_ALGO=Tree {sys.executable}", None),  # env's options end the scan
    ]:
        argv = [*design, "--launch", launch, script]
        if clash is None:
            assert ablate.main(argv, resolver=_fake_megatron()) == 0
            continue
        with pytest.raises(SystemExit) as info:
            ablate.main(argv, resolver=_fake_megatron())
        assert info.value.code == 2 and f"--launch sets {clash} for every run" in capsys.readouterr().err


def test_the_warm_up_estimate_says_when_target_ci_may_add_blocks(tmp_path, capsys):
    assert _run_main(tmp_path, "--repeats", "2", "--target-ci", "0.01", "--max-repeats", "4") == 0
    assert "(--target-ci may add blocks)" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    assert _run_main(tmp_path / "b", "--repeats", "2", "--target-ci", "0.01", "--max-repeats", "2") == 0
    err = capsys.readouterr().err
    assert "the warm-up run took" in err and "may add blocks" not in err  # --max-repeats leaves no room
