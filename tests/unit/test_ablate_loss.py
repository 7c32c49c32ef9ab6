"""ablate's loss experiments: seeds as blocks, the loss test (paired by seed, an equivalence margin,
three verdicts) through the real command on stand-in runs with planted effects, runs at once, and
the each-alone design (stock, each toggle alone and the defaults in the same blocks)."""

from __future__ import annotations

import json
import statistics
import sys

import pytest
from conftest import REPO
from test_ablate import _fake_megatron, _record

from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.core.registry import TOGGLES as REGISTRY_TOGGLES
from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate import confounds, execution, report
from megatron_perf_toggles.tools.ablate import runs as ablate_runs
from megatron_perf_toggles.tools.ablate.design import DEFAULT_TOGGLES, Arm, DesignError, design_of, expand
from megatron_perf_toggles.tools.ablate.loss import loss_test as lt

FAKE = f"{sys.executable} {REPO / 'tests' / 'support' / 'fake_megatron_run.py'}"
TOGGLE = "grad_reduce_in_bf16"  # the stand-in run is faster with it on (900 ms against 1000)


# --- the each-alone design --------------------------------------------------------------------


def test_each_alone_is_stock_each_alone_and_the_defaults():
    named = DEFAULT_TOGGLES[:2]
    arms = expand("each-alone", named, [])
    assert [a.name for a in arms] == ["all-off", *(f"only:{d}" for d in named), "defaults"]
    assert arms[0].baseline and not any(a.baseline for a in arms[1:])
    assert all(v is False for v in arms[0].pinned.values()) and set(arms[0].pinned) == set(DEFAULT_TOGGLES)
    assert arms[1].pinned == {**dict.fromkeys(DEFAULT_TOGGLES, False), named[0]: True}
    # the defaults arm: every toggle, named or not, at the registry's default
    assert arms[-1].pinned == {d: BY_DEST[d].default is True for d in DEFAULT_TOGGLES}


def test_each_alone_rest_and_toggles_in_neither_are_pinned_off():
    named, rest, neither = DEFAULT_TOGGLES[:1], DEFAULT_TOGGLES[1:2], DEFAULT_TOGGLES[2:]
    arms = expand("each-alone", named, [], rest=rest)
    defaults = arms[-1]
    assert defaults.pinned == {named[0]: True, rest[0]: True, **dict.fromkeys(neither, False)}
    assert all(a.pinned[d] is False for a in arms for d in neither)  # a toggle a guard turns off stays off
    with pytest.raises(DesignError, match="--others on"):
        expand("each-alone", named, [], others="on")
    with pytest.raises(DesignError, match="nothing to compare"):
        expand("each-alone", (), [])


def test_the_confound_check_accepts_each_alone_and_learns_what_the_defaults_arm_derives():
    arms = expand("each-alone", (TOGGLE,), [])
    derives = {TOGGLE: ("accumulate_allreduce_grads_in_fp32", False, True)}
    records, derived = confounds.resolve_and_check(_fake_megatron(derives), "x.py", [], design_of("t", arms), {})
    assert derived[TOGGLE] == {"accumulate_allreduce_grads_in_fp32"}
    # the defaults arm: every toggle at the registry's default
    assert all(v["value"] is (BY_DEST[d].default is True) for d, v in records[-1]["decisions"].items() if d in BY_DEST)
    assert all(derived.get(d, set()) == set() for d in DEFAULT_TOGGLES if d != TOGGLE)
    # a difference that no toggle makes alone is still refused in the defaults arm
    bad = [_record(a, stray=1 if a.name == "defaults" else 0) for a in arms]
    with pytest.raises(confounds.ConfoundError, match="arm defaults differs"):
        confounds.check_confounds(design_of("t", arms), bad, {})


# --- the loss measure --------------------------------------------------------------------------


def _run(arm, block, losses, status="done", validation=None):
    its = [{"iteration": i + 1, "lm_loss": v} for i, v in enumerate(losses)]
    out = {"arm": arm, "block": block, "status": status, "iterations": its}
    if validation is not None:
        out["validation"] = [{"iteration": len(losses), "lm_loss": validation}]
    return out


def test_train_window_mean_is_over_the_last_n_logged_iterations():
    run = _run("a", 0, [9.0, 5.0, 3.0, 1.0])
    assert lt.train_window_mean(run, 2) == 2.0 and lt.train_window_mean(run, 3) == 3.0
    assert lt.train_window_mean(run, 99) == 4.5 and lt.train_window_mean(run, None) == 1.0  # a tenth: 1 of 4
    assert lt.train_window_mean(None, 2) is None and lt.train_window_mean({"iterations": [{"iteration": 1}]}, 2) is None


def test_auto_takes_the_validation_loss_only_where_every_run_logged_one():
    with_val = [_run("a", 0, [3.0, 2.0], validation=2.5), _run("b", 0, [3.0, 2.2], validation=2.6)]
    assert lt.resolve_measure("auto", with_val) == lt.VALIDATION
    assert lt.resolve_measure("auto", [*with_val, _run("c", 0, [3.0, 2.1])]) == lt.TRAIN_WINDOW
    assert lt.resolve_measure("train-window", with_val) == lt.TRAIN_WINDOW
    assert lt.measure_of(with_val[1], lt.VALIDATION, 1) == 2.6 and lt.measure_of(with_val[1], lt.TRAIN_WINDOW, 1) == 2.2


def test_the_table_names_each_arm_by_its_toggle():
    arms = expand("each-alone", DEFAULT_TOGGLES[:2], [])
    base = arms[0]
    assert [lt.toggle_name(a, base) for a in arms] == ["baseline", *DEFAULT_TOGGLES[:2], "defaults"]
    loo = expand("leave-one-out", DEFAULT_TOGGLES[:2], [])
    assert lt.toggle_name(loo[1], loo[0]) == DEFAULT_TOGGLES[0]  # without:x names x


def test_a_toggle_that_redraws_the_initial_weights_is_compared_unpaired():
    assert [t.dest for t in REGISTRY_TOGGLES if t.redraws_init] == ["moe_grouped_gemm"]
    base = Arm("all-off", {"moe_grouped_gemm": False, "moe_permute_fusion": False}, baseline=True)
    gg = Arm("only:moe_grouped_gemm", {"moe_grouped_gemm": True, "moe_permute_fusion": False})
    pf = Arm("only:moe_permute_fusion", {"moe_grouped_gemm": False, "moe_permute_fusion": True})
    # each seed's shared part is large (2.0, 3.0, 4.0): paired it cancels, unpaired it does not
    runs = [_run(a, b, [v]) for a, vals in (("all-off", (2.0, 3.0, 4.0)), ("only:moe_grouped_gemm", (2.0, 3.0, 4.0)),
                                             ("only:moe_permute_fusion", (2.0, 3.0, 4.0))) for b, v in enumerate(vals)]
    out = lt.compare_losses([base, gg, pf], runs, 3, measure="auto", window=1, margin=1.0, alpha=0.05,
                            seeds=[1, 2, 3])
    assert out["settings"]["measure"] == lt.TRAIN_WINDOW and out["settings"]["interval"] == pytest.approx(0.9)
    paired, unpaired = out["arms"]["only:moe_permute_fusion"], out["arms"]["only:moe_grouped_gemm"]
    assert paired["paired"] and paired["differences"] == [0.0, 0.0, 0.0] and paired["verdict"] == "equivalent within +-1 %"
    assert not unpaired["paired"] and "moe_grouped_gemm draws the initial weights" in unpaired["unpaired_because"]
    assert unpaired["verdict"] == "inconclusive" and unpaired["low"] < -1.0 < 1.0 < unpaired["high"]
    assert out["arms"]["all-off"]["toggle"] == "baseline" and "verdict" not in out["arms"]["all-off"]


# --- end to end with the stand-in Megatron -----------------------------------------------------


def _main(tmp_path, *extra, design=("--design", "one-at-a-time", "--toggles", TOGGLE)):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = [*design, "--out", str(tmp_path / "out"), "--launch", FAKE, *extra, str(script), "--",
            "--seq-length", "4096", "--seed", "99"]
    return ablate.main(argv, resolver=_fake_megatron())


HARMED, NULL = TOGGLE, "ddp_average_in_collective"  # the planted 3 % harm, and an arm that changes nothing
PLANTED = {"FAKE_LOSS_SEED_SD": "0.05", "FAKE_LOSS_SCALE": f"{HARMED.upper()}=1.03"}


def _planted(tmp_path, monkeypatch, seeds, noise, *extra):
    for k, v in {**PLANTED, "FAKE_LOSS_NOISE": noise}.items():
        monkeypatch.setenv(k, v)
    assert _main(tmp_path, "--repeats", str(seeds), "--iters", "6", "--warmup", "2", "--block-seeds", "100",
                 "--loss-window", "3", "--concurrent", "12", *extra,
                 design=("--design", "one-at-a-time", "--toggles", f"{HARMED},{NULL}")) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    return data, {r["arm"]: r["loss_test"] for r in data["rows"]}


def _loss_table(md):
    """The rows of results.md's loss table, by their first cell, with the header's cells."""
    lines = md.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("## ") and "Loss" in ln)
    table = [ln for ln in lines[at:] if ln.startswith("|")]
    head = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True)) for ln in table[2:]]
    return head, rows


def test_sixteen_seeds_call_a_planted_3_pct_harm_worse_and_a_null_equivalent(tmp_path, monkeypatch, capsys):
    data, loss = _planted(tmp_path, monkeypatch, 16, "0.004")
    harm, null = loss[f"only:{HARMED}"], loss[f"only:{NULL}"]
    assert harm["verdict"] == "different: worse" and harm["seeds_compared"] == 16 and harm["paired"]
    assert harm["low"] < 3.0 < harm["high"]  # the planted +3 % lies in its interval
    assert harm["measure"] == "train-window" and harm["seeds"] == list(range(100, 116))
    assert len(harm["values"]) == len(harm["differences"]) == 16 and harm["seeds_needed"] >= 2
    assert null["verdict"] == "equivalent within +-1 %" and null["seeds_compared"] == 16
    # the seeds differ a lot (sd 5 %), same-seed arms little: the baseline's own values spread wide
    base = loss["all-off"]["values"]
    assert (max(base) - min(base)) / min(base) > 0.05
    assert data["loss_test"]["seeds"] == list(range(100, 116)) and data["loss_test"]["measure"] == "train-window"
    head, rows = _loss_table((tmp_path / "out" / "results.md").read_text())
    assert "verdict" in head
    assert {r[head[0]]: r["verdict"] for r in rows} == {HARMED: "different: worse", NULL: "equivalent within +-1 %"}
    out = capsys.readouterr().out
    assert f"loss: {HARMED} (only:{HARMED}): " in out and out.count("loss: ") == 2


def test_three_noisy_seeds_are_inconclusive_and_say_what_a_margin_needs(tmp_path, monkeypatch, capsys):
    _, loss = _planted(tmp_path, monkeypatch, 3, "0.03")
    null = loss[f"only:{NULL}"]
    assert null["verdict"] == "inconclusive" and null["seeds_compared"] == 3
    assert null["smallest_margin_shown"] > 1.0 and null["seeds_needed"] > 3
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(f"loss: {NULL} "))
    assert "inconclusive (smallest margin shown" in line and f"needs about {null['seeds_needed']} seeds" in line


def test_the_validation_loss_is_the_measure_where_every_run_logged_one(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VALIDATION", "3")
    data, loss = _planted(tmp_path, monkeypatch, 2, "0")
    assert data["loss_test"]["measure"] == "validation" and data["loss_test"]["window"] is None
    run = next(r for r in data["runs"] if r["arm"] == "all-off" and r["block"] == 0)
    # the stand-in's validation loss: the training loss at the last iteration plus 0.25 (its test set's: plus 5)
    assert loss["all-off"]["values"][0] == pytest.approx(run["iterations"][-1]["lm_loss"] + 0.25, abs=1e-5)
    assert [v["iteration"] for v in run["validation"]] == [3, 6, 6]
    _, asked = _planted(tmp_path, monkeypatch, 2, "0", "--loss-measure", "train-window")
    assert asked["all-off"]["values"][0] == pytest.approx(statistics.fmean(
        it["lm_loss"] for it in run["iterations"][-3:]), abs=1e-5)


def test_runs_at_once_keep_losses_and_memory_but_no_speed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SEED_LOSS", "0.01")
    assert _main(tmp_path, "--repeats", "2", "--iters", "6", "--warmup", "2", "--block-seeds", "1",
                 "--loss-window", "2", "--concurrent", "4", design=("--design", "each-alone", "--toggles", TOGGLE)) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["concurrent"] == 4 and "shared the GPU" in data["speed_note"] and data["sizing"] is None
    assert [r["block"] for r in data["runs"]] == [0, 0, 0, 1, 1, 1]
    # no common start for a compile warm-up to ride with: none (a wave of its own would cost more than it saves)
    assert data["warmup_run"] is False and data["blocks_run"] == 2 and data["compile_warmup"] is None
    for row in data["rows"]:
        assert not {"ms_per_iter", "speedup", "tflops_per_gpu", "tokens_per_s_per_gpu"} & set(row)
        assert row["max_allocated_mb"] == 200.5 and row["loss_test"]["values"]
    assert [r["arm"] for r in data["rows"]] == ["all-off", f"only:{TOGGLE}", "defaults"]
    assert "Speed: not measured" in (tmp_path / "out" / "results.md").read_text()
    assert "6 runs: 2 block(s) x 3 arms" in capsys.readouterr().err
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
    batch = [ablate_runs.Run(f"a{i}", 0, tmp_path / f"r{i}", [sys.executable, "-c", wait, str(tmp_path / "meet")],
                             Arm(f"a{i}", {}).env) for i in range(3)]
    statuses = execution.execute_together(batch, {}, 40100, 0, 3)
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
    (("--loss-margin", "0"), "--loss-margin 0.0"),
    (("--loss-margin", "-1"), "--loss-margin -1.0"),
    (("--loss-alpha", "0.5"), "--loss-alpha 0.5"),
    (("--loss-alpha", "0"), "--loss-alpha 0.0"),
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
    for words in ("--block-seeds BASE", "--loss-window N", "--concurrent K", "each-alone", "--loss-margin PCT",
                  "--loss-alpha ALPHA", "--loss-measure"):
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


def test_an_existing_out_directory_is_re_analysed_without_running_anything(tmp_path, monkeypatch, capsys):
    from megatron_perf_toggles.tools.ablate import reanalyse

    _planted(tmp_path, monkeypatch, 16, "0.004")
    moved = tmp_path / "copied"  # as copied from the machine that ran it: the logs are not where they were
    (tmp_path / "out").rename(moved)
    data = json.loads((moved / "results.json").read_text())
    # an earlier version's results: a band verdict per row, no loss test
    del data["loss_test"]
    for row in data["rows"]:
        row["loss_window"] = {"window": 3, "band": 0.1, "verdict": "old"}
        del row["loss_test"]
    (moved / "results.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert reanalyse.main([str(moved), "--loss-margin", "5"]) == 0
    again = json.loads((moved / "results.json").read_text())
    loss = {r["arm"]: r["loss_test"] for r in again["rows"]}
    assert all("loss_window" not in r for r in again["rows"]) and again["loss_test"]["margin"] == 5.0
    assert loss[f"only:{HARMED}"]["verdict"] == "equivalent within +-5 %"  # +3 % lies well inside +-5 %
    assert loss[f"only:{HARMED}"]["seeds_compared"] == 16 and again["loss_test"]["window"] == 3
    assert "equivalent within +-5 %" in (moved / "results.md").read_text()
    assert json.loads((moved / "results.before-reanalysis.json").read_text()) == data
    assert capsys.readouterr().out.count("loss: ") == 2
    with pytest.raises(SystemExit) as info:
        reanalyse.main([str(moved), "--loss-alpha", "0.7"])
    assert info.value.code == 2 and "--loss-alpha 0.7" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        reanalyse.main([str(tmp_path / "nothing-here")])
    assert info.value.code == 2 and "no readable results.json" in capsys.readouterr().err


# --- a common start: one saved state per seed ---------------------------------------------------

GG = "moe_grouped_gemm"  # the registry's toggle that draws the initial weights another way


def _gg(tmp_path, monkeypatch, *extra, fmt="torch_dist", megatron=()):
    """Stock against grouped GEMM alone on 8 seeds; the stand-in redraws a grouped-GEMM run's seed part
    unless it loads a start (FAKE_LOSS_REDRAW), as Transformer Engine's grouped experts do."""
    for k, v in {"FAKE_LOSS_SEED_SD": "0.05", "FAKE_LOSS_NOISE": "0.001", "FAKE_LOSS_REDRAW": GG.upper()}.items():
        monkeypatch.setenv(k, v)
    # no guard plan here: the stand-in has no Transformer Engine for the planner to find, and the
    # test is about the runs, so grouped GEMM stays in
    monkeypatch.setattr("megatron_perf_toggles.tools.ablate.spec.leave_out", lambda toggles, *a, **k: toggles)
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--design", "one-at-a-time", "--toggles", GG, "--out", str(tmp_path / "out"), "--launch", FAKE,
            "--repeats", "8", "--iters", "6", "--warmup", "2", "--block-seeds", "100", "--loss-window", "3",
            "--concurrent", "8", *extra, str(script), "--", "--num-experts", "8", *megatron]
    resolver = lambda script, args, arm, environ, world=None: _record(arm, ckpt_format=fmt, num_experts=8)  # noqa: E731
    return ablate.main(argv, resolver=resolver)


def test_grouped_gemm_is_unpaired_without_a_common_start_and_paired_with_one(tmp_path, monkeypatch, capsys):
    assert _gg(tmp_path / "a", monkeypatch) == 0
    apart = json.loads((tmp_path / "a" / "out" / "results.json").read_text())["rows"][1]["loss_test"]
    assert not apart["paired"] and apart["verdict"] == "inconclusive"  # the seeds' 5 % spread does not cancel
    assert _gg(tmp_path / "b", monkeypatch, "--common-start") == 0
    data = json.loads((tmp_path / "b" / "out" / "results.json").read_text())
    same = data["rows"][1]["loss_test"]
    assert same["paired"] and same["verdict"] == "equivalent within +-1 %" and data["loss_test"]["common_start"]
    out = tmp_path / "b" / "out"
    assert sorted(data["common_start"]) == [str(b) for b in range(8)]
    assert all(s["status"] == "done" for s in data["common_start"].values())
    for run in data["runs"]:  # every run of a seed loads that seed's start, weights alone
        cmd = run["command"]
        seed = int(cmd[cmd.index("--seed") + 1])
        assert cmd[cmd.index("--load") + 1] == str(out / "runs" / "start" / f"seed{seed}" / "checkpoint")
        assert {"--finetune", "--no-load-optim", "--no-load-rng"} <= set(cmd) and cmd.count("--load") == 1
    start = data["common_start"]["3"]["command"]  # the baseline, one iteration, saved
    assert start[start.index("--seed") + 1] == "103" and start[start.index("--exit-interval") + 1] == "1"
    assert "--load" not in start and start[start.index("--save") + 1].endswith("seed103/checkpoint")
    assert "Unit: seeds (--block-seeds --common-start" in (out / "results.md").read_text()
    capsys.readouterr()
    assert _gg(tmp_path / "c", monkeypatch, "--common-start", "--dry-run") == 0  # the start is shown, not run
    shown = capsys.readouterr().out
    assert "common start of block 1 (the baseline, one iteration, saved):\n  MOE_GROUPED_GEMM=0 " in shown
    assert "seed100/checkpoint" in shown and not (tmp_path / "c" / "out").exists()
    from megatron_perf_toggles.tools.ablate import reanalyse

    assert reanalyse.loss_test_of(data)["arms"]["only:moe_grouped_gemm"]["paired"]  # re-analysed: still paired
    capsys.readouterr()
    assert _gg(tmp_path / "b", monkeypatch, "--common-start") == 0  # the same command: nothing runs again
    assert capsys.readouterr().err.count("done earlier, skipped") == 8 + 16


@pytest.mark.parametrize("extra, fmt, megatron, words", [
    ((), "torch_dist", (), "--common-start needs --block-seeds"),
    (("--block-seeds", "1"), "torch_dist", ("--load", "/ck"), "--common-start sets --load itself"),
    (("--block-seeds", "1"), "torch", (), "resolve to --ckpt-format torch, not torch_dist"),
])
def test_a_common_start_that_cannot_work_is_refused_before_any_run(tmp_path, capsys, extra, fmt, megatron, words):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    resolver = lambda script, args, arm, environ, world=None: _record(arm, ckpt_format=fmt)  # noqa: E731
    with pytest.raises(SystemExit) as info:
        ablate.main(["--design", "headline", "--toggles", TOGGLE, "--out", str(tmp_path / "out"), "--launch", FAKE,
                     "--common-start", *extra, str(script), "--", *megatron], resolver=resolver)
    assert info.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "out" / "runs").exists()


def test_a_common_start_changes_no_decision_of_the_plugin_s_resume_guards():
    """Every arm loads a start the baseline (every toggle off) saved: loaded as weights alone from a
    recorded torch_dist checkpoint, no guard may hold an arm's toggle at the saved value."""
    from test_moe_toggles import plan

    from megatron_perf_toggles.core.registry import TOGGLES as ALL

    start = {"load": "/out/runs/start/seed1/checkpoint", "finetune": True, "no_load_optim": True, "no_load_rng": True}
    saved_off = {"decisions": {t.dest: False for t in ALL if t.kind == "bool"}, "iteration": 1}
    fresh = plan({"ckpt_format": "torch_dist"}, checkpoint=None)
    loaded = plan({"ckpt_format": "torch_dist", **start}, checkpoint=saved_off)
    assert {d: v.value for d, v in loaded.decisions.items()} == {d: v.value for d, v in fresh.decisions.items()}
    assert loaded.decisions[GG].value is True
    # the same start in the torch format loads by module name: grouped GEMM is held at the saved layout,
    # which is why ablate refuses a common start in any format but torch_dist
    held = plan({"ckpt_format": "torch", **start}, checkpoint=saved_off)
    assert (held.decisions[GG].value, held.decisions[GG].source) == (False, "guard")


def test_blocks_that_repeat_one_seed_are_not_called_seeds():
    e = {"toggle": "t", "estimate": 0.1, "low": -0.2, "high": 0.4, "seeds_compared": 3, "paired": True,
         "verdict": "equivalent within +-1 %"}
    seeded = report.verdict_line("a", e, {"measure": "train-window", "seeded_blocks": True})
    one = report.verdict_line("a", e, {"measure": "train-window", "seeded_blocks": False})
    assert "3 seeds" in seeded and "one seed" not in seeded
    assert "3 blocks of one seed" in one and "no claim across seeds" in one
