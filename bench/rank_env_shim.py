"""Run ``python -m megatron_perf_toggles.run ...`` with one environment change on one rank only.

For proving the rank check: ``torchrun --nproc-per-node 2 bench/rank_env_shim.py 1 GRAD_REDUCE_IN_BF16=0
pretrain_gpt.py <args>`` gives rank 1 (only) a different environment, as a drifted node would.
"""

import os
import runpy
import sys

rank, assignment, *rest = sys.argv[1:]
if os.environ.get("RANK") == rank:
    name, _, value = assignment.partition("=")
    os.environ[name] = value
sys.argv = ["megatron_perf_toggles.run", *rest]
runpy.run_module("megatron_perf_toggles.run", run_name="__main__", alter_sys=True)
