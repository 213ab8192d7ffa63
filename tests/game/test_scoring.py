"""Ranks, sum-of-squares and the score of a game."""

from __future__ import annotations

import pytest

from diprl.game import DiplomacyGame
from diprl.game.scoring import ranks, score_game, sum_of_squares

from .positions import HOMES, POWERS, position


def test_ranks_share_ties_and_skip_after_them() -> None:
    assert ranks({"A": 10, "B": 8, "C": 8, "D": 5}) == {"A": 1, "B": 2, "C": 2, "D": 4}
    assert ranks({"A": 3, "B": 3, "C": 3}) == {"A": 1, "B": 1, "C": 1}
    assert ranks({"A": 0, "B": 7, "C": 0}) == {"A": 2, "B": 1, "C": 2}


def test_sum_of_squares() -> None:
    assert sum_of_squares({"A": 3, "B": 1}) == pytest.approx({"A": 90.0, "B": 10.0})  # 9/10 and 1/10
    # Opening board: 4^2 + 6 * 3^2 = 70.
    opening = sum_of_squares({p: len(h) for p, h in HOMES.items()})
    assert opening["RUSSIA"] == pytest.approx(1600 / 70)
    assert opening["FRANCE"] == pytest.approx(900 / 70)
    assert sum(opening.values()) == pytest.approx(100.0)
    scores = sum_of_squares({"A": 17, "B": 9, "C": 5, "D": 2, "E": 1, "F": 0, "G": 0})
    assert sum(scores.values()) == pytest.approx(100.0)
    assert scores["A"] == pytest.approx(100 * 289 / 400)  # 289 + 81 + 25 + 4 + 1 = 400


def test_solo_takes_everything() -> None:
    assert sum_of_squares({"A": 18, "B": 10, "C": 6}) == {"A": 100.0, "B": 0.0, "C": 0.0}
    assert sum_of_squares({"A": 17, "B": 17}, solo_at=17)["A"] == 100.0  # the first to reach it
    assert sum_of_squares({"A": 0, "B": 0}) == {"A": 0.0, "B": 0.0}


def test_score_of_the_opening() -> None:
    score = score_game(DiplomacyGame())
    assert score.centres == {p: len(HOMES[p]) for p in POWERS}
    assert score.units == score.centres
    assert score.ranks == {p: 1 if p == "RUSSIA" else 2 for p in POWERS}
    assert sum(score.sum_of_squares.values()) == pytest.approx(100.0)
    assert (score.solo, score.eliminated, score.final_phase, score.year) == (None, (), "S1901M", 1901)


def test_score_of_a_solo_with_eliminations() -> None:
    eighteen = ["BRE", "MAR", "PAR", "BEL", "HOL", "SPA", "POR", "LON", "LVP", "EDI", "MUN", "KIE", "BER"]
    eighteen += ["DEN", "NWY", "SWE", "TUN", "ROM"]
    game = position({"FRANCE": ["A PAR", "A MUN"], "ITALY": ["A VEN"]}, {"FRANCE": eighteen, "ITALY": ["VEN", "NAP"]})
    score = score_game(game)
    assert score.solo == "FRANCE"
    assert score.sum_of_squares == {p: 100.0 if p == "FRANCE" else 0.0 for p in POWERS}
    assert score.centres["FRANCE"] == 18
    assert score.units == {p: {"FRANCE": 2, "ITALY": 1}.get(p, 0) for p in POWERS}
    assert score.ranks["FRANCE"] == 1
    assert score.ranks["ITALY"] == 2
    assert score.ranks["AUSTRIA"] == 3
    assert score.eliminated == ("AUSTRIA", "ENGLAND", "GERMANY", "RUSSIA", "TURKEY")
