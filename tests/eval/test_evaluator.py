"""The training run's evaluator: the suite against a frozen pool, results under run_dir/eval, pins kept,
a typed result back to the driver, and the training config's games reaching it unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diprl.eval.config import GamesConfig
from diprl.eval.evaluator import Evaluator, EvaluatorConfig, start_evaluator
from diprl.messages import EvaluationResult, OpponentResult

from .conftest import RecordingClient

TWO_GAMES = GamesConfig(games=2, max_year=1901)


def test_evaluate_writes_a_report_per_opponent_and_returns_its_gist(tmp_path: Path) -> None:
    client = RecordingClient()
    evaluator = Evaluator(EvaluatorConfig(pool=["bot:random", "base"], plots=False, play=TWO_GAMES), tmp_path, client)
    result = evaluator.evaluate("main@v3", "step-10")
    assert isinstance(result, EvaluationResult)
    assert (result.tag, result.policy) == ("step-10", "main@v3")
    assert [o.opponent for o in result.opponents] == ["bot:random", "base"]
    # Both suites ran in one lockstep run: the first batch holds main@v3's and base's seats of all 4 games.
    first = client.calls[0]
    assert {r.policy for r in first} == {"main@v3", "base"}
    assert sum(r.policy == "main@v3" for r in first) == 4
    assert Path(result.report) == tmp_path / "eval" / "step-10" / "report.json"
    saved = json.loads(Path(result.report).read_text())
    assert saved["pool"] == ["bot:random", "base"] and set(saved["suites"]) == {"bot:random", "base"}
    for o in result.opponents:  # the gist is the report's own figures, opponent by opponent
        suite = saved["suites"][o.opponent]
        assert o.games == suite["games"] == 2
        assert o.mean_centres == suite["hero_mean_sc"] == saved["summary"][f"eval/{o.opponent}/mean_sc"]
        assert list(o.centres_ci95) == suite["hero_centres"]["ci95"]
        assert o.solo_rate == suite["hero_solo_rate"]
        assert o.centres_ci95[0] <= o.mean_centres <= o.centres_ci95[1]
    history = evaluator.history()
    assert [h["tag"] for h in history] == ["step-10"] and history[0]["policy"] == "main@v3"


def test_the_hero_is_not_its_own_opponent_and_pins_survive_a_restart(tmp_path: Path) -> None:
    config = EvaluatorConfig(pool=["bot:random", "bot:hold"], plots=False, play=TWO_GAMES)
    first = Evaluator(config, tmp_path)
    assert first.pin("bot:dumbbot") == ["bot:random", "bot:hold", "bot:dumbbot"]
    again = Evaluator(config, tmp_path)
    assert again.pool() == ["bot:random", "bot:hold", "bot:dumbbot"]
    result = again.evaluate("bot:hold", "t0")  # bots only: no client needed
    assert [o.opponent for o in result.opponents] == ["bot:random", "bot:dumbbot"]


def test_the_driver_logs_the_typed_result(tmp_path: Path) -> None:
    from diprl.run.config import EvalScheduleConfig
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters

    class Tracker:
        def __init__(self) -> None:
            self.lines: list[tuple[str, dict[str, Any], str]] = []

        def log(self, kind: str, values: dict[str, Any], policy: str) -> None:
            self.lines.append((kind, values, policy))

    tracker, counters = Tracker(), Counters()
    schedule = EvalSchedule(None, EvalScheduleConfig(), Journal(tmp_path, tracker, RunStats()), counters)
    result = EvaluationResult("step4", "main@v2", "r.json", (OpponentResult("bot:random", 14, 6.5, (5.0, 8.0), 0.25),))
    schedule.record(result, "main@v2", 4)
    assert counters.evaluations == 1 and schedule.last == {"bot:random": 6.5} and schedule.last_version == "main@v2"
    ((kind, values, policy),) = tracker.lines
    assert (kind, policy) == ("eval", "main")
    assert values == {
        "step": 4,
        "version": "main@v2",
        "opponents": "bot:random",
        "eval/games": 14,
        "eval/hero_mean_sc": 6.5,
        "eval/hero_mean_sc_lo": 5.0,
        "eval/hero_mean_sc_hi": 8.0,
        "eval/hero_solo_rate": 0.25,
        "eval/report": "r.json",
    }


def test_the_training_runs_evaluation_overrides_reach_the_evaluator() -> None:
    from diprl.run.config import compose_config

    overrides = ["evaluation.games=7", "evaluation.max_year=1902", "evaluation.temperature=0.5"]
    config, _ = compose_config([*overrides, "evaluation.sampling_seed=3", "evaluation.opponents=[bot:hold]"])
    evaluator = EvaluatorConfig(pool=list(config.evaluation.opponents), play=config.evaluation)
    assert evaluator.play == GamesConfig(games=7, max_year=1902, seed=12345, temperature=0.5, sampling_seed=3)
    assert type(evaluator.play) is GamesConfig  # the schedule's own keys stay behind


@pytest.mark.parametrize(
    ("override", "message"), [("evaluation.max_year=1800", "max_year"), ("evaluation.replays=15", "replays")]
)
def test_bad_evaluation_games_are_clear_errors(override: str, message: str) -> None:
    from diprl.run.config import ConfigError, compose_config

    with pytest.raises(ConfigError, match=message):
        compose_config([override])


@pytest.mark.parametrize("tag", ["", "../x", "a/b", "x" * 200])
def test_bad_tags_are_refused(tmp_path: Path, tag: str) -> None:
    evaluator = Evaluator(EvaluatorConfig(pool=["bot:random"], play=TWO_GAMES), tmp_path)
    with pytest.raises(ValueError, match="tag"):
        evaluator.evaluate("bot:hold", tag)


def test_bad_pools_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown bot"):
        EvaluatorConfig(pool=["bot:nobody"])
    with pytest.raises(ValueError, match="empty"):
        EvaluatorConfig(pool=[])


@pytest.mark.slow
def test_the_named_actor_evaluates_on_a_local_ray_cluster(tmp_path: Path) -> None:
    import ray

    from diprl.raysession import connect

    connect(address="local", num_cpus=2)
    try:
        play = GamesConfig(games=1, max_year=1901)
        config = EvaluatorConfig(pool=["bot:random"], client="uniform", plots=False, play=play)
        handle = start_evaluator(config, tmp_path)  # the caller keeps the handle: the actor lives with it
        actor = ray.get_actor("evaluator")
        result: EvaluationResult = ray.get(actor.evaluate.remote("base", "smoke"), timeout=300)
        assert [(o.opponent, o.games) for o in result.opponents] == [("bot:random", 1)]
        report = json.loads(Path(result.report).read_text())
        assert report["suites"]["bot:random"]["llm"]["hero_requests"] > 0
        again = start_evaluator(config, tmp_path)  # the running actor is returned, not a second one
        assert again._actor_id == handle._actor_id
    finally:
        ray.shutdown()
