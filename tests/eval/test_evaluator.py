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


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"pinned": ' + "[" * 100_000 + "]" * 100_000 + "}", "nest"),
        ('{"pinned": "main@v1"}', "list of PolicyRefs"),
        ("not json", "not"),
    ],
)
def test_a_forged_or_broken_pool_file_is_a_clear_error(tmp_path: Path, text: str, why: str) -> None:
    """Found by review: `eval/pool.json` was loaded without limits, so a deeply nested one escaped as a
    RecursionError from the evaluator's start. It is read with the run files' limits and named when bad."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "pool.json").write_text(text)
    with pytest.raises(ValueError, match=why) as caught:
        Evaluator(EvaluatorConfig(pool=["bot:random"], plots=False, play=TWO_GAMES), tmp_path)
    assert "pool.json" in str(caught.value)


def test_the_hero_is_not_its_own_opponent_and_pins_survive_a_restart(tmp_path: Path) -> None:
    config = EvaluatorConfig(pool=["bot:random", "bot:hold"], plots=False, play=TWO_GAMES)
    first = Evaluator(config, tmp_path)
    assert first.pin("bot:dumbbot") == ["bot:random", "bot:hold", "bot:dumbbot"]
    again = Evaluator(config, tmp_path)
    assert again.pool() == ["bot:random", "bot:hold", "bot:dumbbot"]
    result = again.evaluate("bot:hold", "t0")  # bots only: no client needed
    assert [o.opponent for o in result.opponents] == ["bot:random", "bot:dumbbot"]


class Tracker:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any], str]] = []

    def log(self, kind: str, values: dict[str, Any], policy: str) -> None:
        self.lines.append((kind, values, policy))


def _schedule(tmp_path: Path, evaluator: Any, **config: Any) -> tuple[Any, Tracker, Any]:
    from diprl.run.config import EvalScheduleConfig
    from diprl.run.evaluations import EvalSchedule
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.run.rundir import Counters

    tracker, counters = Tracker(), Counters()
    journal = Journal(tmp_path, tracker, RunStats())
    return EvalSchedule(evaluator, EvalScheduleConfig(**config), journal, counters), tracker, counters


def test_the_driver_logs_the_typed_result(tmp_path: Path) -> None:
    schedule, tracker, counters = _schedule(tmp_path, None)
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


class FlakyEvaluator:
    """`evaluate.remote` hands out refs; the first `failures` of them fail when waited for, as a call does
    whose PolicyServer replica was killed under it."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[str, str]] = []
        self.evaluate = self

    def remote(self, version: str, tag: str) -> tuple[int, str, str]:
        self.calls.append((version, tag))
        return (len(self.calls), version, tag)

    def get(self, ref: tuple[int, str, str]) -> EvaluationResult:
        number, version, tag = ref
        if number <= self.failures:
            raise RuntimeError("ActorDiedError: the replica died")
        return EvaluationResult(tag, version, "r.json", (OpponentResult("bot:random", 7, 5.0, (4.0, 6.0), 0.0),))


@pytest.mark.parametrize("failures", [1, 2, 3])
def test_an_evaluation_killed_under_it_runs_again_before_the_next_and_its_version_stays_protected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failures: int
) -> None:
    import ray

    evaluator = FlakyEvaluator(failures)
    monkeypatch.setattr(ray, "get", evaluator.get)
    schedule, tracker, counters = _schedule(tmp_path, evaluator, every_steps=2, retries=2)
    schedule.start("main@v1", 0)
    schedule.on_step("main@v3", 2)  # the next evaluation waits behind the step-0 one and its retries
    for _ in range(5):
        schedule.fill(stopping=False)
        if not schedule.running:
            break
        (ref,) = schedule.refs()
        schedule.handle(ref)
        if counters.evaluations == 0 and ref[0] <= 2:
            assert "main@v1" in schedule.protected()  # pruning keeps a version whose evaluation runs again
    faults = [v for kind, v, _ in tracker.lines if kind == "fault"]
    assert [(f["evaluation"], f["step"], f["attempt"]) for f in faults] == [("main@v1", 0, a) for a in range(failures)]
    evals = [(v["version"], v["step"]) for kind, v, _ in tracker.lines if kind == "eval"]
    if failures <= 2:  # within retries: the "before" of the run is measured after all, and first
        assert evaluator.calls[: failures + 1] == [("main@v1", "step0")] * (failures + 1)
        assert evals == [("main@v1", 0), ("main@v3", 2)]
    else:  # out of retries: on record as three faults, and the run goes on to the next evaluation
        assert evals == [("main@v3", 2)]
    assert counters.evaluations == len(evals) and not schedule.waiting


def test_the_final_evaluation_runs_again_when_its_call_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    evaluator = FlakyEvaluator(failures=1)
    monkeypatch.setattr(ray, "get", evaluator.get)
    schedule, tracker, _ = _schedule(tmp_path, evaluator, retries=1)
    schedule.final("main@v9", 30)
    assert evaluator.calls == [("main@v9", "step30")] * 2
    assert [v["version"] for kind, v, _ in tracker.lines if kind == "eval"] == ["main@v9"]
    with pytest.raises(ValueError, match="retries"):
        _schedule(tmp_path, evaluator, retries=-1)


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


def test_a_slow_evaluator_measures_the_newest_version_and_never_drops_the_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evaluations due faster than the evaluator plays them replace the one still waiting, not queue up."""
    import ray

    evaluator = FlakyEvaluator(failures=0)
    monkeypatch.setattr(ray, "get", evaluator.get)
    schedule, tracker, _ = _schedule(tmp_path, evaluator, every_steps=10)
    schedule.start("main@v1", 0)
    schedule.fill(stopping=False)  # the "before" runs
    schedule.on_step("main@v11", 10)
    schedule.on_step("main@v21", 20)  # replaces v11, still waiting
    schedule.on_step("main@v45", 45)  # replaces v21; one step past two due points is one evaluation
    assert schedule.waiting == [("main@v45", 45, 0)] and schedule.next_step == 50
    while schedule.refs() or schedule.waiting:
        schedule.fill(stopping=False)
        for ref in schedule.refs():
            schedule.handle(ref)
    evals = [(v["version"], v.get("eval/superseded")) for kind, v, _ in tracker.lines if kind == "eval"]
    assert evals == [("main@v1", None), ("main@v45", ["main@v11", "main@v21"])]
    assert evaluator.calls == [("main@v1", "step0"), ("main@v45", "step45")]


def test_the_before_evaluation_is_never_replaced(tmp_path: Path) -> None:
    schedule, _, _ = _schedule(tmp_path, None, every_steps=10)
    schedule.start("main@v5", 4)  # a resumed run starting at step 4, with no evaluation yet
    schedule.on_step("main@v11", 10)
    schedule.on_step("main@v21", 20)
    assert schedule.waiting == [("main@v5", 4, 0), ("main@v21", 20, 0)]


@pytest.mark.parametrize("at_end", [True, False])
def test_once_the_budget_is_spent_the_final_evaluation_supersedes_the_waiting_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at_end: bool
) -> None:
    """A budget-bounded run does not start an older version's evaluation after its training ends: the final
    one measures a newer version and names the one it replaced. Without a final evaluation the waiting one
    still runs."""
    import ray

    evaluator = FlakyEvaluator(failures=0)
    monkeypatch.setattr(ray, "get", evaluator.get)
    schedule, tracker, _ = _schedule(tmp_path, evaluator, every_steps=10, at_end=at_end)
    schedule.start("main@v1", 0)
    schedule.fill(stopping=False, spent=True)  # the "before" still runs, spent budget or not
    (ref,) = schedule.refs()
    schedule.handle(ref)
    schedule.on_step("main@v11", 10)
    schedule.fill(stopping=False, spent=True)
    for ref in schedule.refs():
        schedule.handle(ref)
    schedule.final("main@v14", 14)
    evals = [(v["version"], v.get("eval/superseded")) for kind, v, _ in tracker.lines if kind == "eval"]
    if at_end:
        assert evals == [("main@v1", None), ("main@v14", ["main@v11"])]
    else:
        assert evals == [("main@v1", None), ("main@v11", None)]
    assert not schedule.waiting
