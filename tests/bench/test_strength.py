"""The strength bench: its suites share games seat for seat, its gap is paired, and a bots-only run prints
the line the issue names."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from diprl.bench.__main__ import main
from diprl.bench.strength import (
    FULL_MAX_YEAR,
    MAX_YEAR,
    SEED,
    add_search_options,
    search_from_options,
    suites,
    summarize,
    summary_lines,
)
from diprl.eval.suite import game_specs
from diprl.rollout.search import SearchConfig


def test_the_teacher_plays_the_policys_seats_of_the_same_games() -> None:
    policy, teacher, random_, full = suites("main@v3", games=14, full_games=7)
    assert (policy.policy, policy.opponents, teacher.policy, random_.opponents) == (
        "main@v3", ["bot:dumbbot"], "bot:dumbbot", ["bot:random"]
    )  # fmt: skip
    assert policy.play == teacher.play == random_.play
    assert (policy.play.seed, policy.play.max_year, policy.play.temperature) == (SEED, MAX_YEAR, 0.0)
    assert (full.play.games, full.play.max_year) == (7, FULL_MAX_YEAR)
    mine, theirs = game_specs(policy, 0), game_specs(teacher, 1)
    assert [(s.seed, s.hero) for s in mine] == [(s.seed, s.hero) for s in theirs]
    assert len({s.hero for s in mine}) == 7
    assert len(suites("base", full_games=0)) == 3


def _report(centres: list[int], first_year: int = 4) -> dict[str, Any]:
    """A suite's report with what the summary reads: each game ends 1902 at `first_year` centres."""
    mean = sum(centres) / len(centres)
    per_game = [
        {"index": i, "seed": 100 + i, "hero_power": f"P{i % 7}", "hero_centres_by_year": [3, first_year, c]}
        for i, c in enumerate(centres)
    ]
    return {
        "per_game": per_game,
        "centres_by_year": {"years": [1901, 1902, 1903]},
        "hero_centres_per_game": centres,
        "hero_mean_sc": mean,
        "hero_centres": {"mean": mean, "ci95": [mean - 1, mean + 1]},
        "behaviour": {"support_rate": {"rate": 0.1}},
    }


def test_the_gap_is_paired_game_by_game() -> None:
    # The policy beats DumbBot by exactly one centre in every game: a paired gap of 1 with no spread,
    # though the two means' own intervals overlap widely.
    teacher = [2, 9, 4, 7, 3, 5, 6]
    policy = [c + 1 for c in teacher]
    summary = summarize([_report(policy), _report(teacher), _report([15] * 7)])
    assert (summary["teacher_gap"], summary["teacher_gap_lo"], summary["teacher_gap_hi"]) == (1.0, 1.0, 1.0)
    assert (summary["games_better"], summary["games_worse"]) == (7, 0)
    assert summary["policy_vs_random"] == 15.0
    swapped = summarize([_report(teacher), _report(policy), _report([4] * 7)])
    assert swapped["teacher_gap"] == -1.0 and swapped["games_worse"] == 7


def test_the_gap_by_year_shows_where_in_the_game_the_policy_gains_and_loses() -> None:
    # Ahead by two centres after 1901, behind by one at the end: the final gap alone hides the first.
    teacher = [4, 6, 5, 7, 4, 5, 6]
    summary = summarize([_report([c - 1 for c in teacher], first_year=6), _report(teacher), _report([15] * 7)])
    by_year = summary["teacher_gap_by_year"]
    assert list(by_year) == ["1902", "1903"]
    assert (by_year["1902"]["gain"], by_year["1903"]["gain"]) == (2.0, -1.0) == (by_year["1902"]["lo"], -1.0)
    assert "teacher gap at the start of each year: 1902 +2.00, 1903 -1.00" in "\n".join(summary_lines(summary))
    unpaired = _report(teacher)
    unpaired["per_game"][3]["seed"] = 7
    with pytest.raises(ValueError, match="not paired"):
        summarize([_report(teacher), unpaired, _report([15] * 7)])


def test_a_bots_only_run_prints_the_teacher_gap_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # DumbBot as the policy: the gap to itself in the same seats of the same games is exactly zero.
    assert (
        main(["strength", "--policy", "bot:dumbbot", "--games", "7", "--full-games", "0", "--out", str(tmp_path)]) == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(
        r"policy_vs_dumbbot=(\S+) dumbbot_vs_dumbbot=(\S+) teacher_gap=(\S+) teacher_gap_lo=(\S+) "
        r"policy_vs_random=(\S+)",
        last,
    )
    assert match is not None, last
    assert match[1] == match[2] and float(match[3]) == float(match[4]) == 0.0
    saved = json.loads((tmp_path / "strength.json").read_text())
    assert saved["summary"]["teacher_gap"] == 0.0 and set(saved["suites"]) == {
        "policy_vs_dumbbot", "dumbbot_vs_dumbbot", "policy_vs_random"
    }  # fmt: skip


def test_search_is_the_policys_alone_and_a_bad_setting_stops_the_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    search = SearchConfig(candidates=3, opponent_samples=2)
    configs = suites("main@v3", games=7, full_games=7, search=search)
    assert all(c.play.search == search for c in configs)  # DumbBot's suite has it too, and never uses it
    assert suites("main@v3", games=7)[0].play.search == SearchConfig()  # off unless asked for
    with pytest.raises(SystemExit) as stop:
        main(["strength", "--policy", "bot:dumbbot", "--search", "-1", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "search.candidates must be an integer >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["strength", "--policy", "bot:dumbbot", "--search", "2", "--reach-weight", "-1", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "search.reach_weight must be a finite number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        main(["strength", "--policy", "bot:dumbbot", "--search", "2", "--improve-pool", "all", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "--improve-pool: invalid choice" in capsys.readouterr().err


def test_the_search_flags_make_the_search() -> None:
    parser = argparse.ArgumentParser()
    add_search_options(parser, candidates=8)
    flags = ["--opponent-samples", "3", "--reach-weight", "0.5", "--improve-rounds", "2", "--improve-pool", "centres"]
    expected = SearchConfig(8, opponent_samples=3, reach_weight=0.5, improve_rounds=2, improve_pool="centres")
    assert search_from_options(parser.parse_args(flags)) == expected
    assert search_from_options(parser.parse_args(["--search", "0"])) == SearchConfig()
