"""docs/multi-node.md: every launch on the page, run as its own dry run against a real checkout.

The page's blocks are run as they are written, by bash. The cluster's launchers are stood in for
by small scripts on PATH that do what they do for rank 0 of node 0 and nothing more: ``torchrun``
sets ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` / ``MASTER_*`` from its options and runs the module;
``srun`` runs its command once with Slurm's task variables; ``scontrol show hostnames`` names the
nodes; the ``#SBATCH`` lines give the allocation, as ``sbatch`` would. Every launch is made a dry
run with ``MEGATRON_PERF_TOGGLES_DRY_RUN=1`` (the page's own last section), so Megatron's parse and
validate_args judge it with the world each launcher gives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, megatron_trees
from sandbox import clean_environ

PAGE = REPO / "docs" / "multi-node.md"
BLOCK = re.compile(r"<!-- multi-node: (\S+) -->\n```bash\n(.*?)```", re.S)
pytestmark = [pytest.mark.real_megatron, pytest.mark.own_process,
              pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not available")]

TORCHRUN = '''import os, sys
args, opts = sys.argv[1:], {}
while args and args[0] != "-m":
    name = args.pop(0).lstrip("-").replace("-", "_")
    opts[name] = args.pop(0)
module, rest = args[1], args[2:]
nproc = int(opts["nproc_per_node"])
os.environ.update(WORLD_SIZE=str(int(opts["nnodes"]) * nproc), RANK=str(int(opts["node_rank"]) * nproc),
                  LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=opts["master_addr"],
                  MASTER_PORT=opts["master_port"])
os.execv(sys.executable, [sys.executable, "-m", module, *rest])
'''
SRUN = '''import os, sys
nodes, per_node = int(os.environ["SLURM_JOB_NUM_NODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
os.environ.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NNODES=str(nodes),
                  SLURM_NTASKS=str(nodes * per_node))
os.execvp(sys.argv[1], sys.argv[1:])
'''
SCONTROL = '''import os, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
for i in range(int(os.environ["SLURM_JOB_NUM_NODES"])):
    print(f"node{i:03d}")
'''


def _blocks() -> dict[str, str]:
    return dict(BLOCK.findall(PAGE.read_text()))


def _stand_ins(where: Path) -> Path:
    """torchrun, srun, scontrol and python on PATH: the session's interpreter behind each."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    for name, code in (("torchrun", TORCHRUN), ("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / f"{name}.py").write_text(code)
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "{bin_dir / name}.py" "$@"\n')
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a link would leave the venv
    (bin_dir / "python").chmod(0o755)
    return bin_dir


def _allocation(script: str) -> dict[str, str]:
    """What sbatch gives the script from its #SBATCH lines."""
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script, re.M))
    if "nodes" not in sbatch:
        return {}
    nodes = int(sbatch["nodes"])
    return {"SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
            "SLURM_NTASKS_PER_NODE": sbatch.get("ntasks-per-node", "1"),
            "SLURM_JOB_NODELIST": f"node[000-{nodes - 1:03d}]"}


def _dry_run(name: str, tmp_path: Path) -> dict:
    blocks = _blocks()
    tree = megatron_trees()[-1]
    (tmp_path / "job.sh").write_text(blocks["job.sh"].replace("/path/to/Megatron-LM", str(tree)))
    (tmp_path / "launch.sh").write_text(blocks[name])
    env = clean_environ({k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)})
    env.update(PATH=f"{_stand_ins(tmp_path)}{os.pathsep}{env.get('PATH', '')}", NODE_RANK="0", MASTER_ADDR="node000",
               MEGATRON_PERF_TOGGLES_DRY_RUN="1", MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT="json",
               PYTHONPATH=str(REPO), **_allocation(blocks[name]))
    proc = subprocess.run(["bash", "launch.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_page_has_every_launch():
    assert set(_blocks()) == {"job.sh", "plan", "one-machine", "torchrun", "torchrun-dry-run", "slurm-torchrun",
                              "slurm-tasks"}


# (block, ranks, data-parallel size): 8 nodes x 8 GPUs, TP 4 x PP 2; the one-machine try of 2 nodes
WORLDS = {"plan": (64, 8), "one-machine": (16, 2), "torchrun": (64, 8), "torchrun-dry-run": (64, 8),
          "slurm-torchrun": (64, 8), "slurm-tasks": (64, 8)}


@pytest.mark.parametrize("name", list(WORLDS))
def test_each_launch_plans_the_whole_job(name, tmp_path):
    record = _dry_run(name, tmp_path)
    args = record["effective_args"]
    assert (args["world_size"], args["data_parallel_size"]) == WORLDS[name]
    assert args["rank"] == 0 and record["megatron"]["version"]
    assert record["decisions"]["grad_reduce_in_bf16"]["value"] is True  # the plugin planned it
    assert any(v["name"] == "CUDA_DEVICE_MAX_CONNECTIONS" for v in record["launch_environment"])
    assert (record["layout"]["tp"], record["layout"]["pp"], record["layout"]["dp"]) == (4, 2, WORLDS[name][1])


@pytest.mark.parametrize("name", ["one-machine", "torchrun-dry-run"])
def test_the_gpu_is_the_one_the_page_names(name, tmp_path):
    target = _dry_run(name, tmp_path)["target"]
    assert target["gpu"]["name"] == "h100" and target["gpu_source"] == "--gpu h100"


def test_a_torchrun_launch_with_no_gpu_says_how_its_command_names_one(tmp_path):
    """The plan said "--gpu picks another" for a torchrun command that has no --gpu of its own."""
    source = _dry_run("torchrun", tmp_path)["target"]["gpu_source"]
    if source is None:
        pytest.skip("a GPU is visible here: the launch plans for it")
    assert source == ("no GPU visible here; --gpu NAME before the script (or MEGATRON_PERF_TOGGLES_PLAN=:NAME) "
                      "picks another")
