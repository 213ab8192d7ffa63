"""Seeded constrained sampling: the right distribution, and the same token for the same (seed, step)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from diprl.policy.sampling import seeded_choice

ALLOWED = np.array([2, 5, 7])


def _row(values: dict[int, float], vocab: int = 10) -> torch.Tensor:
    row = torch.full((vocab,), 3.0)  # disallowed ids carry large logits: they must never be chosen
    for i, v in values.items():
        row[i] = v
    return row


def test_draws_follow_the_tempered_softmax_over_the_allowed_ids() -> None:
    # logits 0, ln 2, ln 5 at T = 1: probabilities 1/8, 2/8, 5/8.
    row = _row({2: 0.0, 5: math.log(2), 7: math.log(5)})
    n = 4000
    counts = Counter(seeded_choice(row, ALLOWED, 1.0, seed, 0) for seed in range(n))
    assert set(counts) <= {2, 5, 7}
    for token, p in ((2, 1 / 8), (5, 2 / 8), (7, 5 / 8)):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)  # within 4 standard errors
    # T = 2 flattens: probabilities proportional to sqrt(1), sqrt(2), sqrt(5).
    weights = np.sqrt([1.0, 2.0, 5.0]) / np.sqrt([1.0, 2.0, 5.0]).sum()
    counts = Counter(seeded_choice(row, ALLOWED, 2.0, seed, 1) for seed in range(n))
    for token, p in zip((2, 5, 7), weights, strict=True):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_the_same_seed_and_step_give_the_same_token_and_steps_differ() -> None:
    row = _row({2: 0.1, 5: 0.2, 7: 0.3})
    draws = [seeded_choice(row, ALLOWED, 1.0, 42, step) for step in range(64)]
    assert draws == [seeded_choice(row.clone(), ALLOWED, 1.0, 42, step) for step in range(64)]
    assert len(set(draws)) == 3, "the noise changes with the position in the completion"
    assert [seeded_choice(row, ALLOWED, 1.0, 43, s) for s in range(64)] != draws


def test_greedy_is_the_argmax_over_the_allowed_ids() -> None:
    assert seeded_choice(_row({2: 0.1, 5: 0.9, 7: 0.3}), ALLOWED, 0.0, 1, 0) == 5
    with pytest.raises(ValueError, match="no allowed"):
        seeded_choice(_row({}), np.array([], dtype=np.int64), 1.0, 1, 0)
