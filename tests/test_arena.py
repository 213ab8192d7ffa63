"""The arena end to end (in-process CLI, 1 and 2 workers) and its outcome categories by hand.

The arena is a thin command over the suite (`diprl.eval.suite`); these tests read what it prints
and the suite report it writes with `--json`.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from diprl.arena import main
from diprl.bots.base import seat_seed
from diprl.eval.records import Category, categorize
from diprl.game.scoring import GameScore
from diprl.game.seating import standard_powers

LAST_LINE = re.compile(r"^hero_solo_rate=\d\.\d{3} hero_mean_sc=\d+\.\d{2}$")


def run_cli(argv: list[str]) -> tuple[int, list[str]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(argv)
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
    return {k: v for k, v in report.items() if k not in ("timing", "config")}


def test_results_do_not_depend_on_worker_count(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    assert _deterministic(runs[1][1]) == _deterministic(runs[2][1])
    assert runs[1][0][-1] == runs[2][0][-1]


def test_every_power_is_hero_once_per_seven_games(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    games = runs[2][1]["per_game"]
    assert [g["index"] for g in games] == list(range(7))
    assert sorted(g["hero_power"] for g in games) == list(standard_powers())
    assert all(p["games"] == 1 for p in runs[2][1]["per_power"].values())
    assert runs[2][1]["config"]["workers"] == 2 and runs[1][1]["config"]["workers"] == 1


def test_categories_partition_the_games(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    report = runs[2][1]
    counts = {name: c["count"] for name, c in report["categories"].items()}
    assert set(counts) == {c.value for c in Category}
    assert sum(counts.values()) == report["games"] == 7
    assert Counter(g["category"] for g in report["per_game"]) == Counter({k: v for k, v in counts.items() if v})
    for c in report["categories"].values():
        low, high = c["ci95"]
        assert 0.0 <= low <= c["rate"] <= high <= 1.0


def test_games_are_played_to_the_year_cap_without_order_issues(
    runs: dict[int, tuple[list[str], dict[str, Any]]],
) -> None:
    report = runs[1][1]
    assert report["order_issues"] == {"total": 0, "hero": 0}
    for g in report["per_game"]:
        # Nobody solos by 1902, so every game runs through the last phase of 1902.
        assert g["solo_winner"] is None
        assert g["final_year"] == 1902
        assert g["phases"] >= 4  # at least the four movement phases; empty retreats and winters are skipped
        assert sum(g["centres"].values()) <= 34
        assert g["hero_centres"] == g["centres"][g["hero_power"]]


def test_report_text_and_last_line(runs: dict[int, tuple[list[str], dict[str, Any]]]) -> None:
    lines, report = runs[1]
    assert LAST_LINE.match(lines[-1])
    assert lines[-1] == f"hero_solo_rate={report['hero_solo_rate']:.3f} hero_mean_sc={report['hero_mean_sc']:.2f}"
    assert lines[0] == "random vs 6 x random: 7 games, max year 1902, seed 3"
    assert runs[2][0][0] == "random vs 6 x random: 7 games, max year 1902, seed 3, 2 worker processes"
    text = "\n".join(lines)
    for word in ("solo", "top (no solo)", "survived", "eliminated", "order issues: 0", "games/s", *standard_powers()):
        assert word in text
    # The arena leaves the costly re-adjudication of supports out (the evaluate command measures it).
    assert report["config"]["play"]["critical_supports"] is False
    assert report["behaviour"]["critical_support_rate"] is None


def test_fewer_games_than_powers_show_every_power(tmp_path: Path) -> None:
    rc, lines = run_cli(["--hero", "random", "--opponents", "hold", "--games", "2", "--max-year", "1901"])
    assert rc == 0
    rows = {
        line.split()[0]: line.split()[1:] for line in lines if line.split() and line.split()[0] in standard_powers()
    }
    assert set(rows) == set(standard_powers())
    assert sum(row[0] == "1" for row in rows.values()) == 2
    assert rows["TURKEY"] == ["0", "-", "-", "-"]


def test_quiet_prints_only_the_summary_line() -> None:
    rc, lines = run_cli(["--hero", "random", "--opponents", "random", "--games", "2", "--max-year", "1901", "--quiet"])
    assert rc == 0
    assert len(lines) == 1
    assert LAST_LINE.match(lines[0])


@pytest.mark.parametrize("name", ["no-such-bot", "nobody", "bot:random", "main@v1"])
def test_unknown_agent_is_a_usage_error(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--hero", name, "--opponents", "random", "--games", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "bot" in err and "Traceback" not in err


def test_seat_seeds_are_deterministic_and_distinct() -> None:
    seeds = [seat_seed(game, seat) for game in range(50) for seat in range(7)]
    assert seeds == [seat_seed(game, seat) for game in range(50) for seat in range(7)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**32 for s in seeds)


POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")


def record(centres: list[int], units: list[int] | None = None) -> GameScore:
    """A hand-made final position: centres and units in POWERS order."""
    cs = dict(zip(POWERS, centres, strict=True))
    us = dict(zip(POWERS, units if units is not None else centres, strict=True))
    solo = next((p for p, n in cs.items() if n >= 18), None)
    return GameScore(
        centres=cs,
        units=us,
        ranks={},
        sum_of_squares={},
        solo=solo,
        eliminated=tuple(p for p in POWERS if cs[p] == 0 and us[p] == 0),
        final_phase="COMPLETED",
        year=1935,
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


def test_a_run_is_a_pure_function_of_the_seeds(
    runs: dict[int, tuple[list[str], dict[str, Any]]], tmp_path: Path
) -> None:
    argv = ["--hero", "random", "--opponents", "random", "--games", "7", "--max-year", "1902", "--quiet"]
    reports = {}
    for seed in (3, 4):
        path = tmp_path / f"seed{seed}.json"
        assert run_cli([*argv, "--seed", str(seed), "--workers", "1", "--json", str(path)])[0] == 0
        reports[seed] = json.loads(path.read_text())
    assert _deterministic(reports[3]) == _deterministic(runs[1][1])  # again: the same games
    assert [g["centres"] for g in reports[4]["per_game"]] != [g["centres"] for g in reports[3]["per_game"]]


@pytest.mark.parametrize("year", ["1800", "1900", "x"])
def test_a_year_before_the_game_starts_is_a_usage_error(year: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--hero", "random", "--opponents", "random", "--max-year", year])
    assert exc.value.code == 2
    assert "--max-year" in capsys.readouterr().err


def test_an_unwritable_json_path_is_a_usage_error_before_any_game(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for path in (blocker / "report.json", tmp_path):  # a parent that is a file; a directory as the path
        with pytest.raises(SystemExit) as exc:
            main(["--hero", "random", "--opponents", "random", "--json", str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--json" in err and "Traceback" not in err
