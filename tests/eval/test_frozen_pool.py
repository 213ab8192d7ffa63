"""The frozen evaluation pool: main's snapshots pinned on the league's rule meet every later version on
the same seeded games, and the driver hands the league's pins to the evaluator once each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diprl.eval.config import GamesConfig
from diprl.eval.evaluator import Evaluator, EvaluatorConfig
from diprl.league import LeagueConfig, LeagueManager
from diprl.league.health import HealthConfig
from diprl.messages import EvaluationResult
from tests.ray_stand_in import Actor, use_stand_in_ray

from .conftest import RecordingClient

GAMES = GamesConfig(games=3, max_year=1901)  # seeded games, and each LLM seat's request seeded (sampling_seed 0)


def _games_against(result: EvaluationResult, opponent: str, hero: str) -> list[dict[str, Any]]:
    """The games of `result`'s suite against `opponent`, with the hero's ref (a later version each time) masked."""
    games = json.loads(Path(result.report).read_text())["suites"][opponent]["per_game"]
    for game in games:
        game["seats"] = {p: "HERO" if ref == hero else ref for p, ref in game["seats"].items()}
    return list(games)


def test_a_pinned_snapshot_is_evaluated_on_the_same_games_every_time(tmp_path: Path) -> None:
    client = RecordingClient()
    evaluator = Evaluator(EvaluatorConfig(pool=["bot:random"], plots=False, play=GAMES), tmp_path, client)
    evaluator.pin("main@v1")
    first = evaluator.evaluate("main@v5", "step10")
    asked_first = sorted((r.sample_seed, str(r.prompt)) for call in client.calls for r in call if r.policy == "main@v1")
    evaluator.pin("main@v3")  # the pool grows between the two evaluations
    client.calls.clear()
    again = evaluator.evaluate("main@v9", "step20")
    asked_again = sorted((r.sample_seed, str(r.prompt)) for call in client.calls for r in call if r.policy == "main@v1")
    assert [o.opponent for o in again.opponents] == ["bot:random", "main@v1", "main@v3"]
    assert asked_first and asked_again == asked_first  # the snapshot's every decision, seed and position alike
    assert _games_against(again, "main@v1", "main@v9") == _games_against(first, "main@v1", "main@v5")
    assert next(o for o in again.opponents if o.opponent == "main@v1").games == GAMES.games


class PoolOnly(Evaluator):
    """The evaluator's pool and pins for real; `evaluate` only records what it was asked."""

    asked: list[tuple[str, list[str]]]

    def evaluate(self, policy_ref: str, tag: str) -> Any:
        self.asked.append((policy_ref, self.pool()))
        return None


def test_the_leagues_pins_reach_the_evaluator_before_each_evaluation_and_are_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diprl.run.config import EvalScheduleConfig
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters
    from diprl.tracking import Tracker, read_metrics

    use_stand_in_ray(monkeypatch)
    league = LeagueManager(LeagueConfig(snapshot_steps=1, health=HealthConfig(pin_every=2, pin_max=2)), tmp_path)
    evaluator = PoolOnly(EvaluatorConfig(pool=["bot:random"], plots=False, play=GAMES), tmp_path)
    evaluator.asked = []
    tracker = Tracker(tmp_path, {}, use_wandb=False)
    journal = Journal(tmp_path, tracker, RunStats())

    def schedule() -> EvalSchedule:
        return EvalSchedule(
            Actor(evaluator), EvalScheduleConfig(every_steps=2), journal, Counters(), league=Actor(league)
        )

    evals = schedule()
    league.register_version("main", "main@v1", 0)
    evals.start("main@v1", 0)
    evals.fill(stopping=False)
    evals.running.clear()  # the evaluation "finished"
    for n in range(2, 6):  # 2N steps apart: every version is a snapshot; v2 and v4 are pinned
        league.register_version("main", f"main@v{n}", 2 * n)
    evals.on_step("main@v5", 10)
    evals.fill(stopping=False)
    evals.running.clear()
    again = schedule()  # a resumed driver hands the same pins over again: nothing new, nothing logged
    again.on_step("main@v5", 10)
    again.waiting.append(("main@v5", 10, 0))
    again.fill(stopping=False)
    assert evaluator.asked == [
        ("main@v1", ["bot:random"]),
        ("main@v5", ["bot:random", "main@v2", "main@v4"]),
        ("main@v5", ["bot:random", "main@v2", "main@v4"]),
    ]
    tracker.close()
    pins = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("league/eval_pin")]
    assert [(r["kind"], r["step"], r["league/eval_pin"]) for r in pins] == [
        ("league", 10, "main@v2"),
        ("league", 10, "main@v4"),
    ]
    assert pins[-1]["eval/pool"] == ["bot:random", "main@v2", "main@v4"]
