"""Maximum-entropy Nash on games whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from diprl.league.nash import antisymmetrise, max_entropy_nash, nash_ratings

RPS = [[0.5, 1.0, 0.0], [0.0, 0.5, 1.0], [1.0, 0.0, 0.5]]  # rock beats scissors beats paper beats rock


def test_rock_paper_scissors_is_uniform() -> None:
    assert max_entropy_nash(RPS) == pytest.approx([1 / 3] * 3, abs=1e-6)
    assert nash_ratings(RPS) == pytest.approx([0.0] * 3, abs=1e-6)


def test_dominated_strategy_gets_no_weight() -> None:
    # a fourth member that everyone beats: no equilibrium plays it, and its Nash rating is -0.5
    game = [[0.5, 1.0, 0.0, 1.0], [0.0, 0.5, 1.0, 1.0], [1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 0.0, 0.5]]
    p = max_entropy_nash(game)
    assert p == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0], abs=1e-6)
    assert nash_ratings(game)[3] == pytest.approx(-0.5, abs=1e-6)


def test_transitive_game_puts_everything_on_the_best() -> None:
    assert max_entropy_nash([[0.5, 0.7], [0.3, 0.5]]) == pytest.approx([1.0, 0.0], abs=1e-6)


def test_duplicates_share_weight_max_entropy_picks_among_many_equilibria() -> None:
    # rock twice: any split of 1/3 between the copies is an equilibrium; max entropy splits it evenly
    dup = [[0.5, 0.5, 1.0, 0.0], [0.5, 0.5, 1.0, 0.0], [0.0, 0.0, 0.5, 1.0], [1.0, 1.0, 0.0, 0.5]]
    assert max_entropy_nash(dup) == pytest.approx([1 / 6, 1 / 6, 1 / 3, 1 / 3], abs=1e-5)
    assert max_entropy_nash(np.full((4, 4), 0.5)) == pytest.approx([0.25] * 4, abs=1e-6)


def test_antisymmetrise_and_bad_input() -> None:
    assert antisymmetrise([[0.5, 0.8], [0.2, 0.5]]) == pytest.approx(np.array([[0.0, 0.3], [-0.3, 0.0]]))
    with pytest.raises(ValueError, match="square"):
        max_entropy_nash([[0.5, 0.5]])
    assert max_entropy_nash([[0.5]]).tolist() == [1.0]
