"""ablate's statistics against textbook values and synthetic experiments with a known truth."""

from __future__ import annotations

import math
import random

import pytest

from megatron_perf_toggles.tools.ablate import stats as st

# Two-sided 95 % (p = 0.975) and other quantiles of Student's t, from printed tables.
T_TABLE = [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 3, 3.182), (0.975, 4, 2.776), (0.975, 5, 2.571),
           (0.975, 10, 2.228), (0.975, 30, 2.042), (0.95, 2, 2.920), (0.995, 3, 5.841), (0.8, 2, 1.061),
           (0.9, 9, 1.383), (0.975, 120, 1.980)]


@pytest.mark.parametrize("p, df, value", T_TABLE)
def test_t_quantiles_match_the_table(p, df, value):
    assert st.t_quantile(p, df) == pytest.approx(value, abs=1e-3)
    assert st.t_quantile(1 - p, df) == pytest.approx(-value, abs=1e-3)
    assert st.t_cdf(value, df) == pytest.approx(p, abs=1e-4)


def test_t_with_many_degrees_is_normal():
    assert st.t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)
    assert st.t_cdf(0.0, 3) == pytest.approx(0.5)


def _experiment(rng, effect, blocks, drift=0.08, noise=0.01):
    """Per block: a drift both arms share (the GPU that moment) and each run's own noise.
    The arm is ``effect`` faster: its ms is baseline_ms / (1 + effect)."""
    base, arm = [], []
    for _ in range(blocks):
        level = 1000 * math.exp(rng.gauss(0, drift))
        base.append(level * math.exp(rng.gauss(0, noise)))
        arm.append(level / (1 + effect) * math.exp(rng.gauss(0, noise)))
    return base, arm


@pytest.mark.parametrize("blocks", [3, 5, 10])
def test_no_effect_is_called_a_difference_about_five_percent_of_the_time(blocks):
    rng = random.Random(1234 + blocks)
    results = [st.paired_speedup(*_experiment(rng, 0.0, blocks)) for _ in range(2000)]
    called = sum(r["verdict"] != st.NO_DIFFERENCE for r in results) / len(results)
    covered = sum(r["low"] <= 1.0 <= r["high"] for r in results) / len(results)
    # a z-interval (1.96 instead of t) would call ~20 % at 3 blocks; 0.95 coverage is the promise
    assert 0.03 <= called <= 0.07 and covered == pytest.approx(1 - called)


# 1 % noise per run is 1.4 % per block ratio: 3 blocks find a 5 % effect most of the time, 5 nearly always.
@pytest.mark.parametrize("blocks, power", [(3, 0.75), (5, 0.98)])
def test_a_five_percent_effect_under_noise_is_found_and_covered(blocks, power):
    rng = random.Random(99 + blocks)
    results = [st.paired_speedup(*_experiment(rng, 0.05, blocks)) for _ in range(2000)]
    faster = sum(r["verdict"] == st.FASTER for r in results) / len(results)
    covered = sum(r["low"] <= 1.05 <= r["high"] for r in results) / len(results)
    assert faster > power
    assert 0.93 <= covered <= 0.97
    assert not any(r["verdict"] == st.SLOWER for r in results)
    med = sorted(r["estimate"] for r in results)[len(results) // 2]
    assert med == pytest.approx(1.05, abs=0.002)


def test_pairing_removes_the_shared_drift():
    # 8 % drift between blocks, 0.2 % noise within: the paired interval is narrow despite the drift
    r = st.paired_speedup(*_experiment(random.Random(5), 0.05, 3, drift=0.08, noise=0.002))
    assert r["verdict"] == st.FASTER and r["high"] / r["low"] < 1.03


def test_slower_and_too_few():
    assert st.paired_speedup([900, 905, 910], [1000, 1004, 1012])["verdict"] == st.SLOWER
    one = st.paired_speedup([1000], [900])
    assert one["verdict"] == st.TOO_FEW and one["estimate"] == pytest.approx(1000 / 900) and one["low"] is None
    assert st.paired_speedup([None, 1000], [900, None])["blocks"] == 0  # failed runs drop their block


def test_worked_example():
    r = st.paired_speedup([1000, 1100, 950], [900, 1000, 850])
    d = [math.log(1000 / 900), math.log(1100 / 1000), math.log(950 / 850)]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    assert r["estimate"] == pytest.approx(math.exp(mean))
    assert r["low"] == pytest.approx(math.exp(mean - 4.3027 * sd / math.sqrt(3)), rel=1e-5)
    assert r["high"] == pytest.approx(math.exp(mean + 4.3027 * sd / math.sqrt(3)), rel=1e-5)


@pytest.mark.parametrize("sd", [0.005, 0.01, 0.02])
def test_sizing_gives_the_promised_power(sd):
    n = st.blocks_to_resolve(sd, effect=0.01)
    assert n >= 2
    rng = random.Random(int(sd * 1e4))

    def power(blocks):
        hits = 0
        for _ in range(600):
            r = st.paired_speedup(*_experiment(rng, 0.01, blocks, drift=0.05, noise=sd / math.sqrt(2)))
            hits += r["verdict"] == st.FASTER
        return hits / 600

    assert 0.72 <= power(n) <= 0.92  # about the 80 % asked for
    if n > 3:
        assert power(max(2, n // 2)) < 0.7  # half as many blocks would not do


def test_sizing_scales_with_the_noise():
    assert st.blocks_to_resolve(0.0, 0.01) == 2
    small, large = st.blocks_to_resolve(0.005, 0.01), st.blocks_to_resolve(0.02, 0.01)
    assert large > 10 * small / 2  # four times the noise: roughly sixteen times the blocks
    assert st.blocks_for_half_width(0.02, 0.01) < large
    with pytest.raises(ValueError):
        st.blocks_to_resolve(0.01, 0.0)


def test_loss_ratios_per_block():
    base = [2.000, 2.002, 1.998]
    moved = st.loss_comparison(base, [2.02, 2.03, 2.025])
    # per block: 2.02/2.000, 2.03/2.002, 2.025/1.998
    assert moved["ratio"] == pytest.approx(2.025 / 1.998) and moved["blocks"] == 3
    assert moved["min"] == pytest.approx(2.02 / 2.0) and moved["max"] == pytest.approx(2.03 / 2.002)
    assert set(moved) == {"ratio", "min", "max", "blocks"}  # a description: the verdict is the loss test's
    assert st.loss_comparison([None], [2.0]) is None


def test_relative_half_width():
    assert st.relative_half_width({"low": 1.0, "high": 1.0201}) == pytest.approx(0.01)
    assert st.relative_half_width({"low": None, "high": None}) is None
