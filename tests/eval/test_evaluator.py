"""The training run's evaluator: the suite against a frozen pool, results under run_dir/eval, pins kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diprl.eval.evaluator import Evaluator, EvaluatorConfig, start_evaluator

from .conftest import RecordingClient


def test_evaluate_writes_a_report_per_opponent_and_a_metrics_line(tmp_path: Path) -> None:
    client = RecordingClient()
    evaluator = Evaluator(
        EvaluatorConfig(pool=["bot:random", "base"], plots=False, games=2, max_year=1901), tmp_path, client
    )
    result = evaluator.evaluate("main@v3", "step-10")
    assert result["pool"] == ["bot:random", "base"]
    assert set(result["suites"]) == {"bot:random", "base"}
    # Both suites ran in one lockstep run: the first batch holds main@v3's and base's seats of all 4 games.
    first = client.calls[0]
    assert {r.policy for r in first} == {"main@v3", "base"}
    assert sum(r.policy == "main@v3" for r in first) == 4
    saved = json.loads((tmp_path / "eval" / "step-10" / "report.json").read_text())
    assert saved["summary"]["eval/bot:random/mean_sc"] == result["suites"]["bot:random"]["hero_mean_sc"]
    history = evaluator.history()
    assert [h["tag"] for h in history] == ["step-10"] and history[0]["policy"] == "main@v3"


def test_the_hero_is_not_its_own_opponent_and_pins_survive_a_restart(tmp_path: Path) -> None:
    config = EvaluatorConfig(pool=["bot:random", "bot:hold"], plots=False, games=2, max_year=1901)
    first = Evaluator(config, tmp_path)
    assert first.pin("bot:dumbbot") == ["bot:random", "bot:hold", "bot:dumbbot"]
    again = Evaluator(config, tmp_path)
    assert again.pool() == ["bot:random", "bot:hold", "bot:dumbbot"]
    result = again.evaluate("bot:hold", "t0")  # bots only: no client needed
    assert result["pool"] == ["bot:random", "bot:dumbbot"]


@pytest.mark.parametrize("tag", ["", "../x", "a/b", "x" * 200])
def test_bad_tags_are_refused(tmp_path: Path, tag: str) -> None:
    evaluator = Evaluator(EvaluatorConfig(pool=["bot:random"], games=2, max_year=1901), tmp_path)
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
        config = EvaluatorConfig(pool=["bot:random"], client="uniform", plots=False, games=1, max_year=1901)
        handle = start_evaluator(config, tmp_path)  # the caller keeps the handle: the actor lives with it
        actor = ray.get_actor("evaluator")
        result: Any = ray.get(actor.evaluate.remote("base", "smoke"), timeout=300)
        assert result["suites"]["bot:random"]["llm"]["hero_requests"] > 0
        assert (tmp_path / "eval" / "smoke" / "report.json").is_file()
        again = start_evaluator(config, tmp_path)  # the running actor is returned, not a second one
        assert again._actor_id == handle._actor_id
    finally:
        ray.shutdown()
