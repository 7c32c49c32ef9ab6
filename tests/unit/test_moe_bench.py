"""bench/moe_h200.py: the MoE presets are thin ablate calls with the shapes the issue names, checked
without a GPU or a Megatron tree (the smoke runs through a real tree are in tests/real)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import moe_h200

from megatron_perf_toggles.tools.ablate.design import DEFAULT_TOGGLES


def _plan(tmp_path, capsys, *extra):
    tree = tmp_path / "Megatron-LM"
    tree.mkdir(exist_ok=True)
    (tree / "pretrain_gpt.py").write_text("")
    assert moe_h200.main(["--megatron", str(tree), "--out", str(tmp_path / "out"), "--print-only", *extra]) == 0
    out = capsys.readouterr().out
    cmds = {ln.split("]")[0][1:]: ln.split("] ", 1)[1].split() for ln in out.splitlines() if ln.startswith("[")}
    return out, cmds


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def _megatron(cmd):
    return cmd[cmd.index("--") + 1:]


def test_the_plan_comes_first_with_the_expected_time(tmp_path, capsys):
    out, cmds = _plan(tmp_path, capsys, "--budget", "9")
    assert set(cmds) == {"loss", "speed-a", "speed-b"}
    assert out.index("expected: ~") < out.index("[loss]") and "min on the H200 (budget 9 min)" in out
    # no common start in the loss part: ablate makes no compile warm-up (it would need a wave of its own)
    assert "loss      15 runs (all at once)  " in out and "speed-a   16 runs (1 warm-up run" in out
    for cmd in cmds.values():
        flags = [w for w in _megatron(cmd) if w.startswith("--")]
        assert len(flags) == len(set(flags))  # each Megatron argument once
        assert cmd[3] == "ablate" and "--budget" in cmd
        assert "--save" not in cmd and "--load" not in cmd
        assert float(_value(cmd, "--budget")) < 9  # the dry runs before ablate's clock starts are left out
    assert "--split-blocks" in cmds["speed-a"] and "--split-blocks" in cmds["speed-b"]
    assert "--split-blocks" not in cmds["loss"]  # its runs start together or not at all


def test_the_speed_shapes_are_the_issue_s(tmp_path, capsys):
    _, cmds = _plan(tmp_path, capsys, "--parts", "speed-a,speed-b")
    a, b = _megatron(cmds["speed-a"]), _megatron(cmds["speed-b"])
    for args in (a, b):
        for flag, value in (("--num-layers", "4"), ("--hidden-size", "2048"), ("--num-attention-heads", "16"),
                            ("--seq-length", "4096"), ("--micro-batch-size", "4"),
                            ("--moe-token-dispatcher-type", "alltoall"), ("--expert-model-parallel-size", "1"),
                            ("--moe-router-load-balancing-type", "aux_loss"),
                            ("--transformer-impl", "transformer_engine"), ("--seed", "1234")):
            assert _value(args, flag) == value, flag
        assert {"--bf16", "--use-distributed-optimizer", "--mock-data"} <= set(args)
        assert _value(args, "--log-memory-interval") == "10"  # the run's peak, not only after iteration 2
    assert (_value(a, "--num-experts"), _value(a, "--moe-router-topk"), _value(a, "--moe-ffn-hidden-size")) == (
        "8", "2", "4096")
    assert (_value(b, "--num-experts"), _value(b, "--moe-router-topk"), _value(b, "--moe-ffn-hidden-size")) == (
        "64", "8", "768")
    for part in ("speed-a", "speed-b"):
        cmd = cmds[part]
        assert (_value(cmd, "--iters"), _value(cmd, "--warmup"), _value(cmd, "--repeats")) == ("40", "20", "3")
        assert "--concurrent" not in cmd and "--block-seeds" not in cmd and "--no-warmup-run" not in cmd


def test_force_balance_routes_every_speed_arm_at_random_and_leaves_the_loss_parts_alone(tmp_path, capsys):
    _, plain = _plan(tmp_path, capsys, "--parts", "speed-a,loss")
    assert all("--moe-router-force-load-balancing" not in cmd for cmd in plain.values())
    _, forced = _plan(tmp_path, capsys, "--parts", "speed-a,speed-b,loss", "--force-balance")
    for part in ("speed-a", "speed-b"):
        assert _megatron(forced[part]).count("--moe-router-force-load-balancing") == 1
    assert "--moe-router-force-load-balancing" not in forced["loss"]  # learnt routing is what the loss test keeps


def test_the_loss_part_runs_seeds_at_once_on_real_text(tmp_path, capsys):
    _, cmds = _plan(tmp_path, capsys, "--parts", "loss", "--repeats", "2", "--loss-window", "40")
    cmd = cmds["loss"]
    assert (_value(cmd, "--iters"), _value(cmd, "--block-seeds"), _value(cmd, "--loss-window")) == ("300", "1234", "40")
    assert _value(cmd, "--concurrent") == str(2 * moe_h200.arms())
    assert "--no-warmup-run" not in cmd  # ablate decides the compile warm-up (none here: no common start)
    args = _megatron(cmd)
    assert "--mock-data" not in args and _value(args, "--vocab-size") == "257"
    assert _value(args, "--data-path") == str(tmp_path / "out" / "corpus" / "stdlib")
    assert "--log-throughput" not in args and _value(args, "--num-experts") == "8"


def test_no_warmup_run_turns_off_the_loss_parts_compile_warm_up_and_the_speed_parts_warm_up_run(tmp_path, capsys):
    out, cmds = _plan(tmp_path, capsys, "--parts", "loss,loss-common,speed-a", "--no-warmup-run")
    assert all(cmd.count("--no-warmup-run") == 1 for cmd in cmds.values())
    assert "loss      15 runs (all at once)  " in out and "speed-a   15 runs (one at a time)" in out
    assert "loss-common   6 runs (all at once)  " in out
    # the compile warm-up never costs a wave of its own: it rides in the starts' waves, or ablate makes none
    for part in ("loss", "loss-common"):
        assert moe_h200.estimate_s(part, 3) == moe_h200.estimate_s(part, 3, warmup_run=False)
    assert moe_h200.estimate_s("speed-a", 3) > moe_h200.estimate_s("speed-a", 3, warmup_run=False)


def test_the_loss_common_part_warms_up_with_its_starts_where_that_adds_no_wave(tmp_path, capsys):
    out, _ = _plan(tmp_path, capsys, "--parts", "loss-common,loss")
    assert "loss-common   6 runs (all at once, after a compile warm-up with the common starts)" in out
    assert "loss      15 runs (all at once)  " in out  # no common start to ride with
    out, _ = _plan(tmp_path, capsys, "--parts", "loss-common", "--concurrent", "3")  # 3 starts, 2 warm-ups: a wave more
    assert "loss-common   6 runs (all at once)  " in out


def test_the_dense_loss_part_is_the_same_model_without_experts_and_every_dense_toggle_alone(tmp_path, capsys):
    _, cmds = _plan(tmp_path, capsys, "--parts", "loss,loss-dense", "--repeats", "4", "--loss-margin", "0.5")
    moe, dense = cmds["loss"], cmds["loss-dense"]
    assert _value(dense, "--design") == "each-alone" and "--toggles" not in dense[:dense.index("--")]
    arms = 1 + len(DEFAULT_TOGGLES) + 1  # stock, each dense toggle alone, the defaults
    assert _value(dense, "--concurrent") == str(4 * arms) and _value(moe, "--concurrent") == str(4 * 5)
    assert _value(dense, "--loss-margin") == "0.5" == _value(moe, "--loss-margin")
    dense_args, moe_args = _megatron(dense), _megatron(moe)
    assert not [w for w in dense_args if w.startswith(("--moe-", "--num-experts", "--expert-model"))]
    # the same model otherwise: every other flag and value as the MoE loss model's
    kept, skip = [], False
    for word in moe_args:
        if word.startswith("--"):
            skip = word.startswith(("--moe-", "--num-experts", "--expert-model"))
        if not skip:
            kept.append(word)
    assert kept == dense_args


def test_the_controls_run_the_loss_model_with_a_known_harm_and_a_known_null(tmp_path, capsys):
    out, cmds = _plan(tmp_path, capsys, "--parts", "loss-control,loss-null", "--repeats", "8")
    control, null = cmds["loss-control"], cmds["loss-null"]
    line = next(ln for ln in out.splitlines() if ln.startswith("[loss-control]"))
    assert ("--design candidates --candidate 'lr-x0.3=--lr 3e-4 --min-lr 3e-5' "
            "--candidate 'adam-eps-1e-3=--adam-eps 1e-3'") in line
    assert _value(control, "--concurrent") == str(8 * 3) and _value(null, "--concurrent") == str(8 * 2)
    assert _value(null, "--toggles") == "ddp_average_in_collective" and _value(null, "--others") == "off"
    assert _value(control, "--block-seeds") == "1234" and _megatron(control) == _megatron(cmds["loss-null"])
    assert "loss-control  24 runs (all at once)  " in out and "loss-null  16 runs (all at once)  " in out


def test_eval_iters_holds_out_text_for_the_validation_measure(tmp_path, capsys):
    _, cmds = _plan(tmp_path, capsys, "--parts", "loss", "--eval-iters", "20", "--iters", "200")
    args = _megatron(cmds["loss"])
    assert (_value(args, "--eval-iters"), _value(args, "--eval-interval"), _value(args, "--split")) == (
        "20", "200", "95,5,0")
    _, plain = _plan(tmp_path, capsys, "--parts", "loss")
    assert _value(_megatron(plain["loss"]), "--eval-iters") == "0" and _value(_megatron(plain["loss"]), "--split") == "100,0,0"


def test_the_moe_arms_are_toggles_where_the_registry_has_them_else_candidates(monkeypatch):
    monkeypatch.setattr(moe_h200, "have_moe_toggles", lambda: True)
    assert moe_h200.design_words() == ["--design", "each-alone", "--toggles",
                                       "moe_grouped_gemm,moe_permute_fusion,moe_router_fusion"]
    monkeypatch.setattr(moe_h200, "have_moe_toggles", lambda: False)
    words = moe_h200.design_words()
    assert words[:2] == ["--design", "candidates"] and words.count("--candidate") == 4
    assert "all-moe=--moe-grouped-gemm --moe-permute-fusion --moe-router-fusion" in words


def test_expected_time_grows_with_the_work():
    assert moe_h200.estimate_s("speed-a", 3) > moe_h200.estimate_s("speed-a", 2)
    assert moe_h200.estimate_s("speed-b", 3, 60) > moe_h200.estimate_s("speed-b", 3)
    # the loss part's runs run at once: more seeds cost no more time
    assert moe_h200.estimate_s("loss", 5) == moe_h200.estimate_s("loss", 3)


def test_collect_copies_results_statuses_and_logs_and_nothing_else(tmp_path, capsys):
    out = tmp_path / "out"
    run = out / "speed-a" / "runs" / "block01" / "all-off"
    run.mkdir(parents=True)
    (out / "speed-a" / "results.json").write_text(json.dumps({"rows": []}))
    (out / "speed-a" / "results.md").write_text("# x\n")
    (run / "status.json").write_text("{}")
    (run / "log.txt").write_text("a long log\n")
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events").write_text("")
    assert moe_h200.main(["--out", str(out), "--collect", str(tmp_path / "small")]) == 0
    got = sorted(str(p.relative_to(tmp_path / "small")) for p in (tmp_path / "small").rglob("*") if p.is_file())
    assert got == ["speed-a/results.json", "speed-a/results.md", "speed-a/runs/block01/all-off/log.txt",
                   "speed-a/runs/block01/all-off/status.json"]  # the log: a resumed run is measured from it
    assert moe_h200.main(["--out", str(tmp_path / "empty"), "--collect", str(tmp_path / "small2")]) == 1


@pytest.mark.parametrize("extra, words", [
    (["--parts", "speed-c"], "unknown speed-c"),
    (["--repeats", "0"], "at least 1"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, extra, words):
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text("")
    with pytest.raises(SystemExit) as info:
        moe_h200.main(["--megatron", str(tree), "--out", str(tmp_path / "o"), *extra])
    assert info.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        moe_h200.main(["--megatron", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert info.value.code == 2 and "no pretrain_gpt.py there" in capsys.readouterr().err
