"""ablate's loss experiments: seeds as blocks, the loss window against the seed-to-seed band, runs at
once, and the each-alone design (stock, each toggle alone and the defaults in the same blocks)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO
from test_ablate import _fake_megatron, _record

from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate import confounds
from megatron_perf_toggles.tools.ablate import loss_window as lw
from megatron_perf_toggles.tools.ablate import runs as ablate_runs
from megatron_perf_toggles.tools.ablate.design import DEFAULT_TOGGLES, Arm, DesignError, expand

FAKE = f"{sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"
TOGGLE = "grad_reduce_in_bf16"  # the stand-in run is faster with it on (900 ms against 1000)


# --- the each-alone design --------------------------------------------------------------------


def test_each_alone_is_stock_each_alone_and_the_defaults():
    named = DEFAULT_TOGGLES[:2]
    arms = expand("each-alone", named, [])
    assert [a.name for a in arms] == ["all-off", *(f"only:{d}" for d in named), "defaults"]
    assert arms[0].baseline and not any(a.baseline for a in arms[1:])
    assert all(v is False for v in arms[0].pinned().values()) and set(arms[0].pinned()) == set(DEFAULT_TOGGLES)
    assert arms[1].pinned() == {**dict.fromkeys(DEFAULT_TOGGLES, False), named[0]: True}
    # the defaults arm: every toggle, named or not, at the registry's default
    assert arms[-1].pinned() == {d: BY_DEST[d].default is True for d in DEFAULT_TOGGLES}
    assert all(arms[-1].pinned().values())  # today every on/off toggle defaults on


def test_each_alone_rest_and_toggles_in_neither_are_pinned_off():
    named, rest, neither = DEFAULT_TOGGLES[:1], DEFAULT_TOGGLES[1:2], DEFAULT_TOGGLES[2:]
    arms = expand("each-alone", named, [], rest=rest)
    defaults = arms[-1]
    assert defaults.pinned() == {named[0]: True, rest[0]: True, **dict.fromkeys(neither, False)}
    assert all(a.pinned()[d] is False for a in arms for d in neither)  # a toggle a guard turns off stays off
    with pytest.raises(DesignError, match="--others on"):
        expand("each-alone", named, [], others="on")
    with pytest.raises(DesignError, match="nothing to compare"):
        expand("each-alone", (), [])


def test_the_confound_check_accepts_each_alone_and_learns_what_the_defaults_arm_derives():
    arms = expand("each-alone", (TOGGLE,), [])
    derives = {TOGGLE: ("accumulate_allreduce_grads_in_fp32", False, True)}
    records, derived = confounds.resolve_and_check(_fake_megatron(derives), "x.py", [], arms, {})
    assert derived[TOGGLE] == {"accumulate_allreduce_grads_in_fp32"}
    assert all(v["value"] is True for v in records[-1]["decisions"].values())  # the defaults arm: all on
    assert all(derived[d] == set() for d in DEFAULT_TOGGLES if d != TOGGLE)
    # a difference that no toggle makes alone is still refused in the defaults arm
    bad = [_record(a, stray=1 if a.name == "defaults" else 0) for a in arms]
    with pytest.raises(confounds.ConfoundError, match="arm defaults differs"):
        confounds.check_confounds(arms, bad, {})


# --- the loss window ---------------------------------------------------------------------------


def _run(arm, block, losses, status="done"):
    its = [{"iteration": i + 1, "lm_loss": v} for i, v in enumerate(losses)]
    return {"arm": arm, "block": block, "status": status, "iterations": its}


def test_windowed_mean_is_over_the_last_n_logged_iterations():
    run = _run("a", 0, [9.0, 5.0, 3.0, 1.0])
    assert lw.windowed_mean(run, 2) == 2.0 and lw.windowed_mean(run, 3) == 3.0 and lw.windowed_mean(run, 99) == 4.5
    assert lw.windowed_mean(None, 2) is None and lw.windowed_mean({"iterations": [{"iteration": 1}]}, 2) is None


def test_verdict_needs_a_band_and_every_seed_within_it():
    assert lw.band_of([2.0, 2.3, 2.1]) == pytest.approx(0.3)
    assert lw.band_of([2.0, None]) is None
    assert lw.verdict([0.1, -0.29], 0.3) == lw.WITHIN
    assert lw.verdict([0.1, -0.31], 0.3) == lw.OUTSIDE  # one seed outside is enough
    assert lw.verdict([0.0], None) == lw.TOO_FEW and lw.verdict([None, None], 0.3) == lw.TOO_FEW


def test_compare_windows_pairs_each_seed_with_the_baseline_s_own():
    arms = [Arm("all-off", {TOGGLE: False}, baseline=True), Arm("on", {TOGGLE: True})]
    runs = [_run("all-off", 0, [4.0, 2.0]), _run("all-off", 1, [4.0, 2.5]),
            _run("on", 0, [4.0, 2.4]), _run("on", 1, [4.0, 2.6]), _run("on", 2, [0.0, 0.0])]
    out = lw.compare_windows(arms, runs, 2, 1, [7, 8])
    assert out["all-off"]["losses"] == [2.0, 2.5] and out["all-off"]["band"] == 0.5
    assert "verdict" not in out["all-off"] and out["on"]["seeds"] == [7, 8]
    assert out["on"]["differences"] == pytest.approx([0.4, 0.1]) and out["on"]["verdict"] == lw.WITHIN
    runs[2] = _run("on", 0, [4.0, 2.6])  # seed 7 moved by 0.6, more than the band of 0.5
    assert lw.compare_windows(arms, runs, 2, 1, [7, 8])["on"]["verdict"] == lw.OUTSIDE
    one = lw.compare_windows(arms, runs, 1, 1, [7])["on"]  # one seed: the numbers, no verdict
    assert one["verdict"] == lw.TOO_FEW and one["differences"] == pytest.approx([0.6])


# --- end to end with the stand-in Megatron -----------------------------------------------------


def _main(tmp_path, *extra, design=("--design", "one-at-a-time", "--toggles", TOGGLE)):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = [*design, "--out", str(tmp_path / "out"), "--launch", FAKE, *extra, str(script), "--",
            "--seq-length", "4096", "--seed", "99"]
    return ablate.main(argv, resolver=_fake_megatron())


def test_seeds_as_blocks_and_the_loss_window_in_the_results(tmp_path, monkeypatch):
    # the stand-in's loss: + 0.01 x (seed mod 10), and + 0.005 with the toggle on
    monkeypatch.setenv("FAKE_SEED_LOSS", "0.01")
    monkeypatch.setenv("FAKE_LOSS_SHIFT", f"{TOGGLE.upper()}=0.005")
    assert _main(tmp_path, "--repeats", "3", "--iters", "6", "--warmup", "2", "--block-seeds", "40",
                 "--loss-window", "2") == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["block_seeds"] == [40, 41, 42] and data["loss_window"] == 2
    for run in data["runs"]:
        cmd = run["command"]
        assert cmd.count("--seed") == 1 and cmd[cmd.index("--seed") + 1] == str(40 + max(run["block"], 0))
    base, on = (r["loss_window"] for r in data["rows"])
    # the last two iterations of 10 - 0.5 i at i = 5, 6: mean 7.25, plus the seed's and the toggle's shift
    assert base["losses"] == pytest.approx([7.25, 7.26, 7.27]) and base["band"] == pytest.approx(0.02)
    assert on["differences"] == pytest.approx([0.005] * 3) and on["verdict"] == lw.WITHIN
    md = (tmp_path / "out" / "results.md").read_text()
    assert "## Loss over the last 2 iterations" in md and "| seed 40 | seed 41 | seed 42 |" in md
    assert f"| only:{TOGGLE} |" in md and lw.WITHIN in md


def test_a_loss_shift_beyond_the_band_is_outside_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SEED_LOSS", "0.01")
    monkeypatch.setenv("FAKE_LOSS_SHIFT", f"{TOGGLE.upper()}=0.05")
    assert _main(tmp_path, "--repeats", "2", "--iters", "6", "--warmup", "2", "--block-seeds", "0",
                 "--loss-window", "3", "--no-warmup-run") == 0
    row = json.loads((tmp_path / "out" / "results.json").read_text())["rows"][1]["loss_window"]
    assert row["band"] == pytest.approx(0.01) and row["verdict"] == lw.OUTSIDE
    assert row["largest_difference"] == pytest.approx(0.05)


def test_runs_at_once_keep_losses_and_memory_but_no_speed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SEED_LOSS", "0.01")
    assert _main(tmp_path, "--repeats", "2", "--iters", "6", "--warmup", "2", "--block-seeds", "1",
                 "--loss-window", "2", "--concurrent", "4", design=("--design", "each-alone", "--toggles", TOGGLE)) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["concurrent"] == 4 and "shared the GPU" in data["speed_note"] and data["sizing"] is None
    assert [r["block"] for r in data["runs"]] == [0, 0, 0, 1, 1, 1]  # no warm-up run
    assert data["warmup_run"] is False and data["blocks_run"] == 2
    for row in data["rows"]:
        assert not {"ms_per_iter", "speedup", "tflops_per_gpu", "tokens_per_s_per_gpu"} & set(row)
        assert row["max_allocated_mb"] == 200.5 and row["loss_window"]["losses"]
    assert [r["arm"] for r in data["rows"]] == ["all-off", f"only:{TOGGLE}", "defaults"]
    assert "Speed: not measured" in (tmp_path / "out" / "results.md").read_text()
    assert "6 runs: 2 block(s)" in capsys.readouterr().err
    # the same command resumes: nothing runs again
    assert _main(tmp_path, "--repeats", "2", "--iters", "6", "--warmup", "2", "--block-seeds", "1",
                 "--loss-window", "2", "--concurrent", "4", design=("--design", "each-alone", "--toggles", TOGGLE)) == 0
    assert capsys.readouterr().err.count("done earlier, skipped") == 6


def test_runs_at_once_really_overlap_each_with_its_own_port(tmp_path):
    """Each stand-in waits until all of the batch have started: it ends only if they run at once."""
    wait = ("import os, sys, time, pathlib; d = pathlib.Path(sys.argv[1]); "
            "(d / os.environ['MASTER_PORT']).write_text(''); end = time.time() + 60\n"
            "while len(list(d.iterdir())) < 3 and time.time() < end: time.sleep(0.05)\n"
            "sys.exit(0 if len(list(d.iterdir())) == 3 else 3)")
    (tmp_path / "meet").mkdir()
    batch = [ablate_runs.Run(Arm(f"a{i}", {}), 0, tmp_path / f"r{i}",
                             [sys.executable, "-c", wait, str(tmp_path / "meet")]) for i in range(3)]
    statuses = ablate_runs.execute_together(batch, {}, 40100, 0, 3)
    assert [s["status"] for s in statuses] == ["done"] * 3
    assert sorted(p.name for p in (tmp_path / "meet").iterdir()) == ["40100", "40101", "40102"]


def test_a_batch_that_would_not_fit_the_budget_is_not_started(tmp_path):
    ticks = iter(range(0, 100000, 100))  # every look at the clock: 100 s later
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--design", "one-at-a-time", "--toggles", TOGGLE, "--out", str(tmp_path / "out"), "--launch", FAKE,
            "--repeats", "3", "--concurrent", "2", "--budget", "3", "--iters", "4", "--warmup", "1", str(script)]
    assert ablate.main(argv, resolver=_fake_megatron(), clock=lambda: next(ticks)) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(data["runs"]) == 4 and data["blocks_run"] == 2 and "runs at once" in data["stop_reason"]


@pytest.mark.parametrize("extra, words", [
    (("--concurrent", "0"), "--concurrent 0"),
    (("--loss-window", "0"), "--loss-window 0"),
    (("--loss-window", "9", "--iters", "6"), "--loss-window 9 is more than --iters 6"),
    (("--block-seeds", "-1"), "--block-seeds -1"),
    (("--concurrent", "2", "--target-ci", "0.01"), "--target-ci needs timed runs"),
])
def test_bad_loss_options_are_one_line_and_exit_2(tmp_path, capsys, extra, words):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    with pytest.raises(SystemExit) as info:
        ablate.main(["--design", "headline", *extra, str(script)],
                    resolver=lambda *a: pytest.fail("must not resolve arms on bad input"))
    err = capsys.readouterr().err
    assert info.value.code == 2 and words in err and "Traceback" not in err


def test_the_options_are_in_help(capsys):
    with pytest.raises(SystemExit):
        ablate.main(["--help"])
    out = capsys.readouterr().out
    for words in ("--block-seeds BASE", "--loss-window N", "--concurrent K", "each-alone"):
        assert words in out


def test_each_run_gets_its_own_checkpoints_and_at_once_its_own_dataset_cache(tmp_path):
    """The paths come from each arm's resolved arguments (what Megatron would save to, read from)."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--design", "one-at-a-time", "--toggles", TOGGLE, "--out", str(tmp_path / "out"), "--launch", FAKE,
            "--repeats", "1", "--concurrent", "2", "--iters", "4", "--warmup", "1", str(script), "--", "--save", "/ck"]
    resolver = lambda script, args, arm, environ, world=None: _record(arm, save="/ck", data_path=["/corpus"])  # noqa: E731
    assert ablate.main(argv, resolver=resolver) == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    for run in runs:
        cmd, here = run["command"], str(tmp_path / "out" / "runs" / "block01")
        assert cmd.count("--save") == 1 and cmd[cmd.index("--save") + 1].startswith(here)
        assert cmd[cmd.index("--data-cache-path") + 1].startswith(here)
    assert len({r["command"][r["command"].index("--data-cache-path") + 1] for r in runs}) == 2


def test_split_blocks_stop_before_a_run_and_the_same_command_finishes_the_block(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--design", "one-at-a-time", "--toggles", TOGGLE, "--out", str(tmp_path / "out"), "--launch", FAKE,
            "--repeats", "3", "--budget", "3", "--split-blocks", "--iters", "4", "--warmup", "1", str(script)]

    def call():
        ticks = iter(range(50, 100000, 50))  # every look at the clock: 50 s later
        return ablate.main(argv, resolver=_fake_megatron(), clock=lambda: next(ticks) - 50)

    assert call() == 0
    first = json.loads((tmp_path / "out" / "results.json").read_text())
    # the warm-up run, block 1, then block 2's first run: its second would end after 3 min
    assert [r["block"] for r in first["runs"]] == [-1, 0, 0, 1] and first["blocks_run"] == 1
    assert "stopped before run 2 of 2 of the block" in first["stop_reason"]
    assert call() == 0
    again = json.loads((tmp_path / "out" / "results.json").read_text())
    assert again["blocks_run"] == 3 and again["blocks_across_calls"] == [2] and again["stop_reason"] is None
    assert "Blocks whose runs ran in two calls (--split-blocks): 2." in (tmp_path / "out" / "results.md").read_text()
    assert capsys.readouterr().err.count("done earlier, skipped") == 4  # the warm-up run, block 1, block 2's first
    with pytest.raises(SystemExit) as info:
        at = argv.index("--budget")
        ablate.main(argv[:at] + argv[at + 2:], resolver=_fake_megatron())
    assert info.value.code == 2 and "--split-blocks needs --budget" in capsys.readouterr().err
