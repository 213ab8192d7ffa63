"""Confidence intervals for benchmark results: Wilson for rates, normal or bootstrap for means.

Benchmarks run tens of games, and a bare "solo rate 0.93" hides whether that is 65/70 or 2/2.
Every rate and mean the arena and the evaluator report therefore carries an interval. Wilson is
used for rates because the textbook normal interval collapses to zero width at 0 or 1, exactly
where a strong bot against weak ones lands. The bootstrap is used for means of bounded, skewed
quantities (centres, sum-of-squares) where the normal approximation is poor on small samples;
it is seeded so that a report is reproducible bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

Z95 = 1.959964
"""Two-sided 95% quantile of the standard normal."""


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial rate `successes / n`.

    With no trials nothing is known, so the whole range (0, 1) comes back. At 0 and n successes
    the bounds are exactly 0 and 1 (no rounding residue), so reports never show "-0.000".
    """
    if n < 0 or successes < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / n + z2 / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def mean_ci(values: Sequence[float], z: float = Z95) -> tuple[float, float, float]:
    """Mean with a normal-approximation interval `mean ± z * s / sqrt(n)` (sample std, ddof=1).

    Cheap and adequate for large samples of unbounded quantities; a single value has no spread
    estimate, so at least two are required rather than returning a misleading zero width.
    """
    n = len(values)
    if n < 2:
        raise ValueError(f"mean_ci needs at least 2 values, got {n}")
    mean = math.fsum(values) / n
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def _mean(sample: np.ndarray) -> float:
    return float(np.mean(sample))


def bootstrap_ci(
    values: Sequence[float],
    stat: Callable[[np.ndarray], float] = _mean,
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """`stat(values)` with a percentile-bootstrap interval from `n_boot` seeded resamples.

    The seed is fixed by default so that two runs of the same benchmark print the same interval;
    the resampling makes no normality assumption, which matters for bounded, lumpy scores such
    as sum-of-squares (mostly 0 or 100 once solos appear).
    """
    n = len(values)
    if n == 0:
        raise ValueError("bootstrap_ci needs at least 1 value")
    if n_boot < 1:
        raise ValueError(f"n_boot must be positive, got {n_boot}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    boot = np.array([stat(data[row]) for row in idx], dtype=float)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(boot, [alpha, 1.0 - alpha])
    return float(stat(data)), float(low), float(high)


def rate_summary(count: int, n: int) -> dict[str, Any]:
    """A rate as reports carry it: `{count, n, rate, ci95}` (Wilson); `rate` is None with no trials."""
    low, high = wilson_interval(count, n)
    return {"count": count, "n": n, "rate": count / n if n else None, "ci95": [low, high]}


def mean_summary(values: Sequence[float]) -> dict[str, Any]:
    """A mean as reports carry it: `{mean, ci95}` (seeded percentile bootstrap)."""
    mean, low, high = bootstrap_ci(values, seed=0)
    return {"mean": mean, "ci95": [low, high]}


def interval_text(value: float, low: float, high: float, digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    """`value [low, high]`: how every report and table prints an estimate beside its 95% interval (`scale`
    100 and `unit` "%" for a rate as a percentage)."""
    return f"{value * scale:.{digits}f}{unit} [{low * scale:.{digits}f}, {high * scale:.{digits}f}]"


def summary_text(summary: dict[str, Any], digits: int = 2, scale: float = 1.0, unit: str = "") -> str:
    """`interval_text` of a `rate_summary` or `mean_summary` (its `rate` or `mean`, and its `ci95`)."""
    low, high = summary["ci95"]
    value = summary["rate"] if "rate" in summary else summary["mean"]
    return interval_text(value, low, high, digits, scale, unit)


def paired_gain(
    before: Sequence[float], after: Sequence[float], seed: int = 0, n_boot: int = 10_000
) -> dict[str, float]:
    """Mean of after - before over paired games (same seed, same power), with a percentile bootstrap 95%
    interval over the games: what a paired comparison of two policies, or of one before and after, is."""
    a, b = np.asarray(after, dtype=float), np.asarray(before, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired games needed, got {b.size} before and {a.size} after")
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(n_boot, diff.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return {"gain": float(diff.mean()), "lo": float(low), "hi": float(high)}
