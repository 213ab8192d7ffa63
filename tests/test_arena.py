"""The arena end to end (in-process CLI, 1 and 2 workers) and its outcome categories by hand.

The games are Random vs Random. Once `diprl.bots.make_agent` exists the real registry plays them;
until then a stand-in Random bot defined here does, passed in as `agent_factory`, so the arena's
own logic is tested either way.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from diprl.arena import main
from diprl.bots.base import Agent, seat_seed
from diprl.eval.arena import AgentFactory, standard_powers
from diprl.eval.arena_games import Category, GameRecord, categorize, play_game
from diprl.game import DiplomacyGame, PhaseKind

LAST_LINE = re.compile(r"^hero_solo_rate=\d\.\d{3} hero_mean_sc=\d+\.\d{2}$")


class StandInRandom:
    """Random legal orders: one per unit, or `n_required` distinct build sites / disbanded units."""

    name = "random"

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def orders(self, game: DiplomacyGame, power: str) -> list[str]:
        legal = game.legal_orders(power)
        if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
            return [self.rng.choice(legal.by_loc[loc]) for loc in legal.locs]
        if legal.kind in (PhaseKind.BUILD, PhaseKind.DISBAND):
            return [self.rng.choice(legal.by_loc[loc]) for loc in self.rng.sample(legal.locs, legal.n_required)]
        return []


def stand_in_make_agent(name: str, seed: int) -> Agent:
    if name != "random":
        raise KeyError(f"unknown bot {name!r}; the stand-in only knows 'random'")
    return StandInRandom(seed)


def _factory() -> AgentFactory | None:
    """None (the arena's default: the real registry) when `diprl.bots` provides one."""
    try:
        from diprl.bots import make_agent  # noqa: F401
    except ImportError:
        return stand_in_make_agent
    return None


AGENT_FACTORY = _factory()


def run_cli(argv: list[str]) -> tuple[int, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv, agent_factory=AGENT_FACTORY)
    return rc, out.getvalue().splitlines()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[list[str], dict[str, Any]]]:
    """The same 7-game arena with 1 and 2 workers: stdout lines and the parsed JSON of each."""
    out: dict[int, tuple[list[str], dict[str, Any]]] = {}
    for workers in (1, 2):
        path = tmp_path_factory.mktemp("arena") / "sub" / "report.json"
        argv = ["--hero", "random", "--opponents", "random", "--games", "7", "--max-year", "1902"]
        rc, lines = run_cli([*argv, "--seed", "3", "--workers", str(workers), "--json", str(path)])
        assert rc == 0
        out[workers] = (lines, json.loads(path.read_text()))
    return out


def _deterministic(report: dict[str, Any]) -> dict[str, Any]:
    summary = {k: v for k, v in report["summary"].items() if k not in ("timing", "config")}
    games = [{k: v for k, v in g.items() if k != "seconds"} for g in report["games"]]
    return {"summary": summary, "games": games}


def test_results_do_not_depend_on_worker_count(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    assert _deterministic(runs[1][1]) == _deterministic(runs[2][1])
    assert runs[1][0][-1] == runs[2][0][-1]


def test_every_power_is_hero_once_per_seven_games(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    games = runs[2][1]["games"]
    assert [g["index"] for g in games] == list(range(7))
    assert sorted(g["hero_power"] for g in games) == list(standard_powers())
    assert all(p["games"] == 1 for p in runs[2][1]["summary"]["per_power"].values())


def test_categories_partition_the_games(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    report = runs[2][1]
    summary = report["summary"]
    counts = {name: c["count"] for name, c in summary["categories"].items()}
    assert set(counts) == {c.value for c in Category}
    assert sum(counts.values()) == summary["games"] == 7
    assert Counter(g["category"] for g in report["games"]) == Counter({k: v for k, v in counts.items() if v})
    for c in summary["categories"].values():
        low, high = c["ci95"]
        assert 0.0 <= low <= c["rate"] <= high <= 1.0


def test_games_are_played_to_the_year_cap_without_order_issues(
    runs: dict[int, tuple[list[str], dict[str, Any]]],
) -> None:
    report = runs[1][1]
    assert report["summary"]["order_issues"] == {"total": 0, "hero": 0}
    for g in report["games"]:
        # Nobody solos by 1902, so every game runs through the last phase of 1902.
        assert g["solo_winner"] is None
        assert g["final_year"] == 1902
        assert g["phases"] >= 4  # at least the four movement phases; empty retreats and winters are skipped
        assert sum(g["centres"].values()) <= 34
        assert g["hero_centres"] == g["centres"][g["hero_power"]]


def test_report_text_and_last_line(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    lines, report = runs[1]
    assert LAST_LINE.match(lines[-1])
    summary = report["summary"]
    assert lines[-1] == f"hero_solo_rate={summary['hero_solo_rate']:.3f} hero_mean_sc={summary['hero_mean_sc']:.2f}"
    text = "\n".join(lines)
    for word in ("solo", "top (no solo)", "survived", "eliminated", "order issues: 0", "games/s", *standard_powers()):
        assert word in text


def test_quiet_prints_only_the_summary_line() -> None:
    rc, lines = run_cli(["--hero", "random", "--opponents", "random", "--games", "2", "--max-year", "1901", "--quiet"])
    assert rc == 0
    assert len(lines) == 1
    assert LAST_LINE.match(lines[0])


def test_unknown_agent_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        run_cli(["--hero", "no-such-bot", "--opponents", "random", "--games", "1"])
    assert exc.value.code == 2


def test_play_game_needs_an_agent_per_power() -> None:
    with pytest.raises(ValueError, match="no agent"):
        play_game({"FRANCE": StandInRandom(0)}, max_year=1901)


def test_seat_seeds_are_deterministic_and_distinct() -> None:
    seeds = [seat_seed(game, seat) for game in range(50) for seat in range(7)]
    assert seeds == [seat_seed(game, seat) for game in range(50) for seat in range(7)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**32 for s in seeds)


POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")


def record(centres: list[int], units: list[int] | None = None) -> GameRecord:
    """A hand-made final position: centres and units in POWERS order."""
    cs = dict(zip(POWERS, centres, strict=True))
    us = dict(zip(POWERS, units if units is not None else centres, strict=True))
    solo = next((p for p, n in cs.items() if n >= 18), None)
    return GameRecord(
        centres=cs,
        units=us,
        ranks={},
        sum_of_squares={},
        solo=solo,
        eliminated=tuple(p for p in POWERS if cs[p] == 0 and us[p] == 0),
        phases=0,
        last_phase="W1935A",
        final_year=1935,
        issues=dict.fromkeys(POWERS, 0),
        issue_kinds={},
        seconds=0.0,
    )


def test_categories_by_hand() -> None:
    solo = record([18, 5, 5, 3, 3, 0, 0])
    assert categorize(solo, "AUSTRIA") is Category.SOLO
    assert categorize(solo, "ENGLAND") is Category.SURVIVED  # second place does not count once someone solos
    assert categorize(solo, "RUSSIA") is Category.ELIMINATED

    tie = record([9, 9, 6, 4, 3, 2, 0], units=[9, 9, 6, 4, 3, 2, 1])
    assert categorize(tie, "AUSTRIA") is Category.TOP  # ties for most centres count as top for both
    assert categorize(tie, "ENGLAND") is Category.TOP
    assert categorize(tie, "FRANCE") is Category.SURVIVED
    assert categorize(tie, "TURKEY") is Category.SURVIVED  # a unit but no centre still survives

    with pytest.raises(ValueError):
        categorize(tie, "SPAIN")


def test_powers_are_sorted_engine_names() -> None:
    assert standard_powers() == POWERS


@pytest.mark.parametrize("argv", [["--games", "0"], ["--workers", "0"]])
def test_bad_counts_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run_cli(["--hero", "random", "--opponents", "random", *argv])
    assert exc.value.code == 2


def test_record_is_a_pure_function_of_the_seeds(tmp_path: Path) -> None:
    factory = AGENT_FACTORY
    if factory is None:
        from diprl.bots import make_agent

        factory = make_agent
    results = []
    for _ in range(2):
        agents = {p: factory("random", seat_seed(11, i)) for i, p in enumerate(POWERS)}
        rec = play_game(agents, max_year=1901)
        results.append((rec.centres, rec.units, rec.phases, rec.last_phase))
    assert results[0] == results[1]


@pytest.mark.parametrize("year", ["1800", "1900", "x"])
def test_a_year_before_the_game_starts_is_a_usage_error(year: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--hero", "random", "--opponents", "random", "--max-year", year], agent_factory=AGENT_FACTORY)
    assert exc.value.code == 2
    assert "--max-year" in capsys.readouterr().err


def test_an_unwritable_json_path_is_a_usage_error_before_any_game(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path in (blocker / "report.json", tmp_path):  # a parent that is a file; a directory as the path
        with pytest.raises(SystemExit) as exc:
            main(["--hero", "random", "--opponents", "random", "--json", str(path)], agent_factory=AGENT_FACTORY)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--json" in err and "Traceback" not in err
