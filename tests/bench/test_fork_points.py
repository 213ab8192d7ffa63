"""`bench fork-points`: the same matches at each setting, and the saving is the ratio of their costs."""

from __future__ import annotations

import math

import pytest

from diprl.bench.fork_points import Cost, league_episode, league_matches, main, measure, savings


def test_a_second_fork_point_adds_groups_for_less_than_a_match_costs(capsys: pytest.CaptureFixture[str]) -> None:
    matches = league_matches("bots", 4)
    assert [m.hero for m in matches] == ["AUSTRIA", "ENGLAND", "FRANCE", "GERMANY"]
    league = league_episode()
    one, two = measure(league, matches, 1), measure(league, matches, 2)
    assert one.matches == two.matches == 4
    # The same matches: every group of the single fork point is there again, and more come after it.
    assert two.hero_groups > one.hero_groups and two.completions > one.completions
    # A later point costs its forks alone, so twice the matches' phases would be too many.
    assert two.phases < 2 * one.phases
    assert savings({"bots": {1: one, 2: two}}) == {"bots_saving_2": one.per_hero_group / two.per_hero_group}
    assert main(["--matches", "2", "--points", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert [part.split("=")[0] for part in last.split()] == ["exploiter_saving_2", "bots_saving_2"]


def test_the_exploiters_match_trains_every_seat_and_bad_settings_are_refused() -> None:
    (match,) = league_matches("exploiter", 1)
    assert match.train == tuple(match.seats) and str(match.seats[match.hero]) == "main_exploiter@v1"
    assert {str(ref) for p, ref in match.seats.items() if p != match.hero} == {"main@v2"}
    with pytest.raises(ValueError, match="unknown match kind"):
        league_matches("selfplay", 1)
    with pytest.raises(SystemExit):
        main(["--points", "0"])
    assert Cost(1, 1, 10, 0, 0).per_hero_group == math.inf  # every fork tied: no group for any cost
