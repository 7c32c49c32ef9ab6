"""The ablation harness: design expansion, bad input, confound check, running, resume, measuring."""

from __future__ import annotations

import io
import json
import sys

import pytest
from conftest import REPO

from megatron_perf_toggles import ablate
from megatron_perf_toggles.ablate_design import DEFAULT_TOGGLES, DesignError, expand, parse_toggles, parse_vary


def test_one_at_a_time():
    arms = expand("one-at-a-time", DEFAULT_TOGGLES, [])
    assert len(arms) == len(DEFAULT_TOGGLES) + 1 == 6
    assert arms[0].baseline and not any(arms[0].toggles.values())
    for arm, dest in zip(arms[1:], DEFAULT_TOGGLES, strict=True):
        assert [d for d, v in arm.toggles.items() if v] == [dest]


def test_leave_one_out():
    arms = expand("leave-one-out", DEFAULT_TOGGLES, [])
    assert len(arms) == 6 and all(arms[0].toggles.values())
    for arm, dest in zip(arms[1:], DEFAULT_TOGGLES, strict=True):
        assert [d for d, v in arm.toggles.items() if not v] == [dest]


def test_factorial_reproduces_the_2x2():
    arms = expand("factorial", ("grad_reduce_in_bf16",), parse_vary(["adam_eps=1e-8,1e-5"], {"adam_eps"}))
    got = {(a.toggles["grad_reduce_in_bf16"], a.settings["adam_eps"]) for a in arms}
    assert got == {(False, "1e-8"), (True, "1e-8"), (False, "1e-5"), (True, "1e-5")}
    assert sum(a.baseline for a in arms) == 1
    assert arms[1].extra_args() == ["--adam-eps", "1e-8"]
    assert arms[1].env() == {"GRAD_REDUCE_IN_BF16": "1"}


def test_factorial_over_three_toggles():
    assert len(expand("factorial", DEFAULT_TOGGLES[:3], [])) == 8


def test_every_arm_sets_every_design_toggle_explicitly():
    for design in ("one-at-a-time", "leave-one-out", "factorial"):
        for arm in expand(design, DEFAULT_TOGGLES[:2], []):
            assert set(arm.env()) == {"GRADIENT_ACCUMULATION_FUSION", "GRAD_REDUCE_IN_BF16"}


@pytest.mark.parametrize("call, words", [
    (lambda: parse_vary(["adam_epz=1e-8,1e-5"], {"adam_eps"}), "unknown name 'adam_epz'"),
    (lambda: parse_vary(["grad_reduce_in_bf16=0,1"], {"adam_eps"}), "through --toggles"),
    (lambda: parse_vary(["adam_eps=1e-8"], {"adam_eps"}), "at least two values"),
    (lambda: parse_vary(["adam_eps"], {"adam_eps"}), "NAME=V1,V2"),
    (lambda: parse_toggles("grad_reduce_in_bf16,warp_speed"), "unknown toggle 'warp_speed'"),
    (lambda: parse_toggles(","), "empty"),
    (lambda: expand("random", DEFAULT_TOGGLES, []), "unknown design"),
    (lambda: expand("one-at-a-time", (), []), "nothing to compare"),
    (lambda: expand("one-at-a-time", DEFAULT_TOGGLES, parse_vary(["lr=1e-4,2e-4"], {"lr"})), "--design factorial"),
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
    ]:
        with pytest.raises(SystemExit) as info:
            ablate.main(argv, resolver=lambda *a: pytest.fail("must not resolve arms on bad input"))
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err


# --- confound check on synthetic records (the real-tree version is in test_ablate_real.py) -------


def _record(arm, **extra):
    effective = {"seq_length": 4096, "adam_eps": 1e-8, "seed": 1234, **arm.toggles, **extra}
    decisions = {d: {"value": v, "source": "env", "reason": "x"} for d, v in arm.toggles.items()}
    return {"decisions": decisions, "effective_args": effective}


def test_clean_arms_pass():
    arms = expand("one-at-a-time", DEFAULT_TOGGLES[:2], [])
    ablate.check_confounds(arms, [_record(a) for a in arms])


def test_extra_difference_is_refused_with_a_diff():
    arms = expand("one-at-a-time", DEFAULT_TOGGLES[:2], [])
    records = [_record(a) for a in arms]
    records[2]["effective_args"]["adam_eps"] = 1e-5
    with pytest.raises(ablate.ConfoundError) as info:
        ablate.check_confounds(arms, records)
    assert "adam_eps: all-off=1e-08" in str(info.value) and "1e-05" in str(info.value)


def test_guard_forced_arm_is_refused_with_the_guard_reason():
    arms = expand("factorial", ("gradient_accumulation_fusion",), [])
    records = [_record(a) for a in arms]
    for rec in records:  # --use-torch-fsdp2: the guard turns fusion off in every arm
        rec["decisions"]["gradient_accumulation_fusion"] = {
            "value": False, "source": "guard", "reason": "--use-torch-fsdp2: FSDP does not support it"}
        rec["effective_args"]["gradient_accumulation_fusion"] = False
    with pytest.raises(ablate.ConfoundError, match="--use-torch-fsdp2"):
        ablate.check_confounds(arms, records)


def test_values_derived_from_an_intended_variable_are_allowed(monkeypatch):
    monkeypatch.setitem(ablate.DERIVED, "grad_reduce_in_bf16", ("main_grads_dtype",))
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])
    records = [_record(a, main_grads_dtype="bf16" if a.toggles["grad_reduce_in_bf16"] else "fp32") for a in arms]
    ablate.check_confounds(arms, records)


# --- running, resume, failures, measuring -------------------------------------------------------


def _arms_and_commands(tmp_path):
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])
    launch = f"{sys.executable} {REPO / 'tests' / 'fake_megatron_run.py'}"
    cmds = [ablate.arm_command(launch, "pretrain_gpt.py", ["--seq-length", "4096"], a) for a in arms]
    return arms, cmds


def test_runs_measures_and_reports(tmp_path):
    arms, cmds = _arms_and_commands(tmp_path)
    stream = io.StringIO()
    statuses = ablate.run_arms(arms, cmds, tmp_path, {"PATH": "/usr/bin:/bin"}, ablate.Progress(2, stream))
    assert [s["status"] for s in statuses] == ["done", "done"]
    assert "[arm 2/2]" in stream.getvalue() and "it 6/6" in stream.getvalue() and "ETA" in stream.getvalue()
    rows = ablate.measure(arms, statuses, warmup=2, seq_length=4096, gpus=1)
    base, fast = rows
    assert base["ms_per_iter"]["median"] == 1000.0 and fast["ms_per_iter"]["median"] == 900.0
    assert fast["speedup_vs_baseline"] == pytest.approx(1000 / 900)
    assert fast["ms_per_iter"]["min"] == 895.0 and fast["ms_per_iter"]["max"] == 905.0
    assert fast["tokens_per_s_per_gpu"] == pytest.approx(16 * 4096 / 0.9)
    assert fast["loss_at_last_common_iteration"] == {"iteration": 6, "loss": 7.0, "baseline_loss": 7.0, "ratio": 1.0}
    assert fast["memory_mb"]["max_allocated"] == 200.5
    ablate.write_results(tmp_path, "one-at-a-time", rows, [{}, {}], cmds, arms)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["commands"]["only:grad_reduce_in_bf16"]["env"] == {"GRAD_REDUCE_IN_BF16": "1"}
    assert "| only:grad_reduce_in_bf16 | done | 900.0 |" in (tmp_path / "results.md").read_text()


def test_resume_skips_finished_arms_and_failed_arm_does_not_stop_others(tmp_path):
    arms, cmds = _arms_and_commands(tmp_path)
    counter = tmp_path / "runs.txt"
    env = {"PATH": "/usr/bin:/bin", "FAKE_COUNTER": str(counter), "FAKE_CRASH_ARM": "0"}
    quiet = ablate.Progress(2, io.StringIO())
    first = ablate.run_arms(arms, cmds, tmp_path, env, quiet)
    assert [s["status"] for s in first] == ["failed", "done"]
    assert any("illegal memory access" in line for line in first[0]["error_tail"])
    rows = ablate.measure(arms, first, warmup=1, seq_length=4096, gpus=1)
    assert rows[0]["status"] == "failed" and rows[0]["error_tail"]
    env["FAKE_CRASH_ARM"] = "never"
    second = ablate.run_arms(arms, cmds, tmp_path, env, ablate.Progress(2, io.StringIO()))
    assert [s["status"] for s in second] == ["done", "done"]
    assert counter.read_text().split() == ["0", "1", "0"]  # the done arm ran once; the failed one again


def test_plot_or_clear_note(tmp_path):
    arms, cmds = _arms_and_commands(tmp_path)
    statuses = ablate.run_arms(arms, cmds, tmp_path, {"PATH": "/usr/bin:/bin"}, ablate.Progress(2, io.StringIO()))
    rows = ablate.measure(arms, statuses, 1, 4096, 1)
    note = ablate.plot(rows, tmp_path / "results.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in note
    else:
        assert note is None and (tmp_path / "results.png").stat().st_size > 1000


def test_gpu_count_from_launch():
    assert ablate._gpus(None) == 1
    assert ablate._gpus("torchrun --nproc-per-node 8") == 8
    assert ablate._gpus("torchrun --nnodes=2 --nproc_per_node=4") == 8


def test_each_arm_gets_its_own_logs_and_checkpoints(tmp_path):
    arms = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])
    effective = {"save": "/ck", "load": "/ck", "wandb_save_dir": "/wb"}
    paths = [ablate.arm_paths(effective, ablate.arm_dir(tmp_path, a)) for a in arms]
    assert paths[0] != paths[1]
    for a, p in zip(arms, paths, strict=True):
        here = str(ablate.arm_dir(tmp_path, a))
        assert p[p.index("--save") + 1].startswith(here) and p[p.index("--load") + 1] == p[p.index("--save") + 1]
        assert p[p.index("--tensorboard-dir") + 1].startswith(here) and "--wandb-save-dir" in p
    shared = ablate.arm_paths({"save": "/ck", "load": "/pretrained"}, ablate.arm_dir(tmp_path, arms[0]))
    assert "--load" not in shared  # a pretrained start is only read: shared by every arm


def test_dry_runs_run_as_rank_zero(tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, capture_output, text, env, timeout):
        seen.update(env)
        return type("P", (), {"returncode": 0, "stdout": "{}", "stderr": ""})()

    monkeypatch.setattr(ablate.subprocess, "run", fake_run)
    arm = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])[1]
    ablate.resolve_arm("pretrain_gpt.py", [], arm, {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "PATH": "/bin"})
    assert seen["RANK"] == "0" and "LOCAL_RANK" not in seen and "WORLD_SIZE" not in seen
    assert seen["GRAD_REDUCE_IN_BF16"] == "1"


def test_dry_run_timeout_is_a_clear_error(monkeypatch):
    def slow(*a, **k):
        raise ablate.subprocess.TimeoutExpired("x", 1)

    monkeypatch.setattr(ablate.subprocess, "run", slow)
    arm = expand("one-at-a-time", ("grad_reduce_in_bf16",), [])[0]
    with pytest.raises(ablate.ConfoundError, match="took over"):
        ablate.resolve_arm("pretrain_gpt.py", [], arm, {})


def test_missing_launcher_is_refused_before_running(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")

    def resolver(script, args, arm, environ):
        return {"decisions": {d: {"value": v} for d, v in arm.toggles.items()},
                "effective_args": {"seed": 1, **arm.toggles}}

    with pytest.raises(SystemExit) as info:
        ablate.main(["--design", "one-at-a-time", "--toggles", "grad_reduce_in_bf16", "--out", str(tmp_path / "o"),
                     "--launch", "no-such-torchrun --nproc-per-node 8", str(script)], resolver=resolver)
    assert info.value.code == 2 and "'no-such-torchrun' is not an executable" in capsys.readouterr().err


def test_torn_status_file_reruns_the_arm(tmp_path):
    arms, cmds = _arms_and_commands(tmp_path)
    ablate.arm_dir(tmp_path, arms[0]).mkdir(parents=True)
    (ablate.arm_dir(tmp_path, arms[0]) / "status.json").write_text('{"status": "do')
    statuses = ablate.run_arms(arms, cmds, tmp_path, {"PATH": "/usr/bin:/bin"}, ablate.Progress(2, io.StringIO()))
    assert [s["status"] for s in statuses] == ["done", "done"]
