"""When a learning member becomes a frozen snapshot in the pool (AlphaStar / DI-engine rule).

A snapshot too early fills the pool with near-copies; too late and the pool misses the strategies
the learner passed through. The rule: never before `min_steps` (N) learner steps since the last
snapshot; always once 2N have passed; in between, as soon as the learner beats the opponents of its
role with a win rate above `threshold` (0.7 by default): it has mastered them, so freeze it.
"""

from __future__ import annotations


def should_snapshot(steps_since: int, win_rate: float, min_steps: int, threshold: float = 0.7) -> bool:
    """True when the learning member should be frozen now (see module doc)."""
    if min_steps < 1:
        raise ValueError(f"snapshot min_steps must be >= 1, got {min_steps}")
    if steps_since < 0:
        raise ValueError(f"steps since the last snapshot cannot be negative, got {steps_since}")
    if not 0.0 <= win_rate <= 1.0:
        raise ValueError(f"win rate must be in [0, 1], got {win_rate}")
    if steps_since < min_steps:
        return False
    if steps_since >= 2 * min_steps:
        return True
    return win_rate > threshold
