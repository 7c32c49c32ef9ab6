"""Gradient-reduction bytes read from NCCL's collective log (megatron_perf_toggles.tools.nccl_log), on the real
COLL lines of two 6-iteration DP=2 runs of Megatron main on 2x H200 (local layers)."""

from __future__ import annotations

import pytest
from conftest import REPO

from megatron_perf_toggles.tools import nccl_log

FIXTURES = REPO / "tests" / "fixtures" / "nccl"
PARAMS = 2023788544  # "number of parameters" Megatron printed in both runs (hidden 4096, ffn 14336, 4 layers)


@pytest.mark.parametrize("arm, dtype, nbytes, redop", [("off", "float32", 4, "sum"), ("on", "bfloat16", 2, "avg")])
def test_grad_reduce_scatter_per_step(arm, dtype, nbytes, redop):
    traffic = nccl_log.nccl_traffic((FIXTURES / f"dp2_{arm}_coll.log").read_text(), iters=6)
    step = traffic["large_per_step"]
    assert step[f"ReduceScatter/{dtype}"] == {"calls": 1.0, "buffer_bytes": PARAMS * nbytes, "reduce_ops": [redop]}
    # The distributed optimizer all-gathers the updated bf16 parameters in both arms.
    assert step["AllGather/bfloat16"]["buffer_bytes"] == PARAMS * 2
    assert not any(k.startswith("ReduceScatter/") and dtype not in k for k in step)


def test_only_device_0_lines_are_counted():
    line = ("h:1:1 [{dev}] NCCL INFO ReduceScatter: opCount 0 sendbuff 0x1 recvbuff 0x1 count 2097152 datatype 9 "
            "op 0 root 0 comm 0x1 [nranks=2] stream 0x1\n")
    traffic = nccl_log.nccl_traffic(line.format(dev=0) + line.format(dev=1), iters=1)
    assert traffic["totals"]["ReduceScatter/bfloat16"]["calls"] == 1
    assert traffic["large_per_step"]["ReduceScatter/bfloat16"]["buffer_bytes"] == 2097152 * 2 * 2


def test_parameter_count_from_megatron_lines():
    old = " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 2023788544\n"
    new = " > number of parameters on (tensor, gtp_remat, pipeline) model parallel rank (0, 0, 0): 12345\n"
    assert nccl_log.param_count(old) == PARAMS and nccl_log.param_count(new) == 12345
    assert nccl_log.param_count("no such line") is None
    assert nccl_log.grad_buffer_bytes(PARAMS, True) * 2 == nccl_log.grad_buffer_bytes(PARAMS, False) == PARAMS * 4
