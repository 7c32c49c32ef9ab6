"""ablate and tune are two callers of one experiment API: their shared options are declared once
(``ExperimentSpec``), and tune neither fakes ablate's command line nor reaches into its internals."""

from __future__ import annotations

import argparse
import ast
import dataclasses

from conftest import REPO

from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate.design import DEFAULT_TOGGLES
from megatron_perf_toggles.tools.ablate.spec import ExperimentSpec
from megatron_perf_toggles.tools.tune import command as tune

TUNE = REPO / "megatron_perf_toggles" / "tools" / "tune"


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def test_every_option_the_two_commands_share_has_one_help_text() -> None:
    ab, tu = _actions(ablate.build_ablate_parser()), _actions(tune.build_tune_parser())
    shared = set(ab) & set(tu)
    assert len(shared) >= 13  # the options both commands take, the script and its arguments included
    for dest in sorted(shared):
        assert ab[dest].help == tu[dest].help, dest
        assert ab[dest].option_strings == tu[dest].option_strings, dest
        assert ab[dest].type == tu[dest].type, dest


def test_the_shared_options_are_the_specs_fields() -> None:
    """Each shared option is a field of ExperimentSpec, whose metadata is the one declaration."""
    ab, tu = _actions(ablate.build_ablate_parser()), _actions(tune.build_tune_parser())
    fields = {f.name: f for f in dataclasses.fields(ExperimentSpec) if f.metadata}
    for dest in set(ab) & set(tu):
        assert dest in fields, f"{dest}: shared by ablate and tune but not declared in ExperimentSpec"
        assert ab[dest].help == fields[dest].metadata["help"]


def test_the_toggle_count_in_help_comes_from_the_registry() -> None:
    text = tune.build_tune_parser().format_help() + ablate.build_ablate_parser().format_help()
    assert "five" not in text
    assert f"all {len(DEFAULT_TOGGLES)}" in " ".join(text.split())


def test_a_commands_own_default_keeps_the_one_help_text() -> None:
    assert ablate.build_ablate_parser().parse_args(["--design", "headline", "s.py"]).out == "ablation"
    assert tune.build_tune_parser().parse_args(["s.py"]).out == "tune"
    assert "(default: ./tune)" in " ".join(tune.build_tune_parser().format_help().split())


def test_tune_builds_no_namespace_and_calls_nothing_private_of_ablate() -> None:
    for path in sorted(TUNE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                assert not ast.unparse(node.func).endswith("Namespace"), \
                    f"{path.name}:{node.lineno} builds an argparse.Namespace"
            if isinstance(node, ast.ImportFrom) and node.module and "ablate" in node.module:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name}:{node.lineno} imports ablate's private {private}"
            if isinstance(node, ast.Import):
                assert all("ablate" not in a.name for a in node.names)


def test_a_spec_is_checked_as_one_line_per_bad_value(tmp_path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    ExperimentSpec(script=str(script)).check()  # the defaults pass
    for bad, words in [({"repeats": 0}, "--repeats 0"), ({"iters": 3}, "--iters 3 must be more than --warmup 3"),
                       ({"confidence": 0.4}, "--confidence 0.4"), ({"budget": 0.0}, "--budget 0.0"),
                       ({"world_size": 0}, "--world-size 0"), ({"target_ci": 2.0}, "--target-ci 2.0")]:
        try:
            ExperimentSpec(script=str(script), **bad).check()
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            assert words in str(error), (bad, str(error))
        else:
            raise AssertionError(f"{bad} was accepted")
