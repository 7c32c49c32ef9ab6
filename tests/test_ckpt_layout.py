"""Which checkpoint layouts name the distributed optimizer's state by the gradient dtype."""

from __future__ import annotations

import pytest

from megatron_perf_toggles.ckpt_layout import (
    GRAD_DTYPE_KEYED,
    MODEL_SPACE,
    NO_OPTIMIZER_BUFFERS,
    loads_optimizer_state,
    optimizer_layout,
)

NEW = {"use_distributed_optimizer": True, "ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": False,
       "dist_ckpt_save_pre_mcore_014": False, "ckpt_fully_parallel_save": True}
OLD = {"use_distributed_optimizer": True, "ckpt_format": "torch_dist", "ckpt_fully_parallel_save": True}


@pytest.mark.parametrize("args, version, expected", [
    ({**NEW, "use_distributed_optimizer": False}, (0, 20), (NO_OPTIMIZER_BUFFERS, "no distributed optimizer")),
    (NEW, (0, 20), (GRAD_DTYPE_KEYED, "dp_reshardable")),
    ({**NEW, "dist_ckpt_optim_fully_reshardable": True}, (0, 20), (MODEL_SPACE, "fully_reshardable")),
    ({**NEW, "ckpt_format": "fsdp_dtensor"}, (0, 20), (MODEL_SPACE, "fsdp_dtensor")),
    ({**NEW, "ckpt_format": "torch"}, (0, 20), (GRAD_DTYPE_KEYED, "torch format, distrib_optim.pt per buffer dtype")),
    (OLD, (0, 13), (MODEL_SPACE, "fully_sharded_model_space")),
    ({**OLD, "ckpt_fully_parallel_save": False}, (0, 13), (GRAD_DTYPE_KEYED, "dp_zero_gather_scatter")),
    # 0.15 alone still honours --dist-ckpt-save-pre-mcore-014; later versions ignore the flag.
    ({**NEW, "dist_ckpt_save_pre_mcore_014": True}, (0, 15, 0), (MODEL_SPACE, "fully_sharded_model_space")),
    ({**NEW, "dist_ckpt_save_pre_mcore_014": True}, (0, 16, 0), (GRAD_DTYPE_KEYED, "dp_reshardable")),
    ({**NEW, "ckpt_format": None}, (), (GRAD_DTYPE_KEYED, "dp_reshardable")),
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
