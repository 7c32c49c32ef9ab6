"""Which checkpoint layouts name the distributed optimizer's state by the gradient dtype."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.core.ckpt_layout import (
    GRAD_DTYPE_KEYED,
    MODEL_SPACE,
    NO_OPTIMIZER_BUFFERS,
    checkpoint_facts,
    grad_buffer_dtype,
    loads_optimizer_state,
    optimizer_layout,
)

NEW = {"use_distributed_optimizer": True, "ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": False,
       "dist_ckpt_save_pre_mcore_014": False, "ckpt_fully_parallel_save": True}
OLD = {"use_distributed_optimizer": True, "ckpt_format": "torch_dist", "ckpt_fully_parallel_save": True}


@pytest.mark.parametrize("args, version, expected", [
    ({**NEW, "use_distributed_optimizer": False}, "0.20", (NO_OPTIMIZER_BUFFERS, "no distributed optimizer")),
    (NEW, "0.20", (GRAD_DTYPE_KEYED, "dp_reshardable")),
    ({**NEW, "dist_ckpt_optim_fully_reshardable": True}, "0.20", (MODEL_SPACE, "fully_reshardable")),
    ({**NEW, "ckpt_format": "fsdp_dtensor"}, "0.20", (MODEL_SPACE, "fsdp_dtensor")),
    ({**NEW, "ckpt_format": "torch"}, "0.20", (GRAD_DTYPE_KEYED, "torch format, distrib_optim.pt per buffer dtype")),
    (OLD, "0.13", (MODEL_SPACE, "fully_sharded_model_space")),
    ({**OLD, "ckpt_fully_parallel_save": False}, "0.13", (GRAD_DTYPE_KEYED, "dp_zero_gather_scatter")),
    # 0.15 alone still honours --dist-ckpt-save-pre-mcore-014; later versions ignore the flag.
    ({**NEW, "dist_ckpt_save_pre_mcore_014": True}, "0.15.0", (MODEL_SPACE, "fully_sharded_model_space")),
    ({**NEW, "dist_ckpt_save_pre_mcore_014": True}, "0.16.0", (GRAD_DTYPE_KEYED, "dp_reshardable")),
    ({**NEW, "ckpt_format": None}, None, (GRAD_DTYPE_KEYED, "dp_reshardable")),
])
def test_layout(args, version, expected):
    assert optimizer_layout(args, version) == expected


@pytest.mark.parametrize("args, expected", [
    ({"load": "/ck"}, True),
    ({"load": "/ck", "no_load_optim": True}, False),
    ({"load": "/ck", "finetune": True}, False),
    ({"load": None}, False),
    ({}, False),
])
def test_loads_optimizer_state(args, expected):
    assert loads_optimizer_state(args) is expected


def test_0_15_with_an_old_torch_saves_the_pre_0_14_layouts():
    args = {**NEW, "dist_ckpt_optim_fully_reshardable": True, "ckpt_fully_parallel_save": False}
    assert optimizer_layout(args, "0.15.0", "2.5.1") == (GRAD_DTYPE_KEYED, "dp_zero_gather_scatter")
    assert optimizer_layout(args, "0.15.0", "2.6.0") == (MODEL_SPACE, "fully_reshardable")
    assert optimizer_layout(args, "0.16.0", "2.5.1") == (MODEL_SPACE, "fully_reshardable")


@pytest.mark.parametrize("args, grad_reduce_in_bf16, expected", [
    ({"bf16": True}, True, "bf16"),
    ({"bf16": True}, False, "fp32"),
    ({"bf16": True, "main_grads_dtype": "bf16"}, False, "bf16"),
    ({"bf16": True, "main_grads_dtype": "bf16", "accumulate_allreduce_grads_in_fp32": True}, False, "fp32"),
    ({"bf16": True, "accumulate_allreduce_grads_in_fp32": True}, True, "bf16"),  # the toggle wins, as in Megatron
    ({"fp16": True}, True, "fp16"),
    ({"fp16": True, "accumulate_allreduce_grads_in_fp32": True}, False, "fp32"),
    ({}, True, "fp32"),
])
def test_grad_buffer_dtype(args, grad_reduce_in_bf16, expected):
    assert grad_buffer_dtype(args, grad_reduce_in_bf16) == expected


def test_checkpoint_facts():
    facts = checkpoint_facts({**NEW, "bf16": True, "no_save_optim": True}, True, "0.20")
    assert facts == {"optimizer_layout": [GRAD_DTYPE_KEYED, "dp_reshardable"], "grad_buffer_dtype": "bf16",
                     "optimizer_state_saved": False}
