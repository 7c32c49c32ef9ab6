"""ablate --concurrent's compile warm-up: one short run of each arm with runs left, the baseline's
too, made only where it rides in the waves of this call's common starts and adds no wave of its own
(its gain is modest: warm caches saved about 10 s of a defaults run), so that the runs that start
together find the compile caches warm. End to end through the stand-in Megatron, which traces when
each run starts and ends (FAKE_TRACE) and with which MASTER_PORT: runs of one wave each have a port
of their own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import REPO
from test_ablate import FAKE, _record
from test_concurrent_memory import GPU_MB, OVERHEAD_MB
from test_concurrent_memory import _ablate as _ablate_in_memory

from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate.runs import COMPILE_WARMUP_ITERS
from megatron_perf_toggles.tools.megatron_log import parse_file

TOGGLES = "grad_reduce_in_bf16,ddp_average_in_collective"  # one-at-a-time: all-off and two arms
ARMS = ["all-off", "only:grad_reduce_in_bf16", "only:ddp_average_in_collective"]
DIRS = [a.replace(":", "_") for a in ARMS]  # each run's directory is its arm's name, made safe for a path
WARM = "compile-warmup"  # the compile warm-ups' directory: OUT/runs/compile-warmup/ARM
START = ("--common-start",)
TORCH_DIST = {"ckpt_format": "torch_dist"}  # what --common-start needs of the dry run's record


def _main(tmp_path, monkeypatch, *extra, megatron=(), effective=None, toggles=TOGGLES, clock=None):
    """ablate through the stand-in with every run traced; its exit status and the trace of this call."""
    trace = tmp_path / "trace.txt"
    trace.unlink(missing_ok=True)
    monkeypatch.setenv("FAKE_TRACE", str(trace))
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--design", "one-at-a-time", "--toggles", toggles, "--out", str(tmp_path / "out"), "--launch", FAKE,
            "--iters", "6", "--warmup", "2", "--block-seeds", "1", *extra, str(script), "--", *megatron]
    resolver = lambda script, args, arm, environ, world=None: _record(arm, **(effective or {}))  # noqa: E731
    code = ablate.main(argv, resolver=resolver, **({"clock": clock} if clock else {}))
    return code, _trace(trace)


def _trace(path: Path) -> list[tuple[str, int, str, str]]:
    """(event, port, kind, name) per line: kind is compile-warmup, start or blockNN; name the arm or the seed."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        event, port, where = line.split(" ", 2)
        out.append((event, int(port), Path(where).parent.name, Path(where).name))
    return out


def _results(tmp_path):
    return json.loads((tmp_path / "out" / "results.json").read_text())


def _ran(trace, kind):
    return [name for event, _, k, name in trace if event == "start" and k == kind]


def _ports(trace, kinds):
    return [port for event, port, k, _ in trace if event == "start" and k in kinds]


def _most_at_once(trace):
    running = most = 0
    for event, *_ in trace:
        running += 1 if event == "start" else -1
        most = max(most, running)
    return most


def _before_measured(trace):
    """The trace up to the first measured run's start."""
    return trace[:next(i for i, (_, _, kind, _) in enumerate(trace) if kind.startswith("block"))]


def test_each_arm_the_baseline_too_warms_up_in_the_starts_wave_before_any_measured_run(tmp_path, monkeypatch,
                                                                                          capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", *START, effective=TORCH_DIST)
    assert code == 0
    # the baseline warms up too: its start runs stop after one iteration, a warm-up after two
    assert sorted(_ran(trace, WARM)) == sorted(DIRS) and sorted(_ran(trace, "start")) == ["seed1", "seed2"]
    ahead = _before_measured(trace)
    assert {kind for _, _, kind, _ in ahead} == {WARM, "start"}
    assert sum(1 for event, _, kind, _ in ahead if event == "end" and kind == WARM) == 3  # every warm-up ended before
    ports = _ports(ahead, {WARM, "start"})
    assert len(ports) == len(set(ports)) == 5  # one wave, the starts' own: each its own port
    data = _results(tmp_path)
    assert data["warmup_run"] is True and sorted(data["compile_warmup"]) == sorted(ARMS)
    assert [r["block"] for r in data["runs"]] == [0, 0, 0, 1, 1, 1]  # the warm-ups are measured nowhere
    runs = tmp_path / "out" / "runs"
    for arm, status in data["compile_warmup"].items():
        assert status["status"] == "done" and status["seconds"] > 0 and status["block"] == -1
        assert status["label"] == f"{arm} (compile warm-up)"
        cmd = status["command"]
        assert cmd[cmd.index("--exit-interval") + 1] == str(COMPILE_WARMUP_ITERS)
        assert "--save" not in cmd and "--load" not in cmd  # no checkpoint read or written
        assert cmd[cmd.index("--seed") + 1] == "1" and cmd[cmd.index("--train-iters") + 1] == "6"
        assert len(parse_file(status["log"]).iterations) == COMPILE_WARMUP_ITERS
        # a directory of their own, not the one-at-a-time warm-up run's (runs/warmup/BASELINE)
        assert Path(status["log"]).parent == runs / WARM / DIRS[ARMS.index(arm)]
    assert not (runs / "warmup").exists()
    measured = data["runs"][0]["command"]
    assert "--exit-interval" not in measured and measured[measured.index("--load") + 1].endswith("checkpoint")
    md = (tmp_path / "out" / "results.md").read_text()
    assert "after a compile warm-up (3 short unmeasured run(s) at once with the common starts" in md
    err = capsys.readouterr().err
    assert ("9 runs: 1 compile warm-up run of each arm first, at once with the common starts (no wave of its own), "
            "2 iterations each, unmeasured; then ") in err
    assert "[ablate] compile warm-up: 3 run(s) done in " in err


def test_what_reads_the_runs_directories_finds_the_compile_warm_ups(tmp_path, monkeypatch):
    """bench/run_breakdown.py reads runs/*/*/status.json and bench/moe_h200.py --collect copies runs/*/*/*."""
    assert _main(tmp_path, monkeypatch, "--repeats", "1", "--concurrent", "8", *START, effective=TORCH_DIST)[0] == 0
    sys.path.insert(0, str(REPO / "bench"))
    import moe_h200
    import run_breakdown

    found = [r for r in run_breakdown.runs_of(tmp_path / "out") if r["block"] == -1]
    assert sorted(r["label"] for r in found) == sorted(f"{a} (compile warm-up)" for a in ARMS)
    (tmp_path / "part").mkdir()
    (tmp_path / "out").rename(tmp_path / "part" / "loss")
    assert moe_h200.collect(tmp_path / "part", tmp_path / "small") == 0
    assert (tmp_path / "small" / "loss" / "runs" / WARM / DIRS[0] / "status.json").is_file()


def test_without_a_common_start_there_is_no_compile_warm_up_and_the_plan_says_why(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "4")
    assert code == 0 and _ran(trace, WARM) == [] and len(_ran(trace, "block01")) == 3
    assert not (tmp_path / "out" / "runs" / WARM).exists()
    data = _results(tmp_path)
    assert data["warmup_run"] is False and data["compile_warmup"] is None
    assert "with no warm-up run." in (tmp_path / "out" / "results.md").read_text()
    err = capsys.readouterr().err
    assert "6 runs, 4 at a time, no compile warm-up: no common starts to ride with;" in err
    assert "share the GPU, so no step time is measured; no compile warm-up: no common starts to ride with" in err


def test_warm_ups_that_would_add_a_wave_to_the_starts_are_not_made(tmp_path, monkeypatch, capsys):
    # 2 starts and 3 warm-ups, 2 at a time: the starts need 1 wave, with the warm-ups 3
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "2", *START, effective=TORCH_DIST)
    assert code == 0 and _ran(trace, WARM) == [] and sorted(_ran(trace, "start")) == ["seed1", "seed2"]
    ahead = _before_measured(trace)
    assert len(set(_ports(ahead, {"start"}))) == 2  # one wave of starts
    data = _results(tmp_path)
    assert data["warmup_run"] is False and data["compile_warmup"] is None
    assert "no compile warm-up: it would need a wave of its own" in capsys.readouterr().err
    # 4 starts and 2 warm-ups, 3 at a time: 2 waves either way, so the warm-ups ride in them
    (tmp_path / "b").mkdir()
    code, trace = _main(tmp_path / "b", monkeypatch, "--repeats", "4", "--concurrent", "3", *START,
                        toggles="grad_reduce_in_bf16", effective=TORCH_DIST)
    ahead = _before_measured(trace)
    assert code == 0 and len(_ran(ahead, WARM)) == 2 and len(_ran(ahead, "start")) == 4
    ports = _ports(ahead, {WARM, "start"})
    assert len(ports) == 6 and len(set(ports)) == 3  # two waves of three
    assert _most_at_once(trace) <= 3
    assert "at once with the common starts (no wave of its own), in 2 waves of at most 3" in capsys.readouterr().err


def test_only_the_arms_with_runs_left_warm_up(tmp_path, monkeypatch, capsys):
    assert _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", *START, effective=TORCH_DIST)[0] == 0
    runs = tmp_path / "out" / "runs"
    (runs / "start" / "seed1" / "status.json").unlink()  # a start to make again in the next call
    (runs / "block01" / DIRS[2] / "status.json").unlink()  # and one arm's run left
    capsys.readouterr()
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", *START, effective=TORCH_DIST)
    assert code == 0 and _ran(trace, WARM) == [DIRS[2]] and _ran(trace, "start") == ["seed1"]
    assert _ran(trace, "block01") == [DIRS[2]] and _ran(trace, "block02") == []
    assert list(_results(tmp_path)["compile_warmup"]) == [ARMS[2]]
    err = capsys.readouterr().err
    assert f"1 compile warm-up run of {ARMS[2]} (the other arms' runs are done) first, at once with the common starts" in err


def test_where_one_run_at_a_time_fits_there_is_no_warm_up(tmp_path, monkeypatch, capsys):
    assert _ablate_in_memory(tmp_path, monkeypatch, 4, GPU_MB - OVERHEAD_MB / 2) == 0  # the first of each arm compiles alone
    data = _results(tmp_path)
    assert data["concurrent_ran"] == 1 and data["warmup_run"] is False and data["compile_warmup"] is None
    assert not (tmp_path / "out" / "runs" / WARM).exists() and "compile warm-up" not in capsys.readouterr().err


def test_no_warmup_run_turns_it_off(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", *START, "--no-warmup-run",
                        effective=TORCH_DIST)
    assert code == 0 and _ran(trace, WARM) == [] and len(_ran(trace, "block01")) == 3
    data = _results(tmp_path)
    assert data["warmup_run"] is False and data["compile_warmup"] is None
    assert "with no warm-up run." in (tmp_path / "out" / "results.md").read_text()
    err = capsys.readouterr().err
    assert "compile warm-up" not in err and "6 runs, 8 at a time, no warm-up run" in err


def test_a_resumed_call_warms_up_only_with_starts_of_its_own_and_reports_its_own(tmp_path, monkeypatch, capsys):
    """The caches a warm-up fills are its machine's: a resumed call that makes common starts makes the
    warm-ups again; one whose starts were all made earlier makes none (it would need a wave of its
    own), and its results say so rather than repeat an earlier call's warm-ups."""
    ticks = iter(range(0, 100000, 100))  # every look at the clock: 100 s later
    base = ("--repeats", "3", "--concurrent", "6", *START)
    code, first = _main(tmp_path, monkeypatch, *base, "--budget", "1", effective=TORCH_DIST, clock=lambda: next(ticks))
    assert code == 0 and len(_ran(first, WARM)) == 3  # 3 starts and 3 warm-ups: one wave of 6
    assert "would not fit" in _results(tmp_path)["stop_reason"]  # 3 runs left for the next call
    assert len(_results(tmp_path)["runs"]) == 6
    capsys.readouterr()
    code, second = _main(tmp_path, monkeypatch, *base, effective=TORCH_DIST)
    assert code == 0 and _ran(second, WARM) == [] and _ran(second, "start") == []
    assert len([e for e in second if e[0] == "start"]) == 3  # the runs left, and nothing else
    data = _results(tmp_path)
    assert data["warmup_run"] is False and data["compile_warmup"] is None  # this call's: none
    assert "with no warm-up run." in (tmp_path / "out" / "results.md").read_text()
    assert "no compile warm-up: the common starts were made earlier" in capsys.readouterr().err
    # a seed more: its start to make, and every arm has a run left, so every arm warms up again
    code, third = _main(tmp_path, monkeypatch, "--repeats", "4", *base[2:], effective=TORCH_DIST)
    assert code == 0 and sorted(_ran(third, WARM)) == sorted(DIRS) and _ran(third, "start") == ["seed4"]
    data = _results(tmp_path)
    assert data["warmup_run"] is True and sorted(data["compile_warmup"]) == sorted(ARMS)
    assert all(s["status"] == "done" for s in data["compile_warmup"].values())  # made in this call, not skipped
    # every run done: nothing runs at all, and the results say this call made no warm-up
    code, fourth = _main(tmp_path, monkeypatch, "--repeats", "4", *base[2:], effective=TORCH_DIST)
    assert code == 0 and fourth == []
    assert _results(tmp_path)["warmup_run"] is False and _results(tmp_path)["compile_warmup"] is None


def test_every_run_done_skips_the_warm_ups_even_where_none_ran_before(tmp_path, monkeypatch):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "1", "--concurrent", "4", *START, "--no-warmup-run",
                        effective=TORCH_DIST)
    assert code == 0 and _ran(trace, WARM) == []
    code, again = _main(tmp_path, monkeypatch, "--repeats", "1", "--concurrent", "4", *START, effective=TORCH_DIST)
    assert code == 0 and again == []  # nothing left to warm up for
    assert _results(tmp_path)["warmup_run"] is False


def test_a_failing_warm_up_stops_nothing_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_CRASH_FLAG", f"--exit-interval={COMPILE_WARMUP_ITERS}")  # the warm-ups alone fail
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", *START, effective=TORCH_DIST)
    assert code == 0  # the measured runs all finished: the exit status is theirs
    assert len(_ran(trace, WARM)) == 3 and len(_ran(trace, "block01")) == len(_ran(trace, "block02")) == 3
    data = _results(tmp_path)
    assert all(r["status"] == "done" for r in data["runs"]) and data["blocks_run"] == 2
    assert data["warmup_run"] is False and {s["status"] for s in data["compile_warmup"].values()} == {"failed"}
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "compile warm-up failed" in ln]
    assert len(lines) == 1 and "the runs go on, compiling for themselves (0 of 3 done)" in lines[0]
    assert all(arm in lines[0] for arm in ARMS) and "FAILED" not in err and "planted failure" not in err
    md = (tmp_path / "out" / "results.md").read_text()
    assert "with a compile warm-up that failed for " in md and "## Failed runs" not in md
    assert "after a compile warm-up" not in md  # only where every warm-up finished before the runs


def test_the_dry_run_says_the_warm_up_in_words_and_shows_a_warm_up_command(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", *START, "--dry-run",
                        effective=TORCH_DIST)
    assert code == 0 and trace == [] and not (tmp_path / "out").exists()
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("compile warm-up: "))
    assert line.startswith("compile warm-up: 1 compile warm-up run of each arm first, at once with the common starts "
                           "(no wave of its own), 2 iterations each")
    shown = out.split(line, 1)[1].splitlines()[1]
    assert "--exit-interval 2" in shown and f"runs/{WARM}/all-off/tensorboard" in shown  # the baseline's too
    for extra, why in ((("--concurrent", "8"), "no common starts to ride with"),
                       (("--concurrent", "2", *START), "it would need a wave of its own")):
        code, _ = _main(tmp_path, monkeypatch, "--repeats", "2", "--dry-run", *extra, effective=TORCH_DIST)
        out = capsys.readouterr().out
        assert code == 0 and f"no compile warm-up: {why}" in out.splitlines()
        assert not any(ln.startswith("compile warm-up: ") for ln in out.splitlines())
    for extra in (("--concurrent", "8", *START, "--no-warmup-run"), ()):  # turned off, or one at a time
        assert _main(tmp_path, monkeypatch, "--repeats", "2", "--dry-run", *extra, effective=TORCH_DIST)[0] == 0
        assert "compile warm-up" not in capsys.readouterr().out
