"""Environment parsing: every accepted spelling, and every bad value gives one clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_perf_toggles.core.env import check_settings, parse_bool, read_bool_setting, read_env, read_text_setting
from megatron_perf_toggles.core.registry import SETTINGS, TOGGLES, Setting
from megatron_perf_toggles.errors import EnvValueError, RegistryError

BOOL_TOGGLES = [t for t in TOGGLES if t.kind == "bool"]


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", "On", " 1 "])
def test_true_spellings(raw):
    assert parse_bool("X", raw) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off", "OFF"])
def test_false_spellings(raw):
    assert parse_bool("X", raw) is False


@pytest.mark.parametrize("raw", [None, "", "  "])
def test_unset_or_empty_means_default(raw):
    assert parse_bool("X", raw) is None


@pytest.mark.parametrize("toggle", BOOL_TOGGLES, ids=lambda t: t.env)
@pytest.mark.parametrize("raw", ["0", "1"])
def test_each_bool_toggle_reads_its_variable(toggle, raw):
    settings = read_env({toggle.env: raw})
    assert settings.toggles == {toggle.dest: raw == "1"}


@pytest.mark.parametrize("toggle", BOOL_TOGGLES, ids=lambda t: t.env)
@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "-1", "tru"])
def test_each_bool_toggle_rejects_bad_values(toggle, raw):
    with pytest.raises(EnvValueError) as info:
        read_env({toggle.env: raw})
    text = str(info.value)
    assert toggle.env in text and repr(raw) in text
    for word in ("1/0", "true/false", "yes/no", "on/off"):
        assert word in text


@pytest.mark.parametrize("raw, expected", [("te", "te"), ("native", "native"), ("TE", "te"), ("", None)])
def test_cross_entropy_impl(raw, expected):
    assert read_env({"CROSS_ENTROPY_FUSION_IMPL": raw}).toggles.get("cross_entropy_fusion_impl") == expected


@pytest.mark.parametrize("raw", ["cudnn", "1", "apex"])
def test_cross_entropy_impl_rejects_others(raw):
    with pytest.raises(EnvValueError, match=r"CROSS_ENTROPY_FUSION_IMPL=.*te or native"):
        read_env({"CROSS_ENTROPY_FUSION_IMPL": raw})


@pytest.mark.parametrize("var", ["MEGATRON_PERF_TOGGLES", "MEGATRON_PERF_TOGGLES_TAG_LOG_DIR", "FP4_SELECTIVE_BF16"])
def test_plugin_bool_settings_reject_bad_values(var):
    with pytest.raises(EnvValueError, match=var):
        read_env({var: "sometimes"})


@pytest.mark.parametrize("var", ["FP4_BF16_START", "FP4_BF16_END"])
@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_layer_counts_reject_bad_values(var, raw):
    with pytest.raises(EnvValueError, match=f"{var}=.*whole number"):
        read_env({var: raw})


def test_plugin_switch_and_tagging():
    assert read_env({}).plugin_enabled is True
    assert read_env({"MEGATRON_PERF_TOGGLES": "0"}).plugin_enabled is False
    assert read_env({"MEGATRON_PERF_TOGGLES_TAG_LOG_DIR": "off"}).tag_log_dir is False


def test_bad_value_through_the_provider_exits_2_with_one_line_and_no_traceback(tmp_path):
    code = (
        "import argparse, megatron_perf_toggles as m\n"
        "p = argparse.ArgumentParser(); m.extra_args_provider(p); p.parse_args([])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"GRAD_REDUCE_IN_BF16": "maybe", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2])})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "GRAD_REDUCE_IN_BF16='maybe'" in lines[0] and "Traceback" not in proc.stderr


def test_every_registered_setting_parses_to_its_fields_type():
    check_settings(SETTINGS)  # what the import does; read_env passes the values on by field name


@pytest.mark.parametrize("setting, message", [
    (Setting("X_DRY", "text", "", "help", field="dry_run"), r"kind 'text' gives a str, but EnvSettings\.dry_run is bool"),
    (Setting("X_START", "bool", "", "help", field="fp4_bf16_start"), r"kind 'bool' gives a bool, but .* is int \| None"),
    (Setting("X_NOWHERE", "bool", "", "help", field="nowhere"), r"no EnvSettings field 'nowhere'"),
])
def test_a_setting_whose_kind_does_not_fit_its_field_is_refused(setting, message):
    with pytest.raises(RegistryError, match=message):
        check_settings([setting])


def test_single_setting_readers_are_typed_by_kind():
    assert read_bool_setting("MEGATRON_PERF_TOGGLES_DRY_RUN", {"MEGATRON_PERF_TOGGLES_DRY_RUN": "yes"}) is True
    assert read_bool_setting("MEGATRON_PERF_TOGGLES_DRY_RUN", {}) is None
    assert read_text_setting("MEGATRON_PERF_TOGGLES_ASSUME", {"MEGATRON_PERF_TOGGLES_ASSUME": "rocm"}) == "rocm"
    with pytest.raises(RegistryError, match="of kind 'bool', read as 'text'"):
        read_text_setting("MEGATRON_PERF_TOGGLES_DRY_RUN", {})


@pytest.mark.parametrize("text, release", [
    ("0.17.0rc0", (0, 17, 0)), ("0.18.2", (0, 18, 2)), ("2.20.2", (2, 20, 2)), ("2.8.0.dev0+3fa1", (2, 8, 0)),
    # a local part is no number of the release: Megatron stamps the enclosing checkout's commit
    ("0.19.2+e810d78", (0, 19, 2)), ("0.18.0+1a2", (0, 18, 0)), ("unknown", ()),
])
def test_version_tuple_reads_the_release_only(text, release):
    from megatron_perf_toggles.core.facts import version_tuple

    assert version_tuple(text) == release
