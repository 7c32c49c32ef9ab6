"""``ablate --dry-run`` says what it was given (issue 50, item 6): both seeds by name, what the
baseline really is, what the loss test will do, where the world it plans for comes from, and that
runs at once measure no step time."""

from __future__ import annotations

import pytest
from test_ablate import FAKE, _fake_megatron

from megatron_perf_toggles.core.registry import BY_DEST
from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate.spec import DEFAULT_TOGGLES

TOGGLE = "grad_reduce_in_bf16"


def _dry_run(tmp_path, capsys, *extra, design=("--design", "one-at-a-time", "--toggles", TOGGLE), launch=True,
             resolver=None):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = [*design, "--dry-run", "--out", str(tmp_path / "out"), *(["--launch", FAKE] if launch else []), *extra,
            str(script), "--", "--seq-length", "4096"]
    assert ablate.main(argv, resolver=resolver or _fake_megatron()) == 0
    return capsys.readouterr()


def _plan_line(err):
    return next(ln for ln in err.splitlines() if " runs: " in ln)


def test_both_seeds_are_named(tmp_path, capsys):
    err = _dry_run(tmp_path, capsys, "--block-seeds", "1234", "--repeats", "3").err
    line = _plan_line(err)
    assert "(seed 0)" not in line
    assert "arm order: --seed 0" in line and "Megatron's --seed 1234 to 1236, one per block (--block-seeds 1234)" in line
    plain = _plan_line(_dry_run(tmp_path, capsys, "--seed", "7").err)
    assert "(arm order: --seed 7)" in plain and "Megatron's --seed" not in plain  # the arguments' own seed
    more = _plan_line(_dry_run(tmp_path, capsys, "--block-seeds", "5", "--repeats", "2", "--target-ci", "0.01").err)
    assert "5 and 6 (and on, where --target-ci adds blocks)" in more


def _real_decisions(script, args, arm, environ, world=None):
    """Stands in for a dry run that reports every toggle, as Megatron's does: the arm's pinned values,
    the others at the plugin's default."""
    record = _fake_megatron()(script, args, arm, environ, world)
    defaults = {t.dest: {"value": t.default is True, "source": "default", "reason": "plugin default"}
                for t in BY_DEST.values() if t.kind == "bool" and t.dest in DEFAULT_TOGGLES}
    return {**record, "decisions": {**defaults, **record["decisions"]}}


def test_the_baseline_says_what_it_sets_and_what_it_leaves_to_the_plugin(tmp_path, capsys):
    out = _dry_run(tmp_path, capsys, resolver=_real_decisions).out
    line = next(ln for ln in out.splitlines() if ln.startswith("all-off (baseline"))
    assert line.startswith(f"all-off (baseline: {TOGGLE} off; not set by any arm, so as the plugin decides: ")
    others = [d for d in DEFAULT_TOGGLES if d != TOGGLE]
    for dest in others:
        assert f"{dest} {'on' if BY_DEST[dest].default is True else 'off'} (default)" in line
    assert any(BY_DEST[d].default is True for d in others)  # "all-off" alone would have hidden these


def test_the_baseline_says_so_where_the_others_are_pinned_or_it_is_the_command_as_given(tmp_path, capsys):
    pinned = _dry_run(tmp_path, capsys, "--others", "off", resolver=_real_decisions).out
    line = next(ln for ln in pinned.splitlines() if "(baseline" in ln)
    assert f"the {len(DEFAULT_TOGGLES) - 1} toggles not taking part pinned off" in line and "plugin decides" not in line
    alone = _dry_run(tmp_path, capsys).out  # a stand-in that reports the arms' own toggles only
    assert "the toggles not named keep their defaults (the environment's, else the plugin's)" in alone
    cand = _dry_run(tmp_path, capsys, design=("--design", "candidates", "--candidate", "gc=--manual-gc")).out
    assert "baseline (baseline: the command as given" in cand


@pytest.mark.parametrize("extra, words", [
    (("--block-seeds", "1234", "--repeats", "3"),
     ["loss test: each run's last validation loss where every run logs one, else its mean training loss over the last "
      "tenth of its iterations", "over seeds 1234 to 1236 (--block-seeds), paired by seed",
      "a 90 % t-interval (two one-sided tests at 0.05) against +-1 % (--loss-margin)",
      "one loss: line per arm, with the seeds +-1 % needs at the spread measured"]),
    (("--block-seeds", "3", "--repeats", "2", "--loss-measure", "train-window", "--loss-window", "4",
      "--loss-margin", "0.5", "--loss-alpha", "0.025"),
     ["each run's mean training loss over its last 4 iterations", "seeds 3 and 4", "a 95 % t-interval",
      "tests at 0.025) against +-0.5 %", "the seeds +-0.5 % needs"]),
    (("--loss-window", "2",), ["over blocks that repeat one seed (run-to-run only, no claim across seeds)"]),
    ((), ["loss test: none (--block-seeds, --loss-window or --loss-measure asks for one)"]),
])
def test_the_dry_run_says_what_the_loss_test_will_do(tmp_path, capsys, extra, words):
    out = _dry_run(tmp_path, capsys, *extra).out
    line = next(ln for ln in out.splitlines() if ln.startswith("loss test: "))
    for w in words:
        assert w in line


def test_one_process_is_not_said_to_come_from_a_launch_not_given(tmp_path, capsys):
    err = _dry_run(tmp_path, capsys, launch=False).err
    assert "for one process (no --launch: this python starts each run)" in err and "from --launch" not in err
    assert "for one process (from --launch)" in _dry_run(tmp_path, capsys).err  # a launch given that starts one


def test_runs_at_once_are_not_said_to_have_medians(tmp_path, capsys):
    line = _plan_line(_dry_run(tmp_path, capsys, "--block-seeds", "1", "--concurrent", "2").err)
    assert "medians" not in line and line.endswith("2 at once share the GPU, so no step time is measured; "
                                                   "no compile warm-up: no common starts to ride with")
    assert _plan_line(_dry_run(tmp_path, capsys, "--warmup", "2").err).endswith("the first 2 left out of the medians")
