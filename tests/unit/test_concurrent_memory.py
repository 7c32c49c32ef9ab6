"""``ablate --concurrent K`` asks the memory model first: K runs' planned peak plus each process's own
overhead (measured by bench/process_overhead.py into docs/benchmarks/process_overhead.json; a
fallback, said as such, while it is not) against the GPU's memory. Where K do not fit, one line
says so and the largest K that fits runs; a dry run says it before any run starts."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO
from test_ablate import FAKE, _fake_megatron
from test_tune import tune_main

from megatron_perf_toggles.runtime.machine.target import GPUS
from megatron_perf_toggles.tools.ablate import command as ablate
from megatron_perf_toggles.tools.ablate import schedule

PEAK_MB, GPU_MB, OVERHEAD_MB = 30_000.0, 81_920.0, 2_000.0


def _bench():
    spec = importlib.util.spec_from_file_location("process_overhead", REPO / "bench" / "process_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(peaks, gpu_mb=GPU_MB, target="h100"):
    """Dry-run records as the memory model fills them: each arm's planned peak, the GPU's memory."""
    memory = {} if gpu_mb is None else {"gpu_memory_mb": gpu_mb}
    return [{"memory": {"planned_peak_mb": peak, **memory}, "target": {"gpu": {"name": target}}} for peak in peaks]


def _overhead_file(tmp_path, measured):
    path = tmp_path / "process_overhead.json"
    path.write_text(json.dumps(_bench().payload(measured)))
    return path


def test_k_runs_that_fit_run_as_asked():
    fits = int(GPU_MB // (PEAK_MB + OVERHEAD_MB))
    assert fits >= 2
    assert schedule.runs_that_fit(fits, _records([PEAK_MB, PEAK_MB]), (OVERHEAD_MB, "measured")) == (fits, None)
    assert schedule.runs_that_fit(1, _records([GPU_MB * 2]), (OVERHEAD_MB, "measured")) == (1, None)  # nothing at once


def test_k_runs_that_do_not_fit_are_clamped_to_the_largest_k_that_fits_in_one_line():
    fits = int(GPU_MB // (PEAK_MB + OVERHEAD_MB))
    asked = fits + 3
    k, line = schedule.runs_that_fit(asked, _records([PEAK_MB, PEAK_MB - 5_000]), (OVERHEAD_MB, "measured on X"))
    assert k == fits and "\n" not in line
    assert line.startswith(f"--concurrent {asked}: ") and line.endswith(f"running {fits} at once")
    assert f"{GPU_MB / 1024:.1f} GB" in line and f"{OVERHEAD_MB / 1024:.1f} GB of its process's own" in line
    assert "measured on X" in line
    # the arm with the largest planned peak prices every run; the overhead counts once per process
    big = PEAK_MB + 20_000
    assert schedule.runs_that_fit(asked, _records([PEAK_MB, big]), (OVERHEAD_MB, ""))[0] == int(
        GPU_MB // (big + OVERHEAD_MB))
    assert schedule.runs_that_fit(asked, _records([GPU_MB]), (OVERHEAD_MB, ""))[0] == 1  # never fewer than one


def test_the_gpu_comes_from_the_plans_target_where_the_record_has_no_memory_for_it():
    peak = 40_000.0
    on = {name: int(GPUS[name].memory_gib * 1024 // (peak + OVERHEAD_MB)) for name in ("h100", "h200")}
    assert on["h100"] < on["h200"]
    for name, fits in on.items():
        k, line = schedule.runs_that_fit(on["h200"], _records([peak], gpu_mb=None, target=name), (OVERHEAD_MB, ""))
        assert k == fits and (line is None) == (fits == on["h200"])
        assert line is None or GPUS[name].product in line


def test_without_a_planned_peak_nothing_is_clamped_and_a_note_says_it_was_not_checked():
    k, line = schedule.runs_that_fit(4, [{"memory": {"planned_peak_mb": None, "gpu_memory_mb": GPU_MB}}])
    assert k == 4 and line.startswith("note: --concurrent 4:") and "not checked" in line


def test_the_overhead_is_the_measured_one_else_a_fallback_that_says_so(tmp_path):
    measured = {"gpu": "NVIDIA H100 80GB HBM3", "overhead_mb": 1234.5, "steps": []}
    assert schedule.process_overhead(_overhead_file(tmp_path, measured)) == (1234.5, "measured on NVIDIA H100 80GB HBM3")
    mb, source = schedule.process_overhead(_overhead_file(tmp_path, None))
    assert mb == schedule.FALLBACK_OVERHEAD_MB and "fallback" in source and "process_overhead.json" in source
    assert schedule.process_overhead(tmp_path / "missing.json")[1] == source


def test_the_committed_file_is_the_one_the_bench_writes_and_the_reader_finds():
    path = REPO / "docs" / "benchmarks" / "process_overhead.json"
    data = json.loads(path.read_text())
    assert set(data) == set(_bench().payload(None))
    assert data["measured"] is None or isinstance(data["measured"]["overhead_mb"], (int, float))
    assert schedule.overhead_path() == path  # a checkout reads docs/benchmarks/ (an installed package, its data copy)
    mb, source = schedule.process_overhead()
    assert (source.startswith("measured") and mb == data["measured"]["overhead_mb"]) if data["measured"] else (
        mb == schedule.FALLBACK_OVERHEAD_MB and "fallback" in source)


def test_the_bench_table_shows_every_step_and_the_whole():
    bench = _bench()
    measured = {"gpu": "G", "torch": "2.9", "cuda": "12.8", "nccl": "2.27.3", "transformer_engine": None,
                "steps": [{"step": "CUDA context", "mb": 500.0}, {"step": "cuBLAS bf16 matmul", "mb": 40.0}],
                "overhead_mb": 540.0, "used_before_mb": 2048.0, "nvml_whole_mb": 541.0, "torch_reserved_mb": 0.0}
    text = bench.table(measured)
    assert "CUDA context" in text and "cuBLAS bf16 matmul" in text and "540.0" in text and "NCCL 2.27.3" in text
    assert "another process shares the GPU" in text  # 2 GB in use before it started


@pytest.mark.own_process
def test_the_bench_without_a_gpu_is_one_line_and_exit_2():
    """Where no GPU (or no torch) is there, one line and exit 2; where one is, a measurement."""
    import subprocess

    proc = subprocess.run([sys.executable, "bench/process_overhead.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode == 0:  # a GPU is visible here: it measured
        assert "one process, in all (overhead_mb)" in proc.stdout
        return
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() in (
        ["process_overhead: no CUDA GPU visible"], ["process_overhead: needs torch with CUDA"])


# --- through ablate ---------------------------------------------------------------------------------


def _with_memory(peak, gpu_mb=GPU_MB):
    inner = _fake_megatron()

    def resolver(script, args, arm, environ, world=None):
        return {**inner(script, args, arm, environ, world), **_records([peak], gpu_mb)[0]}
    return resolver


def _ablate(tmp_path, monkeypatch, concurrent, peak, *extra, measured=OVERHEAD_MB):
    over = {"gpu": "NVIDIA H100 80GB HBM3", "overhead_mb": measured} if measured is not None else None
    path = _overhead_file(tmp_path, over)
    monkeypatch.setattr(schedule, "overhead_path", lambda: path)
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    argv = ["--design", "one-at-a-time", "--toggles", "grad_reduce_in_bf16", "--block-seeds", "1", "--repeats", "2",
            "--concurrent", str(concurrent), "--out", str(tmp_path / "out"), "--launch", FAKE, *extra, str(script),
            "--", "--seq-length", "4096"]
    return ablate.main(argv, resolver=_with_memory(peak))


def test_ablate_runs_as_many_at_once_as_fit(tmp_path, monkeypatch, capsys):
    fits = int(GPU_MB // (PEAK_MB + OVERHEAD_MB))
    assert _ablate(tmp_path, monkeypatch, fits + 2, PEAK_MB) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if f"running {fits} at once" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"[ablate] --concurrent {fits + 2}: ")
    assert f"4 runs, {fits} at a time" in err
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["concurrent"] == fits + 2 and data["concurrent_ran"] == fits  # asked for, and run at once
    assert data["blocks_run"] == 2 and "speedup" not in data["rows"][1]
    assert data["speed_note"].startswith(f"not measured: {min(fits, 4)} runs shared the GPU")


def test_ablate_where_k_fit_says_nothing_of_memory(tmp_path, monkeypatch, capsys):
    assert _ablate(tmp_path, monkeypatch, 2, 1_000.0) == 0
    err = capsys.readouterr().err
    assert "at once need about" not in err and "2 at a time" in err
    assert json.loads((tmp_path / "out" / "results.json").read_text())["concurrent"] == 2


def test_ablate_where_one_fits_runs_one_at_a_time_and_keeps_losses_alone(tmp_path, monkeypatch, capsys):
    assert _ablate(tmp_path, monkeypatch, 4, GPU_MB - OVERHEAD_MB / 2) == 0
    err = capsys.readouterr().err
    assert err.count("running 1 at once") == 1 and "4 runs, 1 at a time" in err
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["concurrent"] == 4 and data["concurrent_ran"] == 1
    assert "one at a time" in data["speed_note"] and data["sizing"] is None
    assert all("speedup" not in r for r in data["rows"]) and data["runs"] and all(
        r["status"] == "done" for r in data["runs"])


def test_a_dry_run_says_before_any_run_that_k_do_not_fit(tmp_path, monkeypatch, capsys):
    assert _ablate(tmp_path, monkeypatch, 8, PEAK_MB, "--dry-run") == 0
    out, err = capsys.readouterr()
    fits = int(GPU_MB // (PEAK_MB + OVERHEAD_MB))
    assert [ln for ln in err.splitlines() if "at once need about" in ln] == [
        ln for ln in err.splitlines() if ln.endswith(f"running {fits} at once")]
    assert len([ln for ln in err.splitlines() if "at once need about" in ln]) == 1
    assert "block 1:" in out and not (tmp_path / "out").exists()


def test_the_fallback_is_named_in_the_line_while_nothing_is_measured(tmp_path, monkeypatch, capsys):
    peak = GPU_MB / 3
    assert _ablate(tmp_path, monkeypatch, 3, peak, "--dry-run", measured=None) == 0
    line = next(ln for ln in capsys.readouterr().err.splitlines() if "at once need about" in ln)
    fits = int(GPU_MB // (peak + schedule.FALLBACK_OVERHEAD_MB))
    assert line.endswith(f"running {fits} at once") and "a fallback until docs/benchmarks/process_overhead.json" in line


def test_tune_goes_through_the_same_check_and_runs_one_at_a_time(tmp_path, monkeypatch):
    """tune has no --concurrent (its verdicts need timed runs): each phase's schedule asks the same
    check, for one run at a time, which nothing clamps."""
    asked = []
    check = schedule.runs_that_fit

    def spy(k, records, overhead=None):
        asked.append(k)
        return check(k, records, overhead)

    monkeypatch.setattr(schedule, "runs_that_fit", spy)
    monkeypatch.setenv("FAKE_EXTRA_MS", "CROSS_ENTROPY_LOSS_FUSION=100")
    assert tune_main(tmp_path, "--repeats", "2") == 0
    assert len(asked) >= 2 and set(asked) == {1}
