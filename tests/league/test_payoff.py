"""Payoff: the 7-seat outcome, decay, min_games, symmetry, and the 1/G weighting of forks."""

from __future__ import annotations

import pytest

from diprl.league.members import POWERS
from diprl.league.payoff import Payoff, hero_outcome, match_outcomes

A, E, F, G, I, R, T = POWERS  # noqa: E741 (the initials of the seven powers)


def test_hero_outcome_counts_ties_half() -> None:
    centres = {A: 5, E: 3, F: 5, G: 7, I: 0, R: 4, T: 5}
    assert hero_outcome(centres, A, [E]) == 1.0
    assert hero_outcome(centres, A, [G]) == 0.0
    assert hero_outcome(centres, A, [F]) == 0.5
    assert hero_outcome(centres, A, [E, F, G, I]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    with pytest.raises(ValueError):
        hero_outcome(centres, A, [A])


def test_match_outcomes_weigh_each_fork_one_over_g_and_skip_self_play_seats() -> None:
    members = {A: "main", E: "main", F: "bot", G: "bot", I: "bot", R: "bot", T: "base"}
    win = {A: 6, E: 6, F: 1, G: 1, I: 1, R: 1, T: 9}  # beats the bot, loses to base
    lose = {A: 0, E: 6, F: 1, G: 1, I: 1, R: 1, T: 0}  # loses to the bot, ties base
    out = match_outcomes([(win, A, members), (lose, A, members)], "main")
    assert out == {"base": pytest.approx(0.25), "bot": pytest.approx(0.5)}  # (0 + 0.5)/2, (1 + 0)/2
    weighted = match_outcomes([(win, A, members), (lose, A, members)], "main", [0.25, 0.75])
    assert weighted == {"base": pytest.approx(0.375), "bot": pytest.approx(0.25)}  # 0.75 * 0.5, 0.25 * 1
    with pytest.raises(ValueError, match="one positive weight per fork"):
        match_outcomes([(win, A, members)], "main", [0.5, 0.5])


def test_decay_and_symmetry_by_hand() -> None:
    payoff = Payoff(decay=0.5, min_games=0.0)
    payoff.update("main", "bot", 1.0)
    payoff.update("main", "bot", 0.0)
    # wins: 1 -> 1*0.5 + 0 = 0.5; games: 1 -> 1*0.5 + 1 = 1.5
    assert payoff.win_rate("main", "bot") == pytest.approx(0.5 / 1.5)
    assert payoff.win_rate("bot", "main") == pytest.approx(1.0 / 1.5)
    assert payoff.games("main", "bot") == pytest.approx(1.5)
    payoff.update("main", "bot", 1.0)  # wins 0.25 + 1, games 0.75 + 1
    assert payoff.win_rate("main", "bot") == pytest.approx(1.25 / 1.75)


def test_pairs_read_half_until_min_games_and_for_themselves() -> None:
    payoff = Payoff(decay=1.0, min_games=2.0)
    assert payoff.win_rate("main", "bot") == 0.5  # no games
    payoff.update("main", "bot", 1.0)
    assert payoff.win_rate("main", "bot") == 0.5  # one game < 2
    payoff.update("main", "bot", 1.0)
    assert payoff.win_rate("main", "bot") == 1.0
    assert payoff.win_rate("main", "main") == 0.5
    with pytest.raises(ValueError):
        payoff.update("main", "main", 1.0)


def test_forget_and_round_trip() -> None:
    payoff = Payoff(decay=0.9)
    payoff.update("a", "b", 1.0)
    payoff.update("a", "c", 0.25)
    copy = Payoff.from_dict(payoff.to_dict())
    assert copy.matrix(["a", "b", "c"]) == payoff.matrix(["a", "b", "c"])
    copy.forget("a")
    assert copy.games("a", "b") == 0.0 and copy.members() == []
    with pytest.raises(ValueError):
        Payoff(decay=0.0)
