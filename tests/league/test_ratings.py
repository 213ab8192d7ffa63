"""Plackett-Luce ratings: direction, ties, the seat and fork weighting, and self-play skipped."""

from __future__ import annotations

import pytest

from diprl.league.members import POWERS
from diprl.league.ratings import Rating, Ratings

HERO = POWERS[0]
ONE_VS_SIX = {p: ("main" if p == HERO else "bot") for p in POWERS}
HERO_FIRST = {p: (1 if p == HERO else 2) for p in POWERS}
HERO_LAST = {p: (7 if p == HERO else 1) for p in POWERS}


def test_ordinal_is_mu_minus_three_sigma() -> None:
    assert Rating(25.0, 2.0).ordinal == 19.0


def test_the_winner_rises_and_the_loser_falls() -> None:
    ratings = Ratings()
    ratings.rate([(ONE_VS_SIX, HERO_FIRST)])
    assert ratings.get("main").mu > 25.0 > ratings.get("bot").mu
    assert ratings.get("main").sigma < 25.0 / 3.0


def test_g_identical_forks_count_as_one_game() -> None:
    once, thrice = Ratings(), Ratings()
    once.rate([(ONE_VS_SIX, HERO_FIRST)])
    thrice.rate([(ONE_VS_SIX, HERO_FIRST)] * 3)
    for member in ("main", "bot"):
        assert thrice.get(member).mu == pytest.approx(once.get(member).mu)
        assert thrice.get(member).sigma == pytest.approx(once.get(member).sigma)


def test_mirrored_forks_leave_two_equal_members_equal() -> None:
    # main first and x second in one fork, x first and main second in the other: by symmetry, equal moves
    seats = {p: ("main" if i == 0 else "x" if i == 1 else "bot") for i, p in enumerate(POWERS)}
    first = {p: (i + 1) for i, p in enumerate(POWERS)}
    mirrored = first | {POWERS[0]: 2, POWERS[1]: 1}
    ratings = Ratings()
    ratings.rate([(seats, first), (seats, mirrored)])
    assert ratings.get("main").mu == pytest.approx(ratings.get("x").mu)
    assert ratings.get("main").mu > 25.0 > ratings.get("bot").mu


def test_all_tied_changes_no_mu() -> None:
    ratings = Ratings()
    ratings.rate([({p: ("main" if i < 3 else "bot") for i, p in enumerate(POWERS)}, dict.fromkeys(POWERS, 1))])
    assert ratings.get("main").mu == pytest.approx(25.0)
    assert ratings.get("bot").mu == pytest.approx(25.0)


def test_self_play_fork_is_skipped_and_round_trip() -> None:
    ratings = Ratings()
    ratings.rate([(dict.fromkeys(POWERS, "main"), HERO_FIRST)])
    assert ratings.table == {}
    ratings.rate([(ONE_VS_SIX, HERO_LAST)])
    copy = Ratings.from_dict(ratings.to_dict())
    assert copy.get("main") == ratings.get("main") and copy.get("main").mu < 25.0
    with pytest.raises(ValueError, match="ranks"):
        ratings.rate([(ONE_VS_SIX, {HERO: 1})])
