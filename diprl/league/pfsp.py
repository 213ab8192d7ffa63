"""Prioritised fictitious self-play (PFSP): how much to play each opponent, given the win rate against it.

AlphaStar samples opponents with probability proportional to f(x), where x is the learner's win
rate against that opponent. The weighting decides what the learner spends its games on:

- `hard`: f(x) = (1 - x)^p. Opponents the learner loses to get most of the games; ones it always
  beats get none. p = 2 by default (AlphaStar's "squared").
- `variance`: f(x) = x (1 - x). Opponents of about equal strength: the most informative games for a
  rating, but it neglects both the hopeless and the already-beaten (skill matching's failure mode).
- `linear_capped`: f(x) = min(0.5, 1 - x). Like `hard`, but every opponent the learner does not yet
  beat more than half the time gets the same weight, so one very hard opponent cannot take every game.

A public implementation divides by the sum of the weights and returns NaN when every win rate is 1.0
(every weight 0). Here a sum of ~0 falls back to uniform: a learner that beats everyone still has to
keep playing someone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

WEIGHTINGS = ("hard", "variance", "linear_capped")
_EPS = 1e-12


def _check(win_rates: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(win_rates, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"win rates must be a 1-D sequence, got shape {x.shape}")
    if not np.all(np.isfinite(x)) or np.any(x < 0.0) or np.any(x > 1.0):
        raise ValueError(f"win rates must lie in [0, 1], got {x.tolist()}")
    return x


def f_hard(win_rates: Sequence[float] | np.ndarray, p: float = 2.0) -> np.ndarray:
    """(1 - x)^p: all the weight on opponents the learner loses to."""
    if p <= 0:
        raise ValueError(f"PFSP exponent p must be positive, got {p}")
    return np.asarray((1.0 - _check(win_rates)) ** p)


def f_var(win_rates: Sequence[float] | np.ndarray) -> np.ndarray:
    """x (1 - x): all the weight on even opponents (peaks at x = 0.5)."""
    x = _check(win_rates)
    return np.asarray(x * (1.0 - x))


def f_linear_capped(win_rates: Sequence[float] | np.ndarray) -> np.ndarray:
    """min(0.5, 1 - x): every opponent not yet beaten more than half the time weighs the same."""
    return np.asarray(np.minimum(0.5, 1.0 - _check(win_rates)))


def pfsp_weights(win_rates: Sequence[float] | np.ndarray, weighting: str = "hard", p: float = 2.0) -> np.ndarray:
    """Unnormalised weights f(x) for one of `WEIGHTINGS`."""
    if weighting == "hard":
        return f_hard(win_rates, p)
    if weighting == "variance":
        return f_var(win_rates)
    if weighting == "linear_capped":
        return f_linear_capped(win_rates)
    raise ValueError(f"unknown PFSP weighting {weighting!r}; known: {', '.join(WEIGHTINGS)}")


def normalise(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """Weights to probabilities; uniform when they sum to ~0 (never NaN), an error when negative."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("need at least one weight to sample from")
    if not np.all(np.isfinite(w)) or np.any(w < 0.0):
        raise ValueError(f"weights must be finite and non-negative, got {w.tolist()}")
    total = float(w.sum())
    if total <= _EPS:
        return np.full(w.size, 1.0 / w.size)
    return np.asarray(w / total)


def pfsp_probabilities(win_rates: Sequence[float] | np.ndarray, weighting: str = "hard", p: float = 2.0) -> np.ndarray:
    """The PFSP sampling distribution over opponents whose win rates are `win_rates`."""
    return normalise(pfsp_weights(win_rates, weighting, p))
