"""The precision tag and log-directory tagging."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.core.precision import log_dir_warnings, mislabelled, precision_tag, tag_dir, tagged_log_dirs


@pytest.mark.parametrize(
    "args, tag",
    [
        ({"bf16": True}, "bf16"),
        ({"fp16": True}, "fp16"),
        ({}, "fp32"),
        ({"bf16": True, "fp8": "hybrid", "fp8_recipe": "delayed"}, "fp8"),
        ({"bf16": True, "fp8": "e4m3", "fp8_recipe": "tensorwise"}, "fp8_tensorwise"),
        ({"bf16": True, "fp8": "e4m3", "fp8_recipe": "mxfp8"}, "mxfp8"),
        ({"bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise"}, "fp8_blockwise"),
        ({"bf16": True, "fp8": "e4m3", "fp8_recipe": "custom"}, "fp8_custom"),
        ({"bf16": True, "fp4": "e2m1", "fp4_recipe": "nvfp4"}, "nvfp4"),
        ({"bf16": True, "fp4": "e2m1", "fp4_recipe": "mxfp4"}, "mxfp4"),
        ({"bf16": True, "fp8": None, "fp8_recipe": "tensorwise"}, "bf16"),
    ],
)
def test_precision_tag(args, tag):
    assert precision_tag(args) == tag


@pytest.mark.parametrize(
    "path, expected",
    [("/runs/tb", "/runs/tb/bf16"), ("/runs/tb/", "/runs/tb/bf16"), ("/runs/tb/bf16", "/runs/tb/bf16"),
     ("/runs/tb/bf16/", "/runs/tb/bf16/"), ("rel", "rel/bf16"), ("/runs/fp8", "/runs/fp8/bf16")],
)
def test_tag_dir_is_idempotent(path, expected):
    assert tag_dir(path, "bf16") == expected
    assert tag_dir(tag_dir(path, "bf16"), "bf16") == tag_dir(path, "bf16")


def test_only_log_dirs_are_tagged_never_checkpoints():
    args = {"tensorboard_dir": "/tb", "wandb_save_dir": None, "save": "/ck", "load": "/ck"}
    assert tagged_log_dirs(args, "fp8") == {"tensorboard_dir": "/tb/fp8"}


@pytest.mark.parametrize("path", ["/exp/run/bf16/2024-01-01_00-00-00", "exp/bf16/ts/", "/bf16"])
def test_a_path_already_tagged_by_a_script_is_not_tagged_again(path):
    assert tag_dir(path, "bf16") == path
    assert mislabelled(path, "bf16") is None
    assert log_dir_warnings({"tensorboard_dir": path}, "bf16") == []


def test_a_path_tagged_with_another_precision_is_mislabelled():
    path = "/exp/run/fp8/2024-01-01_00-00-00"
    assert mislabelled(path, "nvfp4") == "fp8"
    assert tag_dir(path, "nvfp4") == path + "/nvfp4"
    [line] = log_dir_warnings({"tensorboard_dir": path, "wandb_save_dir": "/wb"}, "nvfp4")
    assert "--tensorboard-dir" in line and "'fp8'" in line and "nvfp4" in line and path + "/nvfp4" in line


def test_tag_names_inside_a_component_are_not_tags():
    assert mislabelled("/exp/bf16_run", "fp8") is None
    assert tag_dir("/exp/bf16_run", "fp8") == "/exp/bf16_run/fp8"
