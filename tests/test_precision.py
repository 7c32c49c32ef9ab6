"""The precision tag and log-directory tagging."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.precision import precision_tag, tag_dir, tagged_log_dirs


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
