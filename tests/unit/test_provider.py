"""The argparse adapter on a recorded Megatron parser: explicit detection, write-back, provenance."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from megatron_perf_toggles import chain_providers, extra_args_provider
from megatron_perf_toggles.core import registry
from megatron_perf_toggles.runtime import provider
from megatron_perf_toggles.tools.surfaces import replay

ASSUME_ALL = {"MEGATRON_PERF_TOGGLES_ASSUME": "apex,te=2.20"}
BASE = ["--bf16", "--position-embedding-type", "rope", "--num-layers", "4"]


def parse(argv, environ=None, surface="main", announce=False):
    parser = replay.parser_from_surface(replay.load_surface(surface))
    provider.attach(parser, environ={**ASSUME_ALL, **(environ or {})}, announce=announce)
    return parser.parse_args([*BASE, *argv]), parser


def test_defaults_reach_args_with_source():
    args, _ = parse([])
    assert args.grad_reduce_in_bf16 is True and args.ddp_average_in_collective is True
    assert args.perf_toggles["grad_reduce_in_bf16"]["source"] == "default"
    assert args.perf_toggles_precision == "bf16"


def test_explicit_flags_are_detected_both_directions():
    args, _ = parse(["--no-grad-reduce-in-bf16", "--gradient-accumulation-fusion"])
    assert args.grad_reduce_in_bf16 is False and args.perf_toggles["grad_reduce_in_bf16"]["source"] == "cli"
    assert args.perf_toggles["gradient_accumulation_fusion"]["source"] == "cli"
    args, _ = parse(["--grad-reduce-in-bf16"], environ={"GRAD_REDUCE_IN_BF16": "0"})
    assert args.grad_reduce_in_bf16 is True and args.perf_toggles["grad_reduce_in_bf16"]["source"] == "cli"


def test_explicit_value_equal_to_megatron_default_still_counts_as_cli():
    args, _ = parse(["--cross-entropy-fusion-impl", "native"])
    assert args.perf_toggles["cross_entropy_fusion_impl"] == {
        "value": "native", "source": "cli", "reason": "set on the command line (--cross-entropy-fusion-impl native)",
        "peak_memory_delta_mb": None}  # no model shape given: the memory change is unknown


def test_env_sets_defaults():
    args, _ = parse([], environ={"DDP_AVERAGE_IN_COLLECTIVE": "off"})
    assert args.ddp_average_in_collective is False
    assert args.perf_toggles["ddp_average_in_collective"]["reason"] == "DDP_AVERAGE_IN_COLLECTIVE=0"


def test_plugin_disabled_restores_megatron_defaults():
    stock = replay.parser_from_surface(replay.load_surface("main")).parse_args([])
    args, _ = parse([], environ={"MEGATRON_PERF_TOGGLES": "0"})
    stock_dests = [t.dest for t in registry.TOGGLES if hasattr(stock, t.dest)]  # the flags stock declares
    assert "grad_reduce_in_bf16" in stock_dests and "moe_grouped_gemm" in stock_dests
    for dest in stock_dests:
        assert getattr(args, dest) == getattr(stock, dest), dest


def test_no_sentinel_leaks_into_args():
    args, _ = parse([], environ={"MEGATRON_PERF_TOGGLES": "0"})
    assert not any(v is provider.UNSET for v in vars(args).values())


def test_install_is_idempotent_and_chain_dedupes():
    parser = replay.parser_from_surface(replay.load_surface("main"))
    chained = chain_providers(extra_args_provider, None, extra_args_provider)
    assert chained.providers == (extra_args_provider,)
    chained(parser)
    n = len(parser._actions)
    extra_args_provider(parser)
    assert len(parser._actions) == n


def test_chain_runs_other_providers_in_order():
    seen = []

    def other(p):
        seen.append("other")
        p.add_argument("--my-flag", action="store_true")
        return p

    parser = argparse.ArgumentParser()
    chain_providers(other, extra_args_provider)(parser)
    args = parser.parse_args(["--my-flag"])
    assert seen == ["other"] and args.my_flag is True and "grad_reduce_in_bf16" in args.perf_toggles


def test_help_lists_env_var_and_default(capsys):
    parser = replay.parser_from_surface(replay.load_surface("main"))
    provider.attach(parser, environ={"GRAD_REDUCE_IN_BF16": "0"}, announce=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--no-grad-reduce-in-bf16" in out and "--fused-single-qkv-rope" in out
    assert "off (from GRAD_REDUCE_IN_BF16)" in out
    assert "FUSED_SINGLE_QKV_ROPE" in out


def test_announce_prints_once_on_rank0_and_writes_record(tmp_path, capsys):
    parser = replay.parser_from_surface(replay.load_surface("main"))
    provider.attach(parser, environ={**ASSUME_ALL, "RANK": "0"}, announce=True)
    args = parser.parse_args([*BASE, "--tensorboard-dir", str(tmp_path / "tb")])
    out = capsys.readouterr().out.splitlines()
    lines = [ln for ln in out if ln.startswith("[perf-toggles] grad_reduce_in_bf16:")]
    assert lines == ["[perf-toggles] grad_reduce_in_bf16: on (default; plugin default; GRAD_REDUCE_IN_BF16=0 turns it off)"]
    assert args.tensorboard_dir == str(tmp_path / "tb" / "bf16")
    record = json.loads((tmp_path / "tb" / "bf16" / "perf_toggles.json").read_text())
    assert record["decisions"] == args.perf_toggles
    assert record["precision"] == "bf16" and record["version"]
    assert record["capabilities"]["apex_fused_wgrad"] is True
    assert [p.name for p in (tmp_path / "tb" / "bf16").iterdir()] == ["perf_toggles.json"]  # no temp left


def test_other_ranks_stay_quiet(tmp_path, capsys):
    parser = replay.parser_from_surface(replay.load_surface("main"))
    provider.attach(parser, environ={**ASSUME_ALL, "RANK": "3"}, announce=True)
    args = parser.parse_args([*BASE, "--tensorboard-dir", str(tmp_path / "tb")])
    assert capsys.readouterr().out == ""
    assert args.tensorboard_dir == str(tmp_path / "tb" / "bf16")  # every rank computes the same path
    assert not (tmp_path / "tb").exists()


def test_resume_does_not_double_tag(tmp_path):
    args, _ = parse(["--tensorboard-dir", str(tmp_path / "tb" / "bf16"), "--save", str(tmp_path / "ck"),
                     "--load", str(tmp_path / "ck")])
    assert args.tensorboard_dir == str(tmp_path / "tb" / "bf16")
    assert args.save == str(tmp_path / "ck") and args.load == str(tmp_path / "ck")


def test_fp8_tag_reaches_dirs():
    args, _ = parse(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--tensorboard-dir", "/x/tb",
                     "--wandb-save-dir", "/x/wb"])
    assert (args.tensorboard_dir, args.wandb_save_dir) == ("/x/tb/fp8_tensorwise", "/x/wb/fp8_tensorwise")


def test_cannot_honour_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--use-torch-fsdp2", "--gradient-accumulation-fusion"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[perf-toggles] error: --gradient-accumulation-fusion")


def test_unknown_assume_entry_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse([], environ={"MEGATRON_PERF_TOGGLES_ASSUME": "apex,tpu"})
    assert info.value.code == 2
    assert "unknown entry 'tpu'" in capsys.readouterr().err


def test_parse_known_args_path_also_decides():
    parser = replay.parser_from_surface(replay.load_surface("main"))
    provider.attach(parser, environ=ASSUME_ALL, announce=False)
    args, extra = parser.parse_known_args([*BASE, "--not-a-megatron-flag"])
    assert extra == ["--not-a-megatron-flag"] and "fused_single_qkv_rope" in args.perf_toggles


def test_record_write_is_atomic(tmp_path, monkeypatch):
    from megatron_perf_toggles.runtime import provenance

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        provenance.write_atomic(str(tmp_path), {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_resume_compares_with_the_run_that_saved_the_checkpoint(tmp_path, capsys):
    ck = tmp_path / "ck"

    def launch(environ):
        parser = replay.parser_from_surface(replay.load_surface("main"))
        provider.attach(parser, environ={**ASSUME_ALL, "RANK": "0", **environ}, announce=True)
        args = parser.parse_args([*BASE, "--save", str(ck), "--load", str(ck)])
        return args, capsys.readouterr().out

    def megatron_saves(iteration):  # what Megatron writes after a checkpoint
        (ck / "latest_checkpointed_iteration.txt").write_text(str(iteration))

    _, out = launch({})
    assert "resuming from" not in out
    megatron_saves(4)
    args, out = launch({"GRAD_REDUCE_IN_BF16": "0"})
    assert "warning: resuming from" in out and "(iteration 4)" in out and "grad_reduce_in_bf16 on -> off" in out
    assert args.grad_reduce_in_bf16 is False  # a warning, not a refusal
    # That launch crashed before saving: the next resume still compares with the run that saved 4.
    _, out = launch({})
    assert "resuming from" not in out
    megatron_saves(8)  # ... and this one saved iteration 8 with the original toggles
    _, out = launch({"DDP_AVERAGE_IN_COLLECTIVE": "0"})
    assert "(iteration 8)" in out and "ddp_average_in_collective on -> off" in out
    assert "grad_reduce_in_bf16" not in out.split("resuming from")[1]


# --- resume: the checkpoint's optimizer layout can depend on grad_reduce_in_bf16 ----------------

DISTOPT = ["--use-distributed-optimizer"]


def _resume_pair(tmp_path, capsys, first_env, then_env, extra=(), surface="main", then_extra=()):
    """Launch once (writes the history), let 'Megatron' save iteration 4, then launch again."""
    ck = tmp_path / "ck"

    def launch(environ, more):
        parser = replay.parser_from_surface(replay.load_surface(surface))
        provider.attach(parser, environ={**ASSUME_ALL, "RANK": "0", **environ}, announce=True)
        args = parser.parse_args([*BASE, *extra, *more, "--save", str(ck), "--load", str(ck)])
        captured = capsys.readouterr()
        return args, captured.out + captured.err

    launch(first_env, ())
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    return launch(then_env, then_extra), ck


def test_resume_keeps_grad_dtype_when_the_optimizer_state_is_keyed_by_it(tmp_path, capsys):
    (args, out), ck = _resume_pair(tmp_path, capsys, {}, {"GRAD_REDUCE_IN_BF16": "0"}, DISTOPT)
    history = [json.loads(line) for line in (ck / "perf_toggles_history.jsonl").read_text().splitlines()]
    assert history[0]["optimizer_layout"] == ["grad-dtype-keyed", "dp_reshardable"]
    assert args.grad_reduce_in_bf16 is True
    record = args.perf_toggles["grad_reduce_in_bf16"]
    assert record["source"] == "guard" and "(iteration 4)" in record["reason"] and "dp_reshardable" in record["reason"]
    assert "GRAD_REDUCE_IN_BF16=0" in out and "overridden to True" in out
    assert "different toggles" not in out  # nothing differs any more


def test_resume_refuses_an_explicit_flag_the_checkpoint_cannot_load(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _resume_pair(tmp_path, capsys, {}, {}, DISTOPT, then_extra=["--no-grad-reduce-in-bf16"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--no-grad-reduce-in-bf16" in err and "--no-load-optim" in err and "Traceback" not in err


@pytest.mark.parametrize("then_extra, surface", [
    (["--no-load-optim"], "main"),  # fresh optimizer state: nothing keyed is loaded
    (["--dist-ckpt-optim-fully-reshardable"], "main"),  # model-space layout on the resuming side
    ([], "core_v0.13.0"),  # 0.13's default fully parallel save: fully_sharded_model_space
])
def test_resume_honours_the_change_where_the_layout_allows_it(tmp_path, capsys, then_extra, surface):
    first = then_extra if "--dist-ckpt-optim-fully-reshardable" in then_extra else []
    ck = tmp_path / "ck"

    def launch(environ, more):
        parser = replay.parser_from_surface(replay.load_surface(surface))
        provider.attach(parser, environ={**ASSUME_ALL, "RANK": "0", **environ}, announce=True)
        args = parser.parse_args([*BASE, *DISTOPT, *more, "--save", str(ck), "--load", str(ck)])
        return args, capsys.readouterr().out

    launch({}, first)
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    args, out = launch({"GRAD_REDUCE_IN_BF16": "0"}, then_extra)
    assert args.grad_reduce_in_bf16 is False
    assert "grad_reduce_in_bf16 on -> off (numerics change; the checkpoint layout does not)" in out


def test_resume_uses_the_layout_the_saving_run_recorded(tmp_path, capsys):
    # Saved with --dist-ckpt-optim-fully-reshardable (model space); the resume omits the flag, which
    # would save dp_reshardable, but what loads is the saved layout: the change is honoured.
    ck = tmp_path / "ck"

    def launch(environ, more):
        parser = replay.parser_from_surface(replay.load_surface("main"))
        provider.attach(parser, environ={**ASSUME_ALL, "RANK": "0", **environ}, announce=True)
        return parser.parse_args([*BASE, *DISTOPT, *more, "--save", str(ck), "--load", str(ck)])

    launch({}, ["--dist-ckpt-optim-fully-reshardable"])
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    args = launch({"GRAD_REDUCE_IN_BF16": "0"}, [])
    assert args.grad_reduce_in_bf16 is False


def test_resume_on_0_13_without_fully_parallel_save_is_keyed(tmp_path, capsys):
    (args, _out), _ = _resume_pair(tmp_path, capsys, {}, {"GRAD_REDUCE_IN_BF16": "0"},
                                   [*DISTOPT, "--no-ckpt-fully-parallel-save"], surface="core_v0.13.0")
    assert args.grad_reduce_in_bf16 is True and "dp_zero_gather_scatter" in args.perf_toggles["grad_reduce_in_bf16"]["reason"]


def _launch_on(ck, capsys, environ, more=(), surface="main"):
    parser = replay.parser_from_surface(replay.load_surface(surface))
    provider.attach(parser, environ={**ASSUME_ALL, "RANK": "0", **environ}, announce=True)
    args = parser.parse_args([*BASE, *DISTOPT, *more, "--save", str(ck), "--load", str(ck)])
    captured = capsys.readouterr()
    return args, captured.out + captured.err


def test_resume_finds_the_writer_of_the_iteration_megatron_loads(tmp_path, capsys):
    ck = tmp_path / "ck"
    _launch_on(ck, capsys, {})  # bf16 buffer, saves 4
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    _launch_on(ck, capsys, {"GRAD_REDUCE_IN_BF16": "0"}, ["--no-load-optim"])  # fp32 buffer from 4, saves 8
    (ck / "latest_checkpointed_iteration.txt").write_text("8")
    args, _ = _launch_on(ck, capsys, {})
    assert args.grad_reduce_in_bf16 is False and "(iteration 8)" in args.perf_toggles["grad_reduce_in_bf16"]["reason"]
    # --ckpt-step (0.13 to 0.15) loads iteration 4, written with a bf16 buffer in a keyed layout.
    args, _ = _launch_on(ck, capsys, {"GRAD_REDUCE_IN_BF16": "0"}, ["--ckpt-step", "4"], surface="core_v0.13.0")
    assert args.grad_reduce_in_bf16 is True and "(iteration 4)" in args.perf_toggles["grad_reduce_in_bf16"]["reason"]


def test_resume_sees_a_newer_global_non_persistent_checkpoint(tmp_path, capsys):
    ck = tmp_path / "ck"
    _launch_on(ck, capsys, {}, ["--non-persistent-ckpt-type", "global"])
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    _launch_on(ck, capsys, {"GRAD_REDUCE_IN_BF16": "0"}, ["--non-persistent-ckpt-type", "global", "--no-load-optim"])
    (ck / "non_persistent").mkdir()
    (ck / "non_persistent" / "latest_checkpointed_iteration.txt").write_text("6")  # written by the fp32 launch
    args, _ = _launch_on(ck, capsys, {}, ["--non-persistent-ckpt-type", "global"])
    assert args.grad_reduce_in_bf16 is False and "(iteration 6)" in args.perf_toggles["grad_reduce_in_bf16"]["reason"]


def test_a_malformed_history_is_skipped_without_a_traceback(tmp_path, capsys):
    ck = tmp_path / "ck"
    _launch_on(ck, capsys, {})
    with open(ck / "perf_toggles_history.jsonl", "a") as fh:
        fh.write('null\n[1, 2]\n{"start_iteration": 0, "decisions": 5}\n{"torn": \n')
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    args, out = _launch_on(ck, capsys, {"GRAD_REDUCE_IN_BF16": "0"})
    assert args.grad_reduce_in_bf16 is True and "Traceback" not in out
