"""Pooling one loss experiment's seeds over several sessions (reanalyse --with): the pooled interval
is the paired interval over every seed, computed here on its own from the recorded losses; parts
that are not one experiment, or share a seed, are refused in one line; the seeds the margin still
needs match a hand computation; bad inputs are one line, exit 2.

The first part is a real 4-seed MoE loss experiment (all stock toggles against all on, a common
start, 100 iterations; trimmed to the iterations after 40); the other parts are copies of it with
later seeds and their own changes in loss, as a later session would add."""

from __future__ import annotations

import copy
import json
import math
import statistics

import pytest
from conftest import REPO

from megatron_perf_toggles.tools.ablate import reanalyse
from megatron_perf_toggles.tools.ablate.loss.equivalence import seeds_to_fit

FIXTURE = REPO / "tests" / "fixtures" / "ablate" / "moe_loss_4_seeds.json"
WINDOW = 50  # the experiment's --loss-window
# Student's t quantiles t(0.95, df), from a printed table (not from the code under test)
T95 = {3: 2.353363, 5: 2.015048, 6: 1.943180, 7: 1.894579, 11: 1.795885}


def _real() -> dict:
    return json.loads(FIXTURE.read_text())


def _later(shift: int, slope: float = 0.003, gpu: str | None = "NVIDIA H200") -> dict:
    """The experiment continued: seeds ``shift`` after the first part's, the all-on arm's loss
    changed by ``slope`` x (block - 1.5) in each seed (so the part has differences of its own)."""
    data = _real()
    data["block_seeds"] = [s + shift for s in data["block_seeds"]]
    data["versions"]["gpu"] = gpu
    for run in data["runs"]:
        if run["arm"] == "all-on":
            for it in run["iterations"]:
                it["lm_loss"] *= 1 + slope * (run["block"] - 1.5)
    return data


def _write(tmp_path, name: str, data: dict):
    (tmp_path / name).mkdir(parents=True, exist_ok=True)
    (tmp_path / name / "results.json").write_text(json.dumps(data))
    return tmp_path / name


def _window_means(data: dict, arm: str) -> list[float]:
    """Each block's mean training loss over the last WINDOW iterations, straight from the runs."""
    by_block = {r["block"]: r for r in data["runs"] if r["arm"] == arm and r["block"] >= 0}
    means = []
    for block in range(data["blocks_run"]):
        its = by_block[block]["iterations"]
        last = max(it["iteration"] for it in its)
        means.append(statistics.fmean(it["lm_loss"] for it in its if it["iteration"] > last - WINDOW))
    return means


def _expected(*parts: dict) -> tuple[float, float, float]:
    """The paired 90 % interval over every part's seeds, in % of the baseline's mean."""
    on = [v for p in parts for v in _window_means(p, "all-on")]
    off = [v for p in parts for v in _window_means(p, "all-off")]
    scale = statistics.fmean(off)
    d = [100 * (a - b) / scale for a, b in zip(on, off, strict=True)]
    half = T95[len(d) - 1] * statistics.stdev(d) / math.sqrt(len(d))
    return statistics.fmean(d), statistics.fmean(d) - half, statistics.fmean(d) + half


def _pool(*argv) -> int:
    return reanalyse.main([str(a) for a in argv])


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("[perf-toggles] error: "), err
    return err


def test_two_parts_pooled_are_the_paired_interval_over_all_their_seeds(tmp_path, capsys):
    first, later = _real(), _later(4)
    a, b = _write(tmp_path, "a", first), _write(tmp_path, "b", later)
    assert _pool(a, "--with", b, "--out", tmp_path / "pooled", "--loss-margin", "0.5") == 0
    result = json.loads((tmp_path / "pooled" / "results.json").read_text())
    test = next(r["loss_test"] for r in result["rows"] if r["arm"] == "all-on")
    assert test["seeds_compared"] == 8 and test["paired"] and result["block_seeds"] == list(range(1234, 1242))
    assert [test["estimate"], test["low"], test["high"]] == pytest.approx(_expected(first, later), abs=1e-5)
    # each part's own test: its four seeds alone
    for part, data in zip(result["pool"]["parts"], (first, later), strict=True):
        own = part["loss_test"]["all-on"]
        assert own["seeds_compared"] == 4
        assert [own["estimate"], own["low"], own["high"]] == pytest.approx(_expected(data), abs=1e-5)
    # the same as the loss test of one result holding the eight seeds
    one = copy.deepcopy(first)
    one["runs"] += [{**r, "block": r["block"] + 4} for r in later["runs"]]
    one.update(blocks_run=8, block_seeds=result["block_seeds"])
    alone = reanalyse.loss_test_of(one, reanalyse.ExperimentSpec(loss_margin=0.5))["arms"]["all-on"]
    assert {k: alone[k] for k in ("estimate", "low", "high", "verdict")} == {
        k: test[k] for k in ("estimate", "low", "high", "verdict")}
    out = capsys.readouterr().out
    assert "pooled 8 seeds of 2 parts (4 seeds on an unnamed 79 GiB GPU, 4 on NVIDIA H200)" in out
    assert "more than the 8 so far" in out  # inconclusive at +-0.5 %: the seeds it still needs
    md = (tmp_path / "pooled" / "results.md").read_text()
    assert "the pairs are within a seed and a card" in md and "| 1238-1241 | NVIDIA H200 |" in md
    assert "## Loss: equivalence within +-0.5 %" in md and md.count("4 seeds: inconclusive") == 2


def test_a_pooled_result_pools_again_with_the_next_session(tmp_path, capsys):
    parts = [_real(), _later(4), _later(8, slope=-0.002, gpu=None)]
    dirs = [_write(tmp_path, n, d) for n, d in zip("abc", parts, strict=True)]
    assert _pool(dirs[0], "--with", dirs[1], "--out", tmp_path / "ab") == 0
    assert _pool(tmp_path / "ab", "--with", dirs[2], "--out", tmp_path / "abc") == 0
    result = json.loads((tmp_path / "abc" / "results.json").read_text())
    test = next(r["loss_test"] for r in result["rows"] if r["arm"] == "all-on")
    assert [test["estimate"], test["low"], test["high"]] == pytest.approx(_expected(*parts), abs=1e-5)
    assert [p["source"] for p in result["pool"]["parts"]] == [str(d) for d in dirs]  # the sessions, not "ab"
    assert result["pool"]["where"] == "8 seeds on an unnamed 79 GiB GPU, 4 on NVIDIA H200"
    # a pooled directory re-analyses in place, with another margin
    assert _pool(tmp_path / "abc", "--loss-margin", "2") == 0
    again = json.loads((tmp_path / "abc" / "results.json").read_text())
    assert again["loss_test"]["margin"] == 2.0 and again["block_seeds"] == result["block_seeds"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:  # a session already in the pool comes in again
        _pool(tmp_path / "abc", "--with", dirs[1], "--out", tmp_path / "again")
    assert info.value.code == 2
    assert f"seed 1238 is in both {dirs[1]} (in {tmp_path / 'abc'}) and {dirs[1]}" in _error(capsys)
    with pytest.raises(SystemExit) as info:  # a pool written over by parts that lack some of its seeds
        _pool(dirs[0], "--with", dirs[2], "--out", tmp_path / "abc")
    assert info.value.code == 2 and "holds a pool with seeds 1238-1241 these parts do not" in _error(capsys)
    assert json.loads((tmp_path / "abc" / "results.json").read_text())["block_seeds"] == result["block_seeds"]


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


@pytest.mark.parametrize("edit, words", [
    (lambda c: c["all-on"].update(argv=_set(c["all-on"]["argv"], "--lr", "2e-3")),
     "arm all-on's Megatron arguments: --lr 1e-3 against 2e-3"),
    (lambda c: c["all-off"].update(argv=[*c["all-off"]["argv"], "--exit-interval", "50"]),
     "arm all-off's Megatron arguments: --exit-interval 50 in the second only"),
    (lambda c: c["all-on"]["env"].update(MOE_GROUPED_GEMM="0"),
     "arm all-on's toggle variables: MOE_GROUPED_GEMM=1 against MOE_GROUPED_GEMM=0"),
    (lambda c: c.update({"only:x": c.pop("all-on")}), "the arms: all-off, all-on against all-off, only:x"),
])
def test_parts_that_are_not_one_experiment_are_refused_naming_the_difference(tmp_path, capsys, edit, words):
    later = _later(4)
    edit(later["commands"])
    a, b = _write(tmp_path, "a", _real()), _write(tmp_path, "b", later)
    with pytest.raises(SystemExit) as info:
        _pool(a, "--with", b, "--out", tmp_path / "pooled")
    assert info.value.code == 2
    assert f"{a} and {b} are not one experiment: {words}" in _error(capsys)
    assert not (tmp_path / "pooled").exists()


def test_what_each_run_or_machine_has_its_own_is_no_difference(tmp_path):
    """The seed, the runs' output directories, where the data, the interpreter and the script lie."""
    later = _later(4)
    for arm in later["commands"].values():
        argv = ["/other/venv/bin/python3.12", *arm["argv"][1:]]
        argv[argv.index("-m") + 2] = "/elsewhere/megatron/pretrain_gpt.py"
        argv = _set(argv, "--data-path", "/data/elsewhere/stdlib")
        for flag, value in (("--seed", "99"), ("--tensorboard-dir", "/x/tb"), ("--data-cache-path", "/x/cache")):
            argv = _set(argv, flag, value)
        arm["argv"] = argv
    a, b = _write(tmp_path, "a", _real()), _write(tmp_path, "b", later)
    assert _pool(a, "--with", b, "--out", tmp_path / "pooled") == 0
    # a data set of another name is another experiment
    for arm in later["commands"].values():
        arm["argv"] = _set(arm["argv"], "--data-path", "/data/elsewhere/other")
    _write(tmp_path, "b", later)
    with pytest.raises(SystemExit):
        _pool(a, "--with", b, "--out", tmp_path / "pooled2")


def test_a_seed_in_two_parts_is_refused(tmp_path, capsys):
    a, b = _write(tmp_path, "a", _real()), _write(tmp_path, "b", _later(3))  # seeds 1237-1240: 1237 twice
    with pytest.raises(SystemExit) as info:
        _pool(a, "--with", b, "--out", tmp_path / "pooled")
    assert info.value.code == 2 and f"seed 1237 is in both {a} and {b}: a seed counts once" in _error(capsys)


def test_a_mean_past_the_margin_cannot_be_reached(tmp_path, capsys):
    a, b = _write(tmp_path, "a", _real()), _write(tmp_path, "b", _later(4, slope=0.0))
    assert _pool(a, "--with", b, "--out", tmp_path / "pooled", "--loss-margin", "0.2") == 0
    assert "+-0.2 % cannot be reached: the mean difference, +0.22 %, is not inside it" in capsys.readouterr().out


def test_seeds_to_fit_against_a_hand_computation():
    # room = 0.5 - 0.1 = 0.4; n = 6: 2.015048 x 0.5 / sqrt(6) = 0.4113 > 0.4; n = 7: 1.943180 x 0.5 / sqrt(7) = 0.3672
    assert T95[5] * 0.5 / math.sqrt(6) > 0.4 >= T95[6] * 0.5 / math.sqrt(7)
    assert seeds_to_fit(0.1, 0.5, 0.5) == 7
    assert seeds_to_fit(-0.1, 0.5, 0.5) == 7  # the sign of the change does not matter
    # room = 0.2 with sd 0.2: t / sqrt(n) <= 1 first at n = 5 (2.353363 / 2 = 1.18 at n = 4; 2.131847 / sqrt(5) = 0.953)
    assert seeds_to_fit(-0.3, 0.2, 0.5) == 5
    # n = 12: 1.795885 x 1 / sqrt(12) = 0.5184 > 0.5; n = 13: 1.782288 / sqrt(13) = 0.4943
    assert T95[11] / math.sqrt(12) > 0.5
    assert seeds_to_fit(0.0, 1.0, 0.5) == 13
    assert seeds_to_fit(0.5, 0.1, 0.5) is None and seeds_to_fit(-0.7, 0.1, 0.5) is None


@pytest.mark.parametrize("make, words", [
    (lambda t: t / "nowhere", "nowhere: no such file or directory"),
    (lambda t: _json(t, {"design": "headline"}), "is not an ablate results.json (no 'commands')"),
    (lambda t: _json(t, "[1, 2"), "not readable JSON"),
    (lambda t: _json(t, {**_real(), "block_seeds": None}), "its blocks repeat one seed (no --block-seeds)"),
])
def test_a_bad_part_is_one_line_exit_2(tmp_path, capsys, make, words):
    a = _write(tmp_path, "a", _real())
    with pytest.raises(SystemExit) as info:
        _pool(a, "--with", make(tmp_path), "--out", tmp_path / "pooled")
    assert info.value.code == 2 and words in _error(capsys)


def _json(tmp_path, data) -> object:
    path = tmp_path / "part.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("argv, words", [
    (lambda a, b, t: [a, "--with", b], "--with and --out go together"),
    (lambda a, b, t: [a, "--with", b, "--out", a], "holds a results.json that is not a pooled one"),
    (lambda a, b, t: [a, "--with"], "argument --with: expected at least one argument"),
    (lambda a, b, t: [t / "nowhere", "--with", b, "--out", t / "p"], "nowhere: no such file or directory"),
])
def test_a_bad_command_line_is_one_line_exit_2(tmp_path, capsys, argv, words):
    a, b = _write(tmp_path, "a", _real()), _write(tmp_path, "b", _later(4))
    with pytest.raises(SystemExit) as info:
        _pool(*argv(a, b, tmp_path))
    assert info.value.code == 2 and words in _error(capsys)


def test_a_run_of_a_block_a_part_left_unfinished_is_not_paired_with_the_next_parts_seed(tmp_path, capsys):
    """A budget stop mid-block leaves a run of a block past the part's seeds: it must not be numbered
    as the next part's first seed, where it would pair with that part's run of the other arm."""
    first, later = _real(), _later(4)
    leftover = copy.deepcopy(next(r for r in first["runs"] if r["arm"] == "all-on" and r["block"] == 3))
    first["runs"].append({**leftover, "block": first["blocks_run"]})  # the unfinished fifth block's one run
    later["runs"] = [r for r in later["runs"] if not (r["arm"] == "all-on" and r["block"] == 0)]  # it failed there
    a, b = _write(tmp_path, "a", first), _write(tmp_path, "b", later)
    assert _pool(a, "--with", b, "--out", tmp_path / "pooled") == 0
    result = json.loads((tmp_path / "pooled" / "results.json").read_text())
    test = next(r["loss_test"] for r in result["rows"] if r["arm"] == "all-on")
    assert test["seeds_compared"] == 7  # the later part's first seed has no all-on run: not the leftover
    assert all(0 <= r["block"] < 8 for r in result["runs"])
    assert sum(1 for r in result["runs"] if r["arm"] == "all-on") == 7
