"""League health reaches metrics.jsonl: the driver's schedule and the evaluation's inputs to the guards (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import MainRoleConfig
from diprl.league.health import HealthConfig
from diprl.messages import EvaluationResult, OpponentResult
from diprl.run.evaluations import evaluation_health
from diprl.run.journal import Journal
from diprl.run.progress import RunStats
from diprl.tracking import Tracker, read_metrics

from .helpers import hero_wins

ONLY_ANCHORS = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=1.0)


def _driver(tmp_path: Path, manager: LeagueManager, every: int) -> Any:
    """What `Driver._after_step` and `_log_league` read, around a real manager and a real metrics file."""
    from diprl.run.driver import Driver

    journal = Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())
    fake: Any = SimpleNamespace(
        actors=SimpleNamespace(league=SimpleNamespace(health=SimpleNamespace(remote=manager.health))),
        config=SimpleNamespace(league=SimpleNamespace(health=HealthConfig(every_steps=every))),
        evals=SimpleNamespace(on_step=lambda version, step: None),
        learning=SimpleNamespace(versions={"main": "main@v1"}),
        journal=journal,
        counters=SimpleNamespace(),
        run_dir=tmp_path,
        rating=None,
        main_step=0,
        _main_rating=lambda: 1.5,
        _server_status=lambda timeout_s: "no PolicyServer here",
        _log_canaries=lambda status: None,
    )
    fake._log_league = lambda: Driver._log_league(fake)
    fake.after_step = lambda: Driver._after_step(fake, "main")
    return fake


def test_every_run_logs_league_health_from_its_first_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    import diprl.run.driver as driver_module

    monkeypatch.setattr(ray, "get", lambda value: value)
    monkeypatch.setattr(driver_module, "save_counters", lambda run_dir, counters: None)
    manager = LeagueManager(LeagueConfig(anchors=["bot:dumbbot"], main=ONLY_ANCHORS), tmp_path)
    manager.register_version("main", "main@v1", 0)
    manager.report(hero_wins(manager.next_match("main")))
    driver = _driver(tmp_path, manager, every=3)
    for step in range(1, 8):
        driver.main_step = step
        driver.after_step()
    driver.journal.tracker.close()
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "league"]
    assert [r["step"] for r in records] == [1, 3, 6]
    first = records[0]
    assert first["league/rating"] == 1.5 and first["league/nash_members"] == 2
    assert first["league/nash"] == pytest.approx({"main": 1.0, "bot:dumbbot": 0.0}, abs=1e-6)
    assert first["league/rating/main"] > first["league/rating/bot:dumbbot"]
    assert first["league/rpp"] == pytest.approx(0.5)


def test_an_evaluation_becomes_the_guards_inputs(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    summary = {
        "eval/bot:dumbbot/support_rate": 0.01,
        "eval/bot:random/support_rate": 0.03,
        "eval/bot:dumbbot/void_support_rate": 0.9,
        "eval/bot:random/void_support_rate": None,  # no supports against Random: not a rate
        "eval/bot:dumbbot/bad_completion_rate": 0.0,
    }
    report.write_text(json.dumps({"summary": summary}))
    result = EvaluationResult(
        "step10",
        "main@v3",
        str(report),
        (
            OpponentResult("bot:dumbbot", 14, 3.0, (2.0, 4.0), 0.0),
            OpponentResult("bot:random", 14, 5.0, (4.0, 6.0), 0.0),
            OpponentResult("main@v1", 14, 9.0, (8.0, 10.0), 0.0),  # a pinned snapshot: not in the score
        ),
    )
    score, low, high, rates = evaluation_health(result)
    assert (score, low, high) == (4.0, 3.0, 5.0)
    assert rates == pytest.approx({"support_rate": 0.02, "void_support_rate": 0.9, "bad_completion_rate": 0.0})
    manager = LeagueManager(LeagueConfig(), tmp_path)
    answer = manager.observe_evaluation("main@v3", 10, score, low, high, rates)
    assert [f["guard"] for f in answer["faults"]] == ["void_support_rate"]


def test_an_always_holding_hero_trips_the_hold_rate_and_order_kind_guards(tmp_path: Path) -> None:
    """A planted collapse (a hero whose every order is a hold) through the real suite's report, the
    evaluation's guard inputs and the league's guards: two `fault` records, and a rollback to the best."""
    from diprl.eval.config import GamesConfig
    from diprl.eval.evaluator import flat_metrics, opponent_result
    from diprl.eval.suite import SuiteConfig, run_suite

    def evaluate(hero: str, tag: str) -> EvaluationResult:
        play = GamesConfig(games=2, max_year=1901, critical_supports=False)
        suite = run_suite(SuiteConfig(policy=hero, opponents=["bot:random"], play=play))
        report = tmp_path / tag / "report.json"
        report.parent.mkdir()
        report.write_text(json.dumps({"summary": flat_metrics(hero, tag, {"bot:random": suite})}))
        return EvaluationResult(tag, hero, str(report), (opponent_result("bot:random", suite),))

    config = LeagueConfig(health=HealthConfig(rollback=True))
    manager = LeagueManager(config, tmp_path)
    manager.register_version("main", "main@v1", 0)
    healthy = evaluate("bot:dumbbot", "step0")
    score, low, high, rates = evaluation_health(healthy)
    assert rates["hold_rate"] < 0.9 and max(rates["kind_shares"].values()) < 0.95, rates
    assert manager.observe_evaluation("main@v1", 0, score, low, high, rates)["faults"] == []
    manager.register_version("main", "main@v2", 1)
    score, low, high, rates = evaluation_health(evaluate("bot:hold", "step1"))
    assert rates["hold_rate"] == 1.0 and rates["kind_shares"] == {
        "convoy": 0.0,
        "hold": 1.0,
        "move": 0.0,
        "support": 0.0,
    }
    answer = manager.observe_evaluation("main@v2", 1, max(score, low), low, high, rates)
    assert {f["guard"] for f in answer["faults"]} >= {"hold_rate", "kind_share/hold"}
    assert answer["rollback"] is not None and answer["rollback"]["to"] == "main@v1"
