"""ablate --concurrent's compile warm-up: one short run of each arm, at once (with the common starts
where there are some), before the runs that start together, so that they find the compile caches
warm. End to end through the stand-in Megatron, which traces when each run starts and ends
(FAKE_TRACE) and with which MASTER_PORT: runs of one wave each have a port of their own."""

from __future__ import annotations

import json
from pathlib import Path

from test_ablate import FAKE, _record
from test_concurrent_memory import GPU_MB, OVERHEAD_MB
from test_concurrent_memory import _ablate as _ablate_in_memory

from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate.runs import COMPILE_WARMUP_ITERS
from megatron_perf_toggles.tools.megatron_log import parse_file

TOGGLES = "grad_reduce_in_bf16,ddp_average_in_collective"  # one-at-a-time: all-off and two arms
ARMS = ["all-off", "only:grad_reduce_in_bf16", "only:ddp_average_in_collective"]
DIRS = [a.replace(":", "_") for a in ARMS]  # each run's directory is its arm's name, made safe for a path


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
    """(event, port, kind, name) per line: kind is warmup, start or blockNN; name the arm or the seed."""
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


def test_each_arm_warms_up_once_at_once_before_any_measured_run(tmp_path, monkeypatch, capsys):
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    (pretrained / "latest_checkpointed_iteration.txt").write_text("6 1\n")
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "4",
                        megatron=("--save", "/ck", "--load", str(pretrained)),
                        effective={"save": "/ck", "load": str(pretrained)})
    assert code == 0
    assert sorted(_ran(trace, "warmup")) == sorted(DIRS)
    first_measured = next(i for i, (event, _, kind, _) in enumerate(trace) if kind.startswith("block"))
    assert all(kind == "warmup" for _, _, kind, _ in trace[:first_measured])  # every warm-up ended before
    assert len(set(_ports(trace, {"warmup"}))) == 3  # one wave: each its own port
    data = _results(tmp_path)
    assert data["warmup_run"] is True and sorted(data["compile_warmup"]) == sorted(ARMS)
    assert [r["block"] for r in data["runs"]] == [0, 0, 0, 1, 1, 1]  # the warm-ups are measured nowhere
    for arm, status in data["compile_warmup"].items():
        assert status["status"] == "done" and status["seconds"] > 0 and status["block"] == -1
        cmd = status["command"]
        assert cmd[cmd.index("--exit-interval") + 1] == str(COMPILE_WARMUP_ITERS)
        assert "--save" not in cmd and "--load" not in cmd  # no checkpoint read or written
        assert cmd[cmd.index("--seed") + 1] == "1" and cmd[cmd.index("--train-iters") + 1] == "6"
        assert len(parse_file(status["log"]).iterations) == COMPILE_WARMUP_ITERS
        assert Path(status["log"]).parent == tmp_path / "out" / "runs" / "warmup" / DIRS[ARMS.index(arm)]
    measured = data["runs"][0]["command"]
    assert "--exit-interval" not in measured and measured[measured.index("--load") + 1] == str(pretrained)
    assert "after a compile warm-up (3 short unmeasured run(s) at once" in (tmp_path / "out" / "results.md").read_text()
    err = capsys.readouterr().err
    assert "9 runs: 1 compile warm-up run of each arm first, all at once, 2 iterations each, unmeasured; then " in err
    assert "[ablate] compile warm-up: 3 run(s) done in " in err


def test_with_a_common_start_the_warm_ups_ride_in_the_starts_wave(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", "--common-start",
                        effective={"ckpt_format": "torch_dist"})
    assert code == 0
    # the baseline's code is compiled by its starts: a warm-up for each other arm alone
    assert sorted(_ran(trace, "warmup")) == sorted(DIRS[1:]) and sorted(_ran(trace, "start")) == ["seed1", "seed2"]
    assert sorted(_ports(trace, {"warmup", "start"})) == sorted(set(_ports(trace, {"warmup", "start"})))  # one wave
    first_measured = next(i for i, (_, _, kind, _) in enumerate(trace) if kind.startswith("block"))
    assert {kind for _, _, kind, _ in trace[:first_measured]} == {"warmup", "start"}
    assert _most_at_once(trace[:first_measured]) <= 8
    data = _results(tmp_path)
    assert data["warmup_run"] is True and sorted(data["compile_warmup"]) == sorted(ARMS[1:])
    err = capsys.readouterr().err
    assert ("1 compile warm-up run of each arm first, at once with the common starts (the baseline's: the starts "
            "themselves), 2 iterations each") in err


def test_starts_and_warm_ups_count_in_k_and_split_into_waves(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "2", "--common-start",
                        effective={"ckpt_format": "torch_dist"})
    assert code == 0
    first = next(i for i, (_, _, kind, _) in enumerate(trace) if kind.startswith("block"))
    assert len(_ran(trace[:first], "warmup")) == 2 and len(_ran(trace[:first], "start")) == 2
    ports = _ports(trace[:first], {"warmup", "start"})
    assert len(set(ports)) == 2 and len(ports) == 4  # two waves of two
    assert _most_at_once(trace) <= 2
    assert "at once with the common starts (the baseline's: the starts themselves), in 2 waves of at most 2" in (
        capsys.readouterr().err)


def test_where_one_run_at_a_time_fits_there_is_no_warm_up(tmp_path, monkeypatch, capsys):
    assert _ablate_in_memory(tmp_path, monkeypatch, 4, GPU_MB - OVERHEAD_MB / 2) == 0  # the first of each arm compiles alone
    data = _results(tmp_path)
    assert data["concurrent_ran"] == 1 and data["warmup_run"] is False and data["compile_warmup"] is None
    assert not (tmp_path / "out" / "runs" / "warmup").exists() and "compile warm-up" not in capsys.readouterr().err


def test_no_warmup_run_turns_it_off(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "4", "--no-warmup-run")
    assert code == 0 and _ran(trace, "warmup") == [] and len(_ran(trace, "block01")) == 3
    data = _results(tmp_path)
    assert data["warmup_run"] is False and data["compile_warmup"] is None
    assert "with no warm-up run." in (tmp_path / "out" / "results.md").read_text()
    err = capsys.readouterr().err
    assert "compile warm-up" not in err and "6 runs, 4 at a time, no warm-up run" in err


def test_a_resumed_call_with_runs_left_warms_up_again(tmp_path, monkeypatch, capsys):
    """The caches a warm-up fills are its machine's; a resumed call may run on a fresh one."""
    ticks = iter(range(0, 100000, 100))  # every look at the clock: 100 s later
    base = ("--repeats", "3", "--concurrent", "2", "--budget", "3")
    code, first = _main(tmp_path, monkeypatch, *base, toggles="grad_reduce_in_bf16", clock=lambda: next(ticks))
    assert code == 0 and len(_ran(first, "warmup")) == 2
    assert "would not fit" in _results(tmp_path)["stop_reason"]  # some runs left for the next call
    left = 6 - len(_results(tmp_path)["runs"])
    assert left > 0
    capsys.readouterr()
    code, second = _main(tmp_path, monkeypatch, *base[:-2], toggles="grad_reduce_in_bf16")
    assert code == 0 and len(_ran(second, "warmup")) == 2  # made again, before the runs left
    starts = [e for e in second if e[0] == "start"]
    assert len(starts) == left + 2
    assert all(k == "warmup" for _, _, k, _ in starts[:2])
    data = _results(tmp_path)
    assert data["warmup_run"] is True and len(data["compile_warmup"]) == 2
    assert "done earlier" not in capsys.readouterr().err.split("compile warm-up", 1)[0]
    # every run done: nothing runs at all, and the results still say the runs came after a warm-up
    code, third = _main(tmp_path, monkeypatch, *base[:-2], toggles="grad_reduce_in_bf16")
    assert code == 0 and third == [] and _results(tmp_path)["warmup_run"] is True


def test_every_run_done_skips_the_warm_ups_even_where_none_ran_before(tmp_path, monkeypatch):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "1", "--concurrent", "4", "--no-warmup-run")
    assert code == 0 and _ran(trace, "warmup") == []
    code, again = _main(tmp_path, monkeypatch, "--repeats", "1", "--concurrent", "4")
    assert code == 0 and again == []  # nothing left to warm up for
    assert _results(tmp_path)["warmup_run"] is False


def test_a_failing_warm_up_stops_nothing_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_CRASH_FLAG", f"--exit-interval={COMPILE_WARMUP_ITERS}")  # the warm-ups alone fail
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "4")
    assert code == 0  # the measured runs all finished: the exit status is theirs
    assert len(_ran(trace, "warmup")) == 3 and len(_ran(trace, "block01")) == len(_ran(trace, "block02")) == 3
    data = _results(tmp_path)
    assert all(r["status"] == "done" for r in data["runs"]) and data["blocks_run"] == 2
    assert data["warmup_run"] is False and {s["status"] for s in data["compile_warmup"].values()} == {"failed"}
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "compile warm-up failed" in ln]
    assert len(lines) == 1 and "the runs go on, compiling for themselves (0 of 3 done)" in lines[0]
    assert all(arm in lines[0] for arm in ARMS) and "FAILED" not in err and "planted failure" not in err
    md = (tmp_path / "out" / "results.md").read_text()
    assert "after a compile warm-up (failed for " in md and "## Failed runs" not in md


def test_the_dry_run_says_the_warm_up_in_words_and_shows_a_warm_up_command(tmp_path, monkeypatch, capsys):
    code, trace = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", "--dry-run")
    assert code == 0 and trace == [] and not (tmp_path / "out").exists()
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("compile warm-up: "))
    assert line.startswith("compile warm-up: 1 compile warm-up run of each arm first, all at once, 2 iterations each")
    shown = out.split(line, 1)[1].splitlines()[1]
    assert "--exit-interval 2" in shown and "runs/warmup/all-off/tensorboard" in shown
    code, _ = _main(tmp_path, monkeypatch, "--repeats", "2", "--concurrent", "8", "--dry-run", "--common-start",
                    effective={"ckpt_format": "torch_dist"})
    out = capsys.readouterr().out
    assert code == 0 and "1 compile warm-up run of each arm first, at once with the common starts" in out
    assert "runs/warmup/all-off" not in out  # the baseline's code is compiled by its starts
    for extra in (("--concurrent", "8", "--no-warmup-run"), ()):  # turned off, or one at a time
        assert _main(tmp_path, monkeypatch, "--repeats", "2", "--dry-run", *extra)[0] == 0
        assert "compile warm-up" not in capsys.readouterr().out
