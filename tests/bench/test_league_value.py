"""The league-value bench: its figures on hand-checkable fixtures, its training runs' overrides, and a tiny
run end to end (real training runs of seconds, a planted always-hold final, a few games) whose last line
is computed from what was played."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from diprl.bench.__main__ import main
from diprl.bench.league_value import (
    EXPERIMENTS,
    QUIET_RUN,
    Start,
    exploit_args,
    exploit_outcomes,
    exploitability,
    last_line,
    nash_intervals,
    pair_shares,
    parse_finals,
    plot_exploitability,
    summary_lines,
    training_args,
)
from diprl.run.config import compose_config

LAST_LINE = re.compile(
    r"exploitability_selfplay=(\S+) exploitability_pfsp=(\S+) exploitability_league=(\S+) "
    r"nash_selfplay=(\S+) nash_pfsp=(\S+) nash_league=(\S+)"
)


def test_exploitability_is_the_exploiters_gain_over_one_half_with_wilsons_interval() -> None:
    # z = 2 keeps Wilson's arithmetic by hand: n games all won give low = n / (n + z^2) = 8 / 12, high = 1.
    won = exploitability("exploit-pfsp@v1", "pfsp@v1", [1.0] * 8, z=2.0)
    assert (won["games"], won["share"], won["exploitability"]) == (8.0, 1.0, 0.5)
    assert won["ci95"] == pytest.approx([2 / 3 - 0.5, 0.5])
    assert won["lower_bound"] == pytest.approx(1 / 6)
    # Two copies of one policy: every game even. Centre 1/2, half-width z / (1 + z^2/n) * sqrt(1/(4n) + z^2/(4n^2))
    # = 1 * sqrt(1/16 + 1/16) for n = 4: an interval around 0, and no lower bound above 0.
    even = exploitability("a", "b", [0.5] * 4, z=2.0)
    assert even["exploitability"] == 0.0
    assert even["ci95"] == pytest.approx([-math.sqrt(0.125), math.sqrt(0.125)])
    assert even["lower_bound"] == 0.0
    with pytest.raises(ValueError, match="no games"):
        exploitability("a", "b", [])


def _game(hero: str, centres: dict[str, int]) -> dict[str, Any]:
    return {"hero_power": hero, "centres": centres, "seats": dict.fromkeys(centres, "x")}


def test_an_outcome_is_the_share_of_opponent_seats_outranked_ties_half() -> None:
    powers = ["AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY"]
    # Austria 5 against 3, 3, 5, 6, 0, 4: beats four, ties one, loses to one -> 4.5 / 6.
    first = _game("AUSTRIA", dict(zip(powers, [5, 3, 3, 5, 6, 0, 4], strict=True)))
    # England with 3 against six 3s: all ties -> 1/2.
    second = _game("ENGLAND", dict.fromkeys(powers, 3))
    report = {"policy": "h@v1", "opponents": ["o@v1"], "per_game": [first, second]}
    assert exploit_outcomes(report) == [0.75, 0.5]
    assert pair_shares([report]) == {("h@v1", "o@v1"): [0.75, 0.5]}


def test_nash_intervals_collapse_when_no_game_varies_and_widen_when_they_do() -> None:
    # Rock-paper-scissors, every game decided the same way: each resample is the same matrix, whose
    # max-entropy Nash is a third each.
    rps = {("r", "s"): [1.0] * 3, ("s", "r"): [0.0] * 3, ("p", "r"): [1.0] * 3, ("r", "p"): [0.0] * 3,
           ("s", "p"): [1.0] * 3, ("p", "s"): [0.0] * 3}  # fmt: skip
    intervals = nash_intervals(["r", "p", "s"], rps, n_boot=20)
    for low, high in intervals.values():
        assert low == pytest.approx(1 / 3, abs=1e-4) and high == pytest.approx(1 / 3, abs=1e-4)
    # "a" beats "b" in one game of two: resamples give "a" wins of 0, 1/2 or 1, so "a"'s weight ranges over [0, 1].
    mixed = nash_intervals(["a", "b"], {("a", "b"): [1.0, 0.0], ("b", "a"): [0.0, 1.0]}, n_boot=200, seed=1)
    assert mixed["a"][0] == pytest.approx(0.0, abs=1e-6) and mixed["a"][1] == pytest.approx(1.0, abs=1e-6)


def test_the_last_line_names_each_experiments_exploitability_and_nash_weight() -> None:
    exploit = {e: {"exploitability": x} for e, x in zip(EXPERIMENTS, [0.25, -0.0625, 0.0], strict=True)}
    nash = dict(zip(EXPERIMENTS, [0.5, 0.125, 0.375], strict=True))
    assert last_line(exploit, nash) == (
        "exploitability_selfplay=0.250 exploitability_pfsp=-0.062 exploitability_league=0.000 "
        "nash_selfplay=0.500 nash_pfsp=0.125 nash_league=0.375"
    )


def test_the_report_has_a_row_per_experiment_its_plots_and_the_last_line(tmp_path: Path) -> None:
    refs = ["selfplay@v1", "pfsp@v1", "league@v1", "base", "bot:dumbbot", "bot:random"]
    finals = dict(zip(EXPERIMENTS, refs, strict=False))
    nash = dict.fromkeys(refs, 0.0) | {"league@v1": 0.25, "bot:dumbbot": 0.75}
    summary = {
        "start": {"name": "pretrained", "what": "zoo:pretrained's body"},
        "minutes": 15.0,
        "exploit_minutes": 7.5,
        "max_year": 1906,
        "train": {"selfplay": {"train_steps": 40}, "pfsp": {"train_steps": 30}, "league": {"planted": "x"}},
        "finals": finals,
        "exploit": {
            e: {"share": 0.5 + x, "games": 56.0, "exploitability": x, "ci95": [x - 0.1, x + 0.1], "lower_bound": 0.0}
            for e, x in zip(EXPERIMENTS, [0.25, 0.125, 0.0], strict=True)
        },
        "crossplay": {
            "policies": refs,
            "payoff": [[None if i == j else 0.5 for j in range(6)] for i in range(6)],
            "nash": nash,
            "nash_payoff": dict.fromkeys(refs, 0.0),
            "ratings": {r: {"ordinal": 1.5} for r in refs},
        },
        "nash": {e: nash[finals[e]] for e in EXPERIMENTS},
        "nash_ci95": {r: [0.0, 1.0] for r in refs},
    }
    lines = summary_lines(summary)
    assert lines[0].startswith("start: zoo:pretrained's body; 15 minutes of training each, exploiters 7.5")
    rows = [line for line in lines if line.startswith("| ") and line.split(" | ")[0][2:] in EXPERIMENTS]
    assert [row.split(" | ")[2] for row in rows] == ["40", "30", "planted"]
    assert "+0.250 [+0.150, +0.350]" in rows[0] and "| 0.250 [0.000, 1.000] |" in rows[2]
    assert lines[-1] == last_line(summary["exploit"], summary["nash"])
    assert plot_exploitability(summary, tmp_path / "e.png").stat().st_size > 0


def test_every_run_starts_alike_and_spends_its_minutes_on_training(tmp_path: Path) -> None:
    start = Start("pretrained", "tiny_pretrained", ("model=tiny_pretrained", "learner.lr=2e-3"), "")
    for experiment in EXPERIMENTS:
        config, _ = compose_config(training_args(experiment, 7.5, tmp_path / experiment, start, ["learner.seed=3"]))
        assert (config.experiment, config.model.name, config.learner.lr, config.learner.seed) == (
            experiment, "tiny_pretrained", 2e-3, 3
        )  # fmt: skip
        assert (config.train.max_minutes, config.train.max_steps) == (7.5, 100000)
        assert not (config.evaluation.at_start or config.evaluation.at_end or config.evaluation.every_steps)
    league, _ = compose_config(training_args("league", 1, tmp_path / "l", start))
    assert league.league.roles == ["main", "main_exploiter", "league_exploiter"]
    args = exploit_args("pfsp@v1", 3.0, tmp_path / "x", start, {"pfsp": str(tmp_path / "main" / "v9")})
    config, _ = compose_config(args)
    assert config.league.roles == ["main"] and config.league.anchors == ["pfsp@v1"]
    assert config.league.main.anchors == 1.0  # every match against the frozen main, in all six seats
    assert config.train.frozen_adapters == {"pfsp": str(tmp_path / "main" / "v9")}
    assert (config.model.name, config.learner.groups_per_step, config.train.max_minutes) == ("tiny_pretrained", 8, 3.0)
    bot, _ = compose_config(exploit_args("bot:hold", 3.0, tmp_path / "y", start, {}))
    assert bot.league.anchors == ["bot:hold"] and bot.train.frozen_adapters == {}
    assert set(QUIET_RUN) <= set(args)


def test_a_planted_final_is_a_bot_outside_the_anchors_or_an_adapter_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_finals(["selfplay=bot:hold", f"league={tmp_path}"]) == {
        "selfplay": "bot:hold",
        "league": str(tmp_path.resolve()),
    }
    for bad in ("selfplay=bot:dumbbot", "coach=bot:hold", "pfsp=bot:nobody", f"pfsp={tmp_path / 'missing'}", "pfsp"):
        with pytest.raises(ValueError):
            parse_finals([bad])
    # A planted exploiter may be any rule bot (exploiters are not in the crossplay), but not its final itself.
    assert parse_finals(["league=bot:dumbbot"], "--exploiter", in_crossplay=False) == {"league": "bot:dumbbot"}
    with pytest.raises(ValueError, match="--exploiter 'coach=bot:hold'"):
        parse_finals(["coach=bot:hold"], "--exploiter", in_crossplay=False)
    with pytest.raises(SystemExit):
        main(["league-value", "--final", "league=bot:territorial", "--exploiter", "league=bot:territorial"])
    assert "league's planted final itself" in capsys.readouterr().err


def test_a_tiny_bench_trains_exploits_and_measures_every_final(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seconds of training a run: pfsp's main for real, selfplay's final planted as six Hold bots that never
    move and league's as Territorial; pfsp's exploiter trained against its adapter frozen, selfplay's planted
    as Territorial and league's as DumbBot (two run starts fewer: each costs a Ray, a PolicyServer and a
    learner); a 7-game crossplay and 7 games of each exploiter (every power once), to the end of 1901. An
    exploiter that moves at all outranks the holding seats: selfplay's exploitability is above 0, and every figure
    of the last line is the one the summary computed from the games."""
    tiny = [
        "train.max_steps=1",
        "rollout.matches_in_flight=2",
        "rollout.episode.group_size=2",
        "rollout.episode.warmup_min_phases=0",
        "rollout.episode.warmup_max_phases=2",
        "rollout.episode.horizon_years=1",
        "rollout.episode.max_tokens=160",
        "learner.groups_per_step=1",
    ]
    out = tmp_path / "bench"
    argv = ["league-value", "--minutes", "5", "--games", "7", "--exploit-games", "7", "--max-year", "1901",
            "--final", "selfplay=bot:hold", "--final", "league=bot:territorial",
            "--exploiter", "selfplay=bot:territorial", "--exploiter", "league=bot:dumbbot",
            "--out", str(out), *tiny]  # fmt: skip
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = LAST_LINE.fullmatch(last)
    assert match is not None, last
    summary = json.loads((out / "league_value.json").read_text())
    figures = [summary["exploit"][e]["exploitability"] for e in EXPERIMENTS] + [summary["nash"][e] for e in EXPERIMENTS]
    assert [float(x) for x in match.groups()] == pytest.approx(figures, abs=5e-4)
    assert summary["finals"] == {"selfplay": "bot:hold", "pfsp": "pfsp@v1", "league": "bot:territorial"}
    assert summary["train"]["pfsp"]["train_steps"] >= 1 and summary["train"]["selfplay"]["planted"] == "bot:hold"
    held = summary["exploit"]["selfplay"]
    assert held["games"] == 7 and held["exploitability"] > 0.0 and held["lower_bound"] > 0.0
    planted = {"selfplay": "bot:territorial", "league": "bot:dumbbot"}
    for e, bot in planted.items():
        assert summary["exploit_runs"][e] == {"planted": bot, "final": bot}
        assert summary["exploiters"][e] == bot and summary["exploit"][e]["games"] == 7
        assert not (out / "exploit" / e).exists()  # planted: never trained
    assert summary["exploit_runs"]["pfsp"]["train_steps"] >= 1 and summary["exploiters"]["pfsp"] == "exploit-pfsp@v1"
    for e in EXPERIMENTS:
        low, high = summary["exploit"][e]["ci95"]
        assert low <= summary["exploit"][e]["exploitability"] <= high
    # pfsp's exploiter trained against pfsp's final itself, frozen: the same bytes in its run's store.
    from diprl.inference.adapters import AdapterStore

    frozen = AdapterStore(out / "exploit" / "pfsp" / "adapters").resolve("pfsp@v1")
    final = AdapterStore(out / "train" / "pfsp" / "adapters").resolve(summary["train"]["pfsp"]["final"])
    assert frozen.fingerprint == final.fingerprint
    crossplay = summary["crossplay"]
    assert crossplay["policies"] == ["bot:hold", "pfsp@v1", "bot:territorial", "base", "bot:dumbbot", "bot:random"]
    assert all(g == 7 for i, row in enumerate(crossplay["games"]) for j, g in enumerate(row) if i != j)
    assert sum(crossplay["nash"].values()) == pytest.approx(1.0)
    assert (out / "crossplay.png").is_file() and (out / "exploitability.png").is_file()
