"""The loss test's statistic (equivalence.py): TOST intervals on seeds, paired and Welch, the three
verdicts and the seeds a margin needs. Expected intervals are worked out here by hand from
Student's t as printed in tables (one-sided 95 % points), not read from the code's output."""

from __future__ import annotations

import math

import pytest

from megatron_perf_toggles.tools.ablate.loss import equivalence as eq
from megatron_perf_toggles.tools.ablate.stats import t_quantile

T95 = {2: 2.919986, 3: 2.353363, 4: 2.131847, 15: 1.753050}  # t(0.95, df), from a table


def test_paired_interval_is_the_90_pct_t_interval_of_the_per_seed_differences_in_pct():
    out = eq.paired([101.0, 102.0, 100.0, 103.0], [100.0] * 4, margin=1.0)
    # differences 1, 2, 0, 3 %: mean 1.5, sd sqrt(5/3), half-width t(0.95, 3) sd / 2
    half = T95[3] * math.sqrt(5 / 3) / 2
    assert out["differences"] == pytest.approx([1.0, 2.0, 0.0, 3.0])
    assert out["estimate"] == pytest.approx(1.5) and out["sd"] == pytest.approx(math.sqrt(5 / 3))
    assert out["low"] == pytest.approx(1.5 - half, abs=1e-5) and out["high"] == pytest.approx(1.5 + half, abs=1e-5)
    assert out["paired"] and out["seeds_compared"] == 4 and out["alpha"] == 0.05
    # the interval holds 0 and reaches past the margin: inconclusive, with the margin it could show
    assert out["verdict"] == eq.INCONCLUSIVE and out["smallest_margin_shown"] == pytest.approx(1.5 + half, abs=1e-5)


def test_differences_are_in_pct_of_the_baseline_s_mean_and_missing_seeds_drop_out():
    out = eq.paired([1.92, None, 2.12, 5.0], [1.9, 2.0, 2.1, None], margin=1.5)
    # two pairs, baseline mean 2.0: each difference 0.02 / 2.0 = 1 %; no spread
    assert out["seeds_compared"] == 2 and out["baseline_mean"] == pytest.approx(2.0)
    assert out["differences"] == pytest.approx([1.0, 1.0]) and out["low"] == pytest.approx(out["high"])
    assert out["verdict"] == "equivalent within +-1.5 %"
    assert eq.paired([2.0, 2.1], [2.0, 2.0], margin=1.5, alpha=0.025)["alpha"] == 0.025


def test_fewer_than_two_seeds_give_no_interval():
    one = eq.paired([2.2], [2.0], margin=1.0)
    assert one["estimate"] == pytest.approx(10.0) and one["low"] is None and one["verdict"] == eq.INCONCLUSIVE
    assert one["seeds_needed"] is None
    assert eq.paired([None], [2.0], margin=1.0)["verdict"] == eq.INCONCLUSIVE
    assert eq.welch([2.0], [2.0, 2.1], margin=1.0)["low"] is None


def test_welch_interval_with_equal_spreads_has_2n_minus_2_degrees_of_freedom():
    out = eq.welch([102.0, 103.0, 101.0], [100.0, 101.0, 99.0], margin=1.0)
    # means 102 and 100 (baseline mean 100: in % as is); each squared se 1/3; df = 4
    half = T95[4] * math.sqrt(2 / 3)
    assert not out["paired"] and out["df"] == pytest.approx(4.0) and out["estimate"] == pytest.approx(2.0)
    assert out["low"] == pytest.approx(2.0 - half, abs=1e-5) and out["high"] == pytest.approx(2.0 + half, abs=1e-5)
    assert out["verdict"] == eq.WORSE  # excludes 0 and reaches past +1 %
    assert eq.welch([98.0, 97.0, 99.0], [100.0, 101.0, 99.0], margin=1.0)["verdict"] == eq.BETTER


def test_welch_degrees_of_freedom_with_unequal_spreads():
    # Welch-Satterthwaite by hand: va = 4 / 4 = 1, vb = 1 / 2 = 0.5 -> (1.5)^2 / (1 / 3 + 0.25 / 1) = 3.857...
    assert eq.welch_df(1.0, 0.5, 4, 2) == pytest.approx(2.25 / (1 / 3 + 0.25))
    assert eq.welch_df(0.0, 0.0, 5, 3) == 2.0


@pytest.mark.parametrize("low, high, expected", [
    (-0.5, 0.5, "equivalent within +-1 %"),
    (0.2, 0.8, "equivalent within +-1 %"),  # excludes 0 but inside the margin: a real, small change
    (0.2, 1.5, eq.WORSE),
    (1.2, 1.8, eq.WORSE),
    (-1.5, -0.2, eq.BETTER),
    (-0.2, 1.5, eq.INCONCLUSIVE),  # holds 0 and reaches past the margin
    (-1.5, 1.5, eq.INCONCLUSIVE),
    (-1.0, 0.5, eq.INCONCLUSIVE),  # the margin itself is not inside
    (None, None, eq.INCONCLUSIVE),
])
def test_three_way_verdict(low, high, expected):
    assert eq.verdict(low, high, 1.0) == expected


def test_seeds_needed_is_the_smallest_n_whose_expected_interval_fits_the_margin():
    # sd 3 %, margin 1 %: the normal approximation, ((z(0.95) + z(0.9)) x 3 / 1)^2 = 77.1, is a lower
    # bound, and Student's t adds a few seeds
    n = eq.seeds_needed(3.0, 1.0)
    assert 78 <= n <= 82
    assert (t_quantile(0.95, n - 1) + t_quantile(0.9, n - 1)) * 3.0 / math.sqrt(n) <= 1.0
    assert (t_quantile(0.95, n - 2) + t_quantile(0.9, n - 2)) * 3.0 / math.sqrt(n - 1) > 1.0
    half = eq.seeds_needed(3.0, 0.5)
    assert 3.8 * n < half < 4.2 * n  # half the margin: four times the seeds
    assert eq.seeds_needed(0.0, 1.0) == 2 and eq.seeds_needed(1e6, 1.0, limit=50) == 50
    with pytest.raises(ValueError):
        eq.seeds_needed(1.0, 0.0)


def test_a_pilot_sizes_the_real_run():
    pilot = eq.paired([100.5, 99.0, 101.5, 99.5, 101.0], [100.0] * 5, margin=1.0)
    assert pilot["verdict"] == eq.INCONCLUSIVE
    assert pilot["seeds_needed"] == eq.seeds_needed(pilot["sd"], 1.0) and pilot["seeds_needed"] > 5
    unpaired = eq.welch([100.5, 99.0, 101.5, 99.5, 101.0], [100.0, 101.0, 99.0, 100.5, 99.5], margin=1.0)
    # per arm, from the sd of a difference of two runs
    assert unpaired["seeds_needed"] == eq.seeds_needed(unpaired["sd"] * math.sqrt(2), 1.0)


def test_the_t_table_values_used_here_match_the_quantile():
    # a guard on this file's hand computations: they use the table, the code t_quantile
    for df, value in T95.items():
        assert t_quantile(0.95, df) == pytest.approx(value, abs=1e-5)
