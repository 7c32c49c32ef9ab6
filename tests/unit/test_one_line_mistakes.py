"""Every mistake a newcomer makes with explain and a dry run is one line and exit 2; a layout the
planned world cannot hold is refused on every path; a dry run fits COLUMNS (issue: plan from a laptop)."""

from __future__ import annotations

import argparse
import io
import json
from types import SimpleNamespace

import pytest

from megatron_perf_toggles.core import layout
from megatron_perf_toggles.core.memory.memory_words import summary
from megatron_perf_toggles.errors import PerfTogglesError
from megatron_perf_toggles.launcher import parse_refusal, screen
from megatron_perf_toggles.tools import cli, megatron_usage

pytestmark = pytest.mark.usefixtures("clean_environment")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as done:
        code = int(done.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def test_a_misspelt_megatron_flag_on_the_recorded_surface_is_one_line_with_the_closest_flag(capsys):
    code, out, err = _run(capsys, "explain", "--", "--tensor-model-paralel-size", "2")
    line = _one_line(code, err)
    assert "unrecognized arguments: --tensor-model-paralel-size" in line
    assert "did you mean '--tensor-model-parallel-size'" in line and out == ""


def test_megatron_flags_without_the_dashes_get_the_hint_where_they_go(capsys):
    line = _one_line(*_run(capsys, "explain", "--tensor-model-parallel-size", "2")[::2])
    assert "Megatron's arguments go after --" in line
    near = _one_line(*_run(capsys, "explain", "--word-size", "8")[::2])  # a near miss of explain's own option
    assert "did you mean '--world-size'" in near and "after --" not in near


def test_without_a_world_size_explain_plans_a_world_of_one_and_refuses_tp3(capsys):
    line = _one_line(*_run(capsys, "explain", "--", "--tensor-model-parallel-size", "3")[::2])
    assert "world size 1 is not divisible by TP x PP x CP = 3" in line and "no --world-size given" in line
    code, out, _ = _run(capsys, "explain", "--json", "--world-size", "3", "--", "--tensor-model-parallel-size", "3")
    assert code == 0 and json.loads(out)["target"]["world_size"] == 3


@pytest.mark.parametrize(("world", "args", "words"), [
    (8, {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8}, "TP x PP x CP = 32"),
    (16, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 32}, "EP x ETP x PP = 64"),
    (8, {"tensor_model_parallel_size": 8, "num_attention_heads": 12}, "12 attention heads"),
    (8, {"tensor_model_parallel_size": 4, "group_query_attention": True, "num_query_groups": 2}, "2 query groups"),
    (8, {"expert_model_parallel_size": 8, "num_experts": 12}, "12 experts"),
])
def test_a_layout_the_world_cannot_hold_is_refused(world, args, words):
    with pytest.raises(layout.LayoutError, match=words):
        layout.check(world, args, f"--world-size {world}", groups_may_divide_tp=False)


GQA = {"tensor_model_parallel_size": 4, "group_query_attention": True, "num_attention_heads": 32}


def test_query_groups_that_divide_tp_are_taken_where_megatron_takes_them():
    """Core 0.16 on (rule gqa_groups_divide_tp) each rank holds one whole group where TP is a
    multiple of the groups; earlier cores want the groups a multiple of TP. Groups that neither
    divide TP nor are divisible by it are refused either way."""
    layout.check(8, {**GQA, "num_query_groups": 2}, groups_may_divide_tp=True)
    with pytest.raises(layout.LayoutError, match=r"2 query groups .* not divisible by tensor parallelism 4"):
        layout.check(8, {**GQA, "num_query_groups": 2}, groups_may_divide_tp=False)
    with pytest.raises(layout.LayoutError, match=r"2 query groups .* not divisible by tensor parallelism 4"):
        layout.check(8, {**GQA, "num_query_groups": 2, "use_legacy_models": True}, groups_may_divide_tp=True)
    with pytest.raises(layout.LayoutError, match=r"3 query groups .* neither divide nor are divisible"):
        layout.check(8, {**GQA, "num_attention_heads": 24, "num_query_groups": 3}, groups_may_divide_tp=True)


@pytest.mark.parametrize(("surface", "code"), [("core_v0.15.0", 2), ("core_v0.16.0", 0), ("main", 0)])
def test_explain_checks_query_groups_by_the_planned_megatrons_rules(surface, code, capsys):
    words = ["explain", "--megatron-version", surface, "--world-size", "4", "--", "--num-layers", "2",
             "--hidden-size", "512", "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups",
             "2", "--tensor-model-parallel-size", "4", "--seq-length", "512", "--max-position-embeddings", "512"]
    if code:
        with pytest.raises(SystemExit) as stop:
            cli.main(words)
        assert stop.value.code == code and "2 query groups" in capsys.readouterr().err
    else:
        assert cli.main(words) == 0, capsys.readouterr().err


def test_a_layout_that_fits_is_not_refused():
    layout.check(64, {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8, "num_attention_heads": 96,
                      "expert_model_parallel_size": 2, "num_experts": 8}, groups_may_divide_tp=False)


class _Hooks(SimpleNamespace):
    pass


def _megatron_like_parser() -> argparse.ArgumentParser:
    """A plain argparse parser, as Megatron builds its own (not the package's one-line class)."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--grad-reduce-in-bf16", action="store_true")
    parser.add_argument("--cross-entropy-fusion-impl", choices=["native", "te"])
    return parser


def _refusing_parse(*argv: str) -> None:
    _megatron_like_parser().parse_args(list(argv or ["--bogus-flag", "3"]))


def _options() -> list[str]:
    return [o for a in _megatron_like_parser()._actions for o in a.option_strings]


def test_a_dry_runs_refused_parse_is_one_line_on_the_dry_runs_stderr():
    err = io.StringIO()
    with pytest.raises(SystemExit) as done, parse_refusal.said_in_one_line(_Hooks(capture=False, err=err), SystemExit):
        _refusing_parse()
    assert done.value.code == 2
    assert err.getvalue().splitlines() == [
        "[perf-toggles] error: Megatron's parser: unrecognized arguments: --bogus-flag 3 "
        "(--bogus-flag is not a flag of this Megatron version; the script's --help lists Megatron's flags)"]


# The same mistakes as the dry run's parser (Megatron's own argparse) and explain's (a recorded
# surface, the package's one-line class) meet them, with the fix each must name.
MISTAKES = [
    (["--grad-reduce-in-bf17"], "did you mean '--grad-reduce-in-bf16'?"),
    (["--cross-entropy-fusion-impl", "tee"], "did you mean 'te'?"),
    (["--num-layers", "two"], "give --num-layers a value of type int"),
    (["--num-layers"], "give --num-layers a value"),
]


@pytest.mark.parametrize(("argv", "fix"), MISTAKES)
def test_a_dry_runs_refusal_names_the_fix_explain_names(argv, fix):
    """A misspelt flag in a dry run got "(the script's --help lists Megatron's flags)" where explain
    said "did you mean ...": both now read argparse's words one way (errors.with_fix)."""
    err = io.StringIO()
    with pytest.raises(SystemExit), parse_refusal.said_in_one_line(_Hooks(capture=False, err=err), SystemExit,
                                                                   _options):
        _refusing_parse(*argv)
    dry_run = err.getvalue().splitlines()
    assert len(dry_run) == 1 and dry_run[0].endswith(f"({fix})"), dry_run
    parser = megatron_usage.named("main")(prog="pretrain_gpt.py")
    for action in _megatron_like_parser()._actions[1:]:
        parser._add_action(action)
    with pytest.raises(PerfTogglesError) as explain:
        parser.parse_args(argv)
    assert explain.value.hint == fix
    assert dry_run[0].split(": ", 2)[2] == str(explain.value).split(": ", 1)[1]  # the same words after the prefix


def test_a_planning_parse_raises_the_same_refusal_for_its_caller():
    with pytest.raises(PerfTogglesError) as refused, parse_refusal.said_in_one_line(
            _Hooks(capture=True, err=None), SystemExit, _options):
        _refusing_parse("--grad-reduce-in-bf17")
    assert refused.value.hint == "did you mean '--grad-reduce-in-bf16'?"


def test_a_dry_run_summary_fits_columns(monkeypatch):
    rows = [["gradient_accumulation_fusion", "on", "default", "+709 MB peak per GPU", "reason " * 30]]
    lines = ["decisions:", *screen.table(rows, ["toggle", "value", "source", "peak memory", "reason"], 78),
             "  export CUDA_DEVICE_MAX_CONNECTIONS=1    # " + "why " * 30, "planned for: " + "word " * 40]
    fitted = screen.fit(lines, 80)
    assert all(len(line) <= 80 for line in fitted), fitted
    assert "  export CUDA_DEVICE_MAX_CONNECTIONS=1" in fitted  # the command whole, its comment after
    assert " ".join(fitted).split().count("reason") == 31  # the header and every word of the reason
    assert screen.fit(lines, None) == lines
    monkeypatch.setenv("COLUMNS", "91")
    assert screen.width(io.StringIO()) == 91
    monkeypatch.setenv("COLUMNS", "")
    assert screen.width(io.StringIO()) is None  # a pipe or a file: lines whole


def test_the_memory_line_says_where_each_peak_is_and_where_the_largest_allocation_is():
    """With pipeline parallelism the line names the stage of each figure it gives: stock's peak where
    it is elsewhere than the plan's, the plan's, and the stage of the largest allocation."""
    record = {"stock_peak_mb": 21054.8, "total_peak_memory_delta_mb": -1845.1, "planned_peak_mb": 19209.7,
              "peak_memory_delta_mb": {"a": -1845.1}, "stock_estimate_source": "estimate", "pipeline_stages": 2,
              "stock_peak_at": "on the last pipeline stage, in forward and backward",
              "planned_peak_at": "on the first pipeline stage, in forward and backward",
              "largest_allocation_mb": 224.0, "largest_allocation": "the first MLP projection's output",
              "largest_allocation_stage": "first"}
    line = summary(record)
    assert "stock's estimated peak 20.6 GB per GPU on the last pipeline stage, in forward and backward" in line
    assert "this plan -1.8 GB, planned peak 18.8 GB on the first pipeline stage, in forward and backward" in line
    assert "largest allocation 224 MB on the first pipeline stage (the first MLP projection's output)" in line
    same = summary({**record, "stock_peak_at": record["planned_peak_at"], "pipeline_stages": 1})
    assert "per GPU (estimate)" in same and same.endswith("largest allocation 224 MB")  # one place, one stage
    plain = summary({**record, "stock_peak_at": "in forward and backward", "planned_peak_at": "in forward and backward",
                     "pipeline_stages": 1})
    assert "planned peak 18.8 GB; largest allocation 224 MB" in plain  # one stage, the usual place: unsaid
    step = summary({**record, "stock_peak_at": "at the optimizer step", "planned_peak_at": "in forward and backward",
                    "pipeline_stages": 1})
    assert "per GPU at the optimizer step (estimate)" in step and "18.8 GB in forward and backward;" in step


def test_a_refusal_of_the_plugins_own_inside_the_parse_is_said_once():
    err = io.StringIO()

    def refuse() -> None:
        import sys

        print("[perf-toggles] error: --x was requested, but it cannot run here", file=sys.stderr)
        raise SystemExit(2)

    with pytest.raises(SystemExit) as done, parse_refusal.said_in_one_line(_Hooks(capture=False, err=err), SystemExit):
        refuse()
    assert done.value.code == 2
    assert err.getvalue().splitlines() == ["[perf-toggles] error: --x was requested, but it cannot run here"]


@pytest.mark.parametrize("width", [None, 30, 50, 80, 100, 132, 250])
def test_every_reason_in_a_dry_runs_table_is_whole_at_every_width(width):
    """The table cut reasons at 100 characters ("APEX's fused_weight_gradient_mlp_cud..."): each is
    now wrapped to the width (or beside nothing, on a pipe), every word of it there, in order."""
    from megatron_perf_toggles.launcher import summary as dry_run_summary
    from megatron_perf_toggles.runtime.machine import target as planned
    from megatron_perf_toggles.tools.llama3_8b import LLAMA3_8B_EXAMPLE
    from megatron_perf_toggles.tools.planning import plan_command_line

    target = planned.make_target(8, gpu="h100")
    plan, caps, _, _, launch = plan_command_line(LLAMA3_8B_EXAMPLE, target=target)
    reasons = {dest: d.reason for dest, d in plan.shown().items()}
    assert max(map(len, reasons.values())) > 100  # the one the old table cut
    payload = {"megatron": {"version": "0.20.0", "path": "/m"}, "target": {"summary": planned.describe(target)}}
    lines = dry_run_summary.lines(payload, plan, caps, launch, [], "record.json", "megatron.log", "summary", width)
    words = " ".join(lines).split()
    for dest, reason in reasons.items():
        start = words.index(dest)
        said = reason.split()
        assert any(words[i:i + len(said)] == said for i in range(start, start + 12)), (dest, lines)
    assert not any(line.rstrip().endswith("...") for line in lines)
    if width is not None:
        # over the width: one word too long for it (a flag, a path; never cut either), or an
        # export kept whole so that it pastes into a shell
        assert all(len(line) <= width or len(line.split()) == 1 or line.strip().startswith("export ")
                   for line in lines), lines


def test_a_misspelt_primus_file_names_the_one_beside_it(capsys, tmp_path):
    (tmp_path / "llama3.1_8B-BF16-pretrain.yaml").write_text("modules: {}\n")
    line = _one_line(*_run(capsys, "explain", "--primus-config", str(tmp_path / "llama3.1_8B-BF16-pretrain.yml"))[::2])
    assert "no such file (did you mean 'llama3.1_8B-BF16-pretrain.yaml'?)" in line


@pytest.mark.parametrize(("argv", "hint"), [
    (["doctor", "--jsn"], "did you mean '--json'? see megatron-perf-toggles doctor --help"),  # the command's own
    (["doctor", "--bogus"], "--bogus is not an option of megatron-perf-toggles doctor; "
                            "see megatron-perf-toggles doctor --help"),  # not ablate's --out, nor any other's
    (["--bogus"], "--bogus is not a flag of megatron-perf-toggles; see megatron-perf-toggles --help"),
])
def test_a_flag_a_command_does_not_know_names_that_commands_own(capsys, argv, hint):
    line = _one_line(*_run(capsys, *argv)[::2])
    assert line.endswith(f"({hint})"), line


def test_a_launcher_flag_is_judged_by_its_name_not_its_dashes(capsys):
    from megatron_perf_toggles.launcher import launch

    assert launch.main(["--dryrun", "train.py"]) == 2
    assert "(did you mean '--dry-run'?)" in capsys.readouterr().err
    assert launch.main(["--bogus", "train.py"]) == 2
    said = capsys.readouterr().err
    assert "did you mean" not in said and "--bogus is not a flag of python -m megatron_perf_toggles.run" in said
