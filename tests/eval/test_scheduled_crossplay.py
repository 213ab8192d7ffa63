"""Scheduled crossplay (issue 36): the evaluator plays the pool pairs the league's Nash lacks games for,
seeded, and the games reach the payoff once, so members that never met are measured instead of left out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diprl.eval.config import GamesConfig
from diprl.eval.evaluator import Evaluator, EvaluatorConfig
from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import MainRoleConfig
from diprl.league.health import HealthConfig
from diprl.messages import EvaluationResult, OpponentResult
from tests.league.helpers import hero_loses, hero_wins
from tests.ray_stand_in import Actor, use_stand_in_ray

ANCHORS = ["bot:random", "bot:dumbbot", "bot:hold"]
ONLY_ANCHORS = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=1.0)
GAMES = GamesConfig(games=2, max_year=1901)


def _league(tmp_path: Path, pairs: int = 2, **health: int) -> LeagueManager:
    """Main has played every anchor; no two anchors ever met, so the Nash leaves all but one out."""
    health = {"crossplay_pairs": pairs, "crossplay_games": 7} | health
    config = LeagueConfig(anchors=ANCHORS, main=ONLY_ANCHORS, decay=1.0, health=HealthConfig(**health))
    league = LeagueManager(config, tmp_path)
    league.register_version("main", "main@v1", 0)
    for _ in range(30):
        match = league.next_match("main")
        opponent = next(str(ref) for p, ref in match.seats.items() if p != match.hero)
        league.report(hero_wins(match) if opponent == "bot:random" else hero_loses(match))
    return league


def test_the_plan_asks_for_the_unmeasured_pool_pairs_and_their_games_fill_the_nash(tmp_path: Path) -> None:
    league = _league(tmp_path, pairs=3)
    before = league.health()
    assert len(before["league/nash_left_out"]) == 2  # main met every anchor, no anchor met another
    plan = league.crossplay_plan()
    assert plan["games"] == 7
    assert sorted(map(sorted, plan["pairs"])) == [  # every pair of anchors, none with a learner
        ["bot:dumbbot", "bot:hold"],
        ["bot:dumbbot", "bot:random"],
        ["bot:hold", "bot:random"],
    ]
    results = [{"hero": a, "opponent": b, "games": 2, "outcomes": [1.0, 0.5]} for a, b in plan["pairs"]]
    assert league.report_crossplay("crossplay-step10", results) == {"tag": "crossplay-step10", "new": True, "games": 6}
    assert league.report_crossplay("crossplay-step10", results)["new"] is False  # a retried report: once
    a, b = plan["pairs"][0]
    assert league.payoff.games(a, b) == 2.0 and league.payoff.win_rate(a, b) == pytest.approx(0.75)
    after = league.health()
    assert after["league/nash_left_out"] == [] and set(after["league/nash"]) == {"main", *ANCHORS}
    assert league.crossplay_plan()["pairs"] == []  # every pair measured: nothing left to schedule
    again = LeagueManager(league.config, tmp_path)  # persisted, the round's tag too
    assert again.report_crossplay("crossplay-step10", results)["new"] is False
    assert again.payoff.games(a, b) == 2.0


def test_the_plan_takes_the_least_played_pairs_first_and_at_most_the_configured_number(tmp_path: Path) -> None:
    league = _league(tmp_path, pairs=1)
    first = league.crossplay_plan()["pairs"]
    assert len(first) == 1
    league.report_crossplay("r1", [{"hero": first[0][0], "opponent": first[0][1], "games": 1, "outcomes": [0.5]}])
    second = league.crossplay_plan()["pairs"]
    assert len(second) == 1 and sorted(second[0]) != sorted(first[0])
    off = LeagueManager(LeagueConfig(anchors=ANCHORS, health=HealthConfig(crossplay_pairs=0)), tmp_path / "off")
    assert off.crossplay_plan()["pairs"] == []


def test_the_evaluator_plays_each_pair_on_the_same_seeded_games(tmp_path: Path) -> None:
    evaluator = Evaluator(EvaluatorConfig(pool=["bot:random"], plots=False, play=GAMES), tmp_path)
    pairs = [["bot:dumbbot", "bot:random"], ["bot:hold", "bot:dumbbot"]]
    first = evaluator.crossplay(pairs, 3, "crossplay-step1")
    assert [(r["hero"], r["opponent"], r["games"]) for r in first] == [
        ("bot:dumbbot", "bot:random", 3),
        ("bot:hold", "bot:dumbbot", 3),
    ]
    assert all(0.0 <= o <= 1.0 for r in first for o in r["outcomes"])
    assert evaluator.crossplay(list(reversed(pairs)), 3, "crossplay-step2") == list(reversed(first))
    assert (tmp_path / "eval" / "crossplay" / "crossplay-step1.json").is_file()
    with pytest.raises(ValueError, match="two policies"):
        evaluator.crossplay([["bot:hold", "bot:hold"]], 3, "x")


class QuickEvaluator(Evaluator):
    """Crossplay for real (bots only); `evaluate` answers a fixed result without playing."""

    def evaluate(self, policy_ref: str, tag: str) -> EvaluationResult:
        return EvaluationResult(
            tag, policy_ref, "missing.json", (OpponentResult("bot:random", 2, 5.0, (4.0, 6.0), 0.0),)
        )


def _evaluated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, LeagueManager, Any]:
    """(schedule, league, tracker) right after the run's first evaluation: a crossplay round is due."""
    from diprl.run.config import EvalScheduleConfig
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters
    from diprl.tracking import Tracker

    use_stand_in_ray(monkeypatch)
    league = _league(tmp_path)
    evaluator = QuickEvaluator(EvaluatorConfig(pool=["bot:random"], plots=False, play=GAMES), tmp_path)
    tracker = Tracker(tmp_path, {}, use_wandb=False)
    evals = EvalSchedule(
        Actor(evaluator), EvalScheduleConfig(), Journal(tmp_path, tracker, RunStats()), Counters(), league=Actor(league)
    )
    evals.start("main@v1", 0)
    evals.fill(stopping=False)
    (ref,) = evals.refs()
    evals.handle(ref)
    assert evals.crossplay_due == 0
    return evals, league, tracker


def test_after_an_evaluation_the_schedule_plays_a_crossplay_round_into_the_payoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diprl.tracking import read_metrics

    evals, league, tracker = _evaluated_once(tmp_path, monkeypatch)
    evals.fill(stopping=True)
    assert evals.refs() == []  # a stopping run starts none
    evals.fill(stopping=False)
    (ref,) = evals.refs()
    assert ref in evals.crossplaying
    plan = league.crossplay_plan()["pairs"]
    evals.handle(ref)
    assert evals.refs() == [] and evals.crossplay_due is None
    played = [p for p in plan if p not in league.crossplay_plan()["pairs"]]
    assert len(played) == 2 and all(league.payoff.games(a, b) == 7.0 for a, b in played)
    tracker.close()
    (record,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "league/crossplay" in r]
    assert record["kind"] == "league" and record["league/crossplay_games"] == 14
    assert [[p["hero"], p["opponent"]] for p in record["league/crossplay"]] == played
    assert record["league/crossplay_tag"] == "crossplay-step0"


def test_no_crossplay_round_starts_once_the_training_budget_is_spent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evals, league, tracker = _evaluated_once(tmp_path, monkeypatch)
    plan = league.crossplay_plan()["pairs"]
    evals.fill(stopping=False, spent=True)
    assert evals.refs() == [] and evals.crossplay_due is None
    evals.fill(stopping=False)  # the round was dropped, not postponed
    assert evals.refs() == [] and league.crossplay_plan()["pairs"] == plan
    tracker.close()


def test_a_round_keeps_each_pairs_first_games_as_replays_in_a_folder_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds scheduled as in a run (one after each evaluation, one pair a round): each pair's first game is
    a replay where the league page's listing finds it; a later round writes beside it, never over it, and
    only the newest `crossplay_replay_rounds` rounds' replays stay."""
    from diprl.run.config import EvalScheduleConfig
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters
    from diprl.tracking import Tracker
    from diprl.web.games import games_between, run_games

    use_stand_in_ray(monkeypatch)
    league = _league(tmp_path, pairs=1, crossplay_games=2, crossplay_replays=1, crossplay_replay_rounds=2)
    evaluator = QuickEvaluator(EvaluatorConfig(pool=["bot:random"], plots=False, play=GAMES), tmp_path)
    tracker = Tracker(tmp_path, {}, use_wandb=False)
    schedule = EvalScheduleConfig(every_steps=1, at_start=False)
    evals = EvalSchedule(
        Actor(evaluator), schedule, Journal(tmp_path, tracker, RunStats()), Counters(), league=Actor(league)
    )
    evals.start("main@v1", 0)
    rounds = tmp_path / "eval" / "crossplay" / "rounds"
    played: list[tuple[str, str, Path]] = []
    for step in (1, 2, 3):
        (hero, opponent), *_ = league.crossplay_plan()["pairs"]
        evals.on_step(f"main@v{step}", step)
        for _ in range(2):  # the evaluation, then the crossplay round it made due
            evals.fill(stopping=False)
            (ref,) = evals.refs()
            evals.handle(ref)
        pair = rounds / f"crossplay-step{step}" / f"{hero}_vs_{opponent}".replace(":", "_")
        assert sorted(p.name for p in pair.iterdir()) == ["game0000"]  # the first of the pair's 2 games
        assert {"replay.json", "index.html", "frames"} <= {p.name for p in (pair / "game0000").iterdir()}
        played.append((hero, opponent, pair / "game0000" / "replay.json"))
        first = played[0][2]
        if step == 1:
            kept, kept_at = first.read_bytes(), first.stat().st_mtime_ns
        if step == 2:  # the first round's replay is still there, untouched, beside the second's
            assert first.read_bytes() == kept and first.stat().st_mtime_ns == kept_at
            assert sorted(p.name for p in rounds.iterdir()) == ["crossplay-step1", "crossplay-step2"]
    tracker.close()
    assert len({(h, o) for h, o, _ in played}) == 3  # each round measured another pair
    assert sorted(p.name for p in rounds.iterdir()) == ["crossplay-step2", "crossplay-step3"]  # the newest 2 kept
    listing = run_games(tmp_path.name, tmp_path)
    for hero, opponent, replay in played[1:]:  # what the league page links a payoff cell to
        (game,) = games_between(listing, hero, opponent)
        assert game.path == replay and game.id.startswith("crossplay/crossplay-step")
    assert not games_between(listing, played[0][0], played[0][1])  # pruned with its round


def test_crossplay_replays_are_checked_like_an_evaluations(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="crossplay_replays must be between 0 and crossplay_games"):
        HealthConfig(crossplay_games=2, crossplay_replays=3)
    with pytest.raises(ValueError, match="crossplay_replay_rounds must be >= 1"):
        HealthConfig(crossplay_replay_rounds=0)
    evaluator = Evaluator(EvaluatorConfig(pool=["bot:random"], plots=False, play=GAMES), tmp_path)
    with pytest.raises(ValueError, match="replays must be between 0 and games"):
        evaluator.crossplay([["bot:hold", "bot:random"]], 1, "r", replays=2)
    with pytest.raises(ValueError, match="keep_rounds"):
        evaluator.crossplay([["bot:hold", "bot:random"]], 1, "r", replays=1, keep_rounds=0)
    assert not (tmp_path / "eval" / "crossplay" / "rounds").exists()
