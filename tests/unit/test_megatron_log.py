"""Megatron's own log lines -> numbers. Real logs from H200 runs (Megatron main and core 0.13) are fixtures."""

from __future__ import annotations

from conftest import REPO

from megatron_perf_toggles.tools.megatron_log import parse_file, parse_lines

FIXTURES = REPO / "tests" / "fixtures" / "megatron_logs"


def test_real_main_log():
    path = FIXTURES / "main_te_llama8b4l_default.log"
    log = parse_file(str(path))
    text = path.read_text()
    assert len(log.iterations) == text.count("elapsed time per iteration (ms):") == 20
    it10 = next(it for it in log.iterations if it.iteration == 10)
    # Read off the fixture's iteration-10 line: 1099.0 ms, 524.1 TFLOP/s, lm loss 1.024092E-01.
    assert it10.get("ms_per_iter") == 1099.0 and it10.get("tflops_per_gpu") == 524.1
    assert it10.get("lm_loss") == 0.1024092 and it10.get("global_batch_size") == 16
    assert it10.get("skipped") == 0 and it10.get("nan") == 0 and it10.total == 20
    # The last memory report (after iteration 2, with optimizer state) wins.
    assert log.memory_mb["max_allocated"] == 45397.30
    summary = log.summary(skip_first=9)
    assert summary["ms_per_iter"]["n"] == 11 and 1090 < summary["ms_per_iter"]["median"] < 1110
    assert log.errors == []


def test_real_main_fp8_log_has_the_same_shape():
    log = parse_file(str(FIXTURES / "main_te_llama8b4l_fp8_alloff.log"))
    assert len(log.iterations) == 20 and all("tflops_per_gpu" in it.values for it in log.iterations)


def test_real_core_v0_13_log():
    # core 0.13 prints its timestamp without microseconds and memory unrounded (a 1-GPU run of a
    # small model, local layers, through the launcher on an H200).
    path = FIXTURES / "core_v0.13.0_local_small.log"
    log = parse_file(str(path))
    assert len(log.iterations) == path.read_text().count("elapsed time per iteration (ms):") == 6
    it4 = next(it for it in log.iterations if it.iteration == 4)
    # Read off the fixture's iteration-4 line.
    assert it4.get("ms_per_iter") == 43.3 and it4.get("tflops_per_gpu") == 19.2
    assert it4.get("lm_loss") == 10.274 and it4.get("grad_norm") == 3.662 and it4.total == 6
    assert log.memory_mb["allocated"] != round(log.memory_mb["allocated"], 2)  # unrounded, as 0.13 prints it
    assert log.errors == []


def test_real_main_dp2_log():
    log = parse_file(str(FIXTURES / "main_local_dp2_on.log"))
    assert len(log.iterations) == 40
    it25 = next(it for it in log.iterations if it.iteration == 25)
    assert it25.get("ms_per_iter") == 92.0 and it25.get("lm_loss") == 5.559188 and it25.get("global_batch_size") == 2


# Older releases (core 0.13/0.14) print the timestamp without microseconds and memory numbers
# unrounded; these lines follow that format (core_v0.13.0 training.py / utils.py).
OLD_FORMAT = [
    " [2025-06-01 10:00:00] iteration        3/      10 | consumed samples:           12 | elapsed time per "
    "iteration (ms): 812.5 | throughput per GPU (TFLOP/s/GPU): 301.2 | learning rate: 1.000000E-04 | global batch "
    "size:     4 | lm loss: 9.876543E+00 | loss scale: 1.0 | grad norm: 12.345 | number of skipped iterations:   0 | "
    "number of nan iterations:   0 |",
    "[Rank 0] (after 3 iterations) memory (MB) | allocated: 1234.56787109375 | max allocated: 2345.678955078125 | "
    "reserved: 3000.0 | max reserved: 3000.0",
]


def test_older_format():
    log = parse_lines(OLD_FORMAT)
    assert log.iterations[0].iteration == 3 and log.iterations[0].get("ms_per_iter") == 812.5
    assert log.iterations[0].get("lm_loss") == 9.876543
    assert log.memory_mb["max_allocated"] == 2345.678955078125


def test_crash_lines_are_kept():
    log = parse_lines(["Traceback (most recent call last):", "RuntimeError: CUDA out of memory"])
    assert log.errors == ["Traceback (most recent call last):", "RuntimeError: CUDA out of memory"]


def test_the_memory_report_of_the_rank_that_peaks_highest_is_kept():
    """With pipeline parallelism each stage's data-parallel rank 0 prints its own report, in any order:
    the per-GPU peak is the highest one, not the last one printed."""
    lines = [
        "[Rank 0] (after 2 iterations) memory (MB) | allocated: 30000.0 | max allocated: 52000.5 | reserved: 53000.0",
        "[Rank 1] (after 2 iterations) memory (MB) | allocated: 20000.0 | max allocated: 41000.0 | reserved: 42000.0",
    ]
    assert parse_lines(lines).memory_mb["max_allocated"] == 52000.5
    assert parse_lines(reversed(lines)).memory_mb["max_allocated"] == 52000.5


# Megatron's evaluation lines (the format every supported version prints: " validation loss at
# <prefix> | <key> value: %.6E | <key> PPL: %.6E | "), between dashed rules.
VALIDATION_LINES = """\
 [2026-12-01 10:00:00.000000] iteration      100/     300 | consumed samples:         1600 | lm loss: 2.100000E+00 |
-----------------------------------------------------------------------------------------------
 validation loss at iteration 100 | lm loss value: 2.250000E+00 | lm loss PPL: 9.487736E+00 |
-----------------------------------------------------------------------------------------------
 validation loss at iteration 300 | lm loss value: 1.875000E+00 | lm loss PPL: 6.520819E+00 |
 validation loss at iteration 300 on validation set | lm loss value: 1.870000E+00 | lm loss PPL: 6.488296E+00 |
 validation loss at iteration 300 on test set | lm loss value: 1.990000E+00 | lm loss PPL: 7.315533E+00 |
 validation-books loss at iteration 300 | lm loss value: 3.000000E+00 | lm loss PPL: 2.008554E+01 |
"""


def test_validation_loss_lines_are_read_and_the_test_set_is_not():
    log = parse_lines(VALIDATION_LINES.splitlines())
    assert log.validation == [(100, 2.25), (300, 1.875), (300, 1.87)]
    assert len(log.iterations) == 1 and log.iterations[0].get("lm_loss") == 2.1  # no evaluation line is an iteration
    assert log.summary()["validation_loss_last"] == 1.87
    assert "validation_loss_last" not in parse_lines(VALIDATION_LINES.splitlines()[:1]).summary()
