"""PFSP weightings on values a reader can check by hand, and the guards a public version lacks."""

from __future__ import annotations

import numpy as np
import pytest

from diprl.league.pfsp import f_hard, f_linear_capped, f_var, normalise, pfsp_probabilities


def test_weightings_by_hand() -> None:
    x = [0.0, 0.25, 0.5, 1.0]
    assert f_hard(x).tolist() == [1.0, 0.5625, 0.25, 0.0]  # (1 - x)^2
    assert f_hard(x, p=1.0).tolist() == [1.0, 0.75, 0.5, 0.0]
    assert f_var(x).tolist() == [0.0, 0.1875, 0.25, 0.0]  # x (1 - x)
    assert f_linear_capped(x).tolist() == [0.5, 0.5, 0.5, 0.0]  # min(0.5, 1 - x)
    assert f_linear_capped([0.8]).tolist() == pytest.approx([0.2])


def test_hard_probabilities_favour_the_opponents_it_loses_to() -> None:
    # weights (1-0.2)^2 = 0.64, (1-0.6)^2 = 0.16, (1-1)^2 = 0 -> 0.8, 0.2, 0
    assert pfsp_probabilities([0.2, 0.6, 1.0]) == pytest.approx([0.8, 0.2, 0.0])


def test_all_win_rates_one_is_uniform_not_nan() -> None:
    for weighting in ("hard", "variance", "linear_capped"):
        probs = pfsp_probabilities([1.0, 1.0, 1.0, 1.0], weighting)
        assert probs.tolist() == [0.25] * 4
    assert pfsp_probabilities([0.0, 0.0], "variance").tolist() == [0.5, 0.5]  # x(1-x) = 0 too


def test_member_with_no_games_counts_as_even() -> None:
    # the payoff reads 0.5 for a pair without games: weight 0.25 against 0.01 for one beaten 90% of the time
    probs = pfsp_probabilities([0.5, 0.9])
    assert probs == pytest.approx([0.25 / 0.26, 0.01 / 0.26])


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown PFSP weighting"):
        pfsp_probabilities([0.5], "squared")
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        f_hard([1.5])
    with pytest.raises(ValueError, match="at least one"):
        normalise([])
    with pytest.raises(ValueError, match="non-negative"):
        normalise([1.0, -1.0])
    with pytest.raises(ValueError, match="positive"):
        f_hard([0.5], p=0.0)
    assert np.isclose(normalise([2.0, 2.0]).sum(), 1.0)
