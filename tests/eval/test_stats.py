"""Interval math on fixtures small enough to check with a pocket calculator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diprl.eval.stats import Z95, bootstrap_ci, mean_ci, wilson_interval

# Wilson: centre = (p + z²/2n) / (1 + z²/n), half = z / (1 + z²/n) * sqrt(p(1-p)/n + z²/4n²).
# With z = 1.959964, z² = 3.841458881.


def test_wilson_zero_successes() -> None:
    # p = 0: centre = half = (z²/2n) / (1 + z²/n), so low = 0 and high = z² / (n + z²)
    # = 3.841458881 / 13.841458881 = 0.2775328.
    low, high = wilson_interval(0, 10)
    assert low == 0.0
    assert high == pytest.approx(0.2775328, abs=1e-7)


def test_wilson_all_successes_mirrors_zero() -> None:
    # By symmetry k -> n - k: low = n / (n + z²) = 10 / 13.841458881 = 0.7224672, high exactly 1.
    low, high = wilson_interval(10, 10)
    assert high == 1.0
    assert low == pytest.approx(0.7224672, abs=1e-7)


def test_wilson_half_is_symmetric_around_half() -> None:
    # p = 0.5: centre = (0.5 + z²/20) / (1 + z²/10) = 0.5; half = z/(1.3841459) * sqrt(0.025 + z²/400)
    # = 1.4160097 * sqrt(0.0346036) = 1.4160097 * 0.1860206 = 0.2634069.
    low, high = wilson_interval(5, 10)
    assert low + high == pytest.approx(1.0, abs=1e-12)
    assert high - 0.5 == pytest.approx(0.2634069, abs=1e-7)


def test_wilson_no_trials_knows_nothing() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.mark.parametrize(("k", "n"), [(1, 7), (3, 10), (33, 70), (69, 70)])
def test_wilson_bounds_solve_the_score_equation(k: int, n: int) -> None:
    # The Wilson bounds are the two roots p of (p̂ - p)² = z² p (1 - p) / n.
    p_hat = k / n
    for p in wilson_interval(k, n):
        assert (p_hat - p) ** 2 == pytest.approx(Z95**2 * p * (1 - p) / n, abs=1e-12)


def test_wilson_narrows_with_more_trials() -> None:
    small = wilson_interval(5, 10)
    large = wilson_interval(50, 100)
    assert large[1] - large[0] < small[1] - small[0]


@pytest.mark.parametrize(("k", "n"), [(-1, 5), (6, 5), (0, -1)])
def test_wilson_rejects_impossible_counts(k: int, n: int) -> None:
    with pytest.raises(ValueError):
        wilson_interval(k, n)


def test_mean_ci_by_hand() -> None:
    # [1..5]: mean 3, sample variance 10/4 = 2.5, se = sqrt(2.5/5) = 0.7071068,
    # half-width = 1.959964 * 0.7071068 = 1.3859038.
    mean, low, high = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0
    assert low == pytest.approx(3.0 - 1.3859038, abs=1e-7)
    assert high == pytest.approx(3.0 + 1.3859038, abs=1e-7)


def test_mean_ci_needs_two_values() -> None:
    with pytest.raises(ValueError):
        mean_ci([1.0])


def test_bootstrap_of_a_constant_has_zero_width() -> None:
    assert bootstrap_ci([7.0] * 20) == (7.0, 7.0, 7.0)


def test_bootstrap_is_seeded() -> None:
    values = [float(v) for v in [0, 3, 3, 5, 9, 12, 18, 18, 2, 0]]
    assert bootstrap_ci(values, seed=3) == bootstrap_ci(values, seed=3)
    assert bootstrap_ci(values, seed=3) != bootstrap_ci(values, seed=4)


def test_bootstrap_agrees_with_normal_interval_on_a_large_sample() -> None:
    values = [float(v) for v in range(100)]
    mean, low, high = bootstrap_ci(values, n_boot=4000)
    n_mean, n_low, n_high = mean_ci(values)
    assert mean == n_mean == 49.5
    assert low == pytest.approx(n_low, abs=1.0)
    assert high == pytest.approx(n_high, abs=1.0)


def test_bootstrap_takes_any_statistic() -> None:
    values = [1.0, 2.0, 3.0, 100.0]
    median, low, high = bootstrap_ci(values, stat=lambda a: float(np.median(a)))
    assert median == 2.5
    assert 1.0 <= low <= median <= high <= 100.0


def test_bootstrap_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], n_boot=0)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], confidence=1.0)


def test_z95_is_the_normal_quantile() -> None:
    # Phi(z) = (1 + erf(z / sqrt 2)) / 2 should be 0.975.
    assert (1 + math.erf(Z95 / math.sqrt(2))) / 2 == pytest.approx(0.975, abs=1e-7)


def test_an_estimate_prints_beside_its_interval_one_way_everywhere() -> None:
    from diprl.eval.stats import interval_text, summary_text

    assert interval_text(4.25, 3.5, 5.0) == "4.25 [3.50, 5.00]"
    assert summary_text({"count": 1, "n": 8, "rate": 0.125, "ci95": [0.02, 0.47]}, 1, 100, "%") == "12.5% [2.0, 47.0]"
    assert summary_text({"mean": 4.0, "ci95": [3.0, 5.5]}) == "4.00 [3.00, 5.50]"
