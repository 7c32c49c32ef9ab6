"""The benchmark presets (bench/h200_ablate.py): thin ablate calls, checked without a GPU."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, megatron_trees

sys.path.insert(0, str(REPO / "bench"))
import h200_ablate


def _commands(tmp_path, *extra):
    tree = tmp_path / "Megatron-LM"
    tree.mkdir(exist_ok=True)
    (tree / "pretrain_gpt.py").write_text("")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "h200_ablate.py"), "--megatron", str(tree),
                           "--out", str(tmp_path / "out"), "--print-only", *extra],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, {ln.split("]")[0][1:]: shlex.split(ln.split("] ", 1)[1])
                         for ln in proc.stdout.splitlines() if ln.startswith("[")}


def test_presets_are_ablate_calls_without_checkpoints(tmp_path):
    text, cmds = _commands(tmp_path, "--parts", ",".join(h200_ablate.PARTS), "--budget", "20")
    assert set(cmds) == set(h200_ablate.PARTS)
    assert "expected: ~" in text and "min on the H200" in text
    for cmd in cmds.values():
        assert cmd[1:3] == ["-m", "megatron_perf_toggles"] and cmd[3] in ("ablate", "tune")
        megatron_args = cmd[cmd.index("--") + 1:]
        assert "--save" not in megatron_args and "--load" not in megatron_args  # no checkpoints written
        assert len(set(w for w in megatron_args if w.startswith("--"))) == len(
            [w for w in megatron_args if w.startswith("--")])  # each argument once
        assert cmd[cmd.index("--repeats") + 1] == "3" and "--budget" in cmd
    assert cmds["noop"][cmds["noop"].index("--toggles") + 1] == "ddp_average_in_collective"
    assert cmds["noop"][cmds["noop"].index("--others") + 1] == "off"
    assert cmds["headline"][cmds["headline"].index("--design") + 1] == "headline"
    assert "--nproc-per-node 2" in cmds["dp2"][cmds["dp2"].index("--launch") + 1]
    assert [cmds[p][3] for p in ("tune", "dp2-tune", "headline")] == ["tune", "tune", "ablate"]
    assert "--nproc-per-node 2" in cmds["dp2-tune"][cmds["dp2-tune"].index("--launch") + 1]
    assert "--fp8-recipe" in cmds["fp8-delayed"] and "--fp8-recipe" not in cmds["headline"]


def test_expected_time_grows_with_the_work():
    assert h200_ablate.estimate_s("one-at-a-time", 3, 12) > h200_ablate.estimate_s("headline", 3, 12)
    assert h200_ablate.estimate_s("headline", 5, 12) > h200_ablate.estimate_s("headline", 3, 12)
    # --toggles: tune on two toggles is a leave-one-out of 3 arms, a factorial of at most 4 and a
    # confirmation of at most 2
    assert h200_ablate.arms_of("tune", 2) == 9 and h200_ablate.arms_of("tune") == h200_ablate.ARMS["tune"]
    assert h200_ablate.arms_of("tune", 5) == h200_ablate.ARMS["tune"] and h200_ablate.arms_of("headline", 2) == 2
    assert h200_ablate.estimate_s("tune", 3, 10, 2) < h200_ablate.estimate_s("tune", 3, 10)


def _smoke(tmp_path, part: str, repeats: int) -> dict:
    """One preset through --smoke on the newest tree given: real dry runs, stand-in runs."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "h200_ablate.py"), "--megatron",
                           str(megatron_trees()[-1]), "--out", str(tmp_path / "out"), "--smoke", "--parts", part,
                           "--repeats", str(repeats), "--iters", "6", "--warmup", "2"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "out" / part / "results.json").read_text())


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_smoke_path_runs_the_noop_preset_end_to_end(tmp_path):
    data = _smoke(tmp_path, "noop", 2)
    assert data["blocks_run"] == 2 and [r["arm"] for r in data["rows"]] == ["all-off",
                                                                            "only:ddp_average_in_collective"]
    assert data["rows"][1]["speedup"]["verdict"] == "no detectable difference"
    assert not list((tmp_path / "out").rglob("checkpoints"))


def test_devices_put_one_gpu_parts_side_by_side_and_multi_gpu_parts_alone():
    parts = ["one-at-a-time", "leave-one-out", "dp2", "fp8-delayed", "fp8-tensorwise"]
    assert h200_ablate.phases(parts, ["0", "1"]) == [["one-at-a-time", "leave-one-out"], ["dp2"],
                                                     ["fp8-delayed", "fp8-tensorwise"]]
    assert h200_ablate.phases(parts, ["0"]) == [[p] for p in parts]  # one GPU: one part at a time
    assert h200_ablate.phases(parts, []) == [[p] for p in parts]


def test_each_part_has_its_own_port_and_keeps_it_across_calls(tmp_path):
    _, first = _commands(tmp_path, "--parts", "noop,headline,dp2", "--devices", "0,1")
    _, again = _commands(tmp_path, "--parts", "headline,noop,dp2", "--devices", "0,1")
    assert first == again  # a resumed part gets the same command (ablate skips runs by command)
    ns = h200_ablate.argparse.Namespace(port=29511)
    ports = {p: h200_ablate.part_port(ns, p) for p in h200_ablate.PARTS}
    assert len(set(ports.values())) == len(ports)
    assert f"--master-port {ports['dp2']}" in first["dp2"][first["dp2"].index("--launch") + 1]


def test_devices_must_cover_a_multi_gpu_part(tmp_path):
    tree = tmp_path / "Megatron-LM"
    tree.mkdir()
    (tree / "pretrain_gpt.py").write_text("")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "h200_ablate.py"), "--megatron", str(tree),
                           "--out", str(tmp_path / "out"), "--print-only", "--parts", "dp2", "--devices", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs 2 GPUs" in proc.stderr


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_smoke_path_plans_the_two_gpu_tensor_parallel_part_for_its_world(tmp_path):
    """TP=2 validates only in a world of 2: the smoke run's real dry runs plan for it (--world-size),
    and the stand-in runs log that world, which the results take as the runs' own."""
    data = _smoke(tmp_path, "tp2-candidates", 1)
    assert data["planned_world_size"] == 2 and data["world_size"] == 2
    assert data["derived"]["+tp-comm-overlap"] == ["tp_comm_overlap"]


@pytest.mark.real_megatron
@pytest.mark.own_process
def test_smoke_path_sweeps_the_bucket_size_with_the_reduce_overlapped(tmp_path):
    """Megatron ignores the bucket size unless the reduce overlaps the backward pass: every arm of
    the sweep overlaps it, and each candidate changes the bucket size and nothing else."""
    data = _smoke(tmp_path, "dp2-buckets", 1)
    assert data["planned_world_size"] == 2
    assert [r["arm"] for r in data["rows"]] == ["baseline", "+bucket-10M", "+bucket-160M", "+bucket-640M"]
    assert all(data["derived"][f"+bucket-{size}"] == ["ddp_bucket_size"] for size in ("10M", "160M", "640M"))
    sizes = {"baseline": None, "+bucket-10M": "10000000", "+bucket-160M": "160000000", "+bucket-640M": "640000000"}
    for run in data["runs"]:
        words = list(run["command"])
        assert words.count("--overlap-grad-reduce") == 1
        size = words[words.index("--ddp-bucket-size") + 1] if "--ddp-bucket-size" in words else None
        assert size == sizes[run["arm"]], run["arm"]


def test_toggles_reach_the_parts_that_vary_toggles_and_are_refused_elsewhere(tmp_path):
    text, cmds = _commands(tmp_path, "--parts", "tune,headline", "--toggles", "fused_single_qkv_rope")
    # a warm-up run; 3 blocks of 2 leave-one-out arms, 2 factorial arms and at most 2 confirmation arms
    assert "tune             19 runs" in text
    for part in ("tune", "headline"):
        assert cmds[part][cmds[part].index("--toggles") + 1] == "fused_single_qkv_rope"
        assert cmds[part].index("--toggles") < cmds[part].index("--")  # the subcommand's option, not Megatron's
    assert "--others" not in cmds["headline"]  # unnamed toggles: the defaults of a clean environment
    _, plain = _commands(tmp_path, "--parts", "tune,headline", "--toggles", "")  # empty: all five
    assert "--toggles" not in plain["tune"] and "--toggles" not in plain["headline"]
    tree = tmp_path / "Megatron-LM"
    refused = list(h200_ablate.FIXED_TOGGLES)
    assert set(refused) == {"noop", "candidates", "candidates2", "dp2-candidates", "tp2-candidates", "dp2-buckets", "lean-ce"}
    for part, toggles, why in [*((p, "fused_single_qkv_rope", f"part {p}") for p in refused),
                               ("tune", "no_such_toggle", "unknown toggle"), ("tune", ",,", "is empty"),
                               ("tune", "fused_single_qkv_rope,fused_single_qkv_rope", "twice")]:
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "h200_ablate.py"), "--megatron", str(tree),
                               "--out", str(tmp_path / "out"), "--print-only", "--parts", part, "--toggles",
                               toggles], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, (part, proc.stderr)
        assert "plan:" not in proc.stdout  # refused before the plan is printed


def test_no_part_takes_the_plugin_s_variables_from_the_shell(tmp_path, monkeypatch):
    """A toggle no arm names keeps the plugin default, in ablate's parts and tune's alike, whatever
    the caller exported; everything else in the environment is passed on."""
    for name in ("GRAD_REDUCE_IN_BF16", "CROSS_ENTROPY_FUSION_IMPL", "FP4_BF16_START", "MEGATRON_PERF_TOGGLES_PROFILE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    env = h200_ablate.base_env(tmp_path, smoke=False)
    assert not {"GRAD_REDUCE_IN_BF16", "CROSS_ENTROPY_FUSION_IMPL", "FP4_BF16_START",
                "MEGATRON_PERF_TOGGLES_PROFILE"} & set(env)
    assert env["NCCL_DEBUG"] == "WARN"
