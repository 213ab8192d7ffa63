"""The run's W&B identity: one per run directory, kept across resumes, never shared by two runs."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.tracking import Tracker


@pytest.fixture
def wandb_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A stand-in `wandb` module that records each `init`'s arguments (nothing is written or sent)."""
    calls: list[dict[str, Any]] = []
    fake = SimpleNamespace(
        init=lambda **kwargs: calls.append(kwargs) or SimpleNamespace(log=lambda *a: None, finish=lambda: None),
        Settings=lambda **kwargs: kwargs,
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return calls


def _start(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    Tracker(run_dir, {"experiment": "smoke"}, use_wandb=True).close()


def test_two_runs_whose_directories_share_a_name_get_their_own_wandb_run(
    tmp_path: Path, wandb_runs: list[dict[str, Any]]
) -> None:
    """Found by review (L5): the W&B run id was the run directory's name, so two runs named alike (on two
    machines, or under two runs directories) resumed into one W&B run and mixed their curves."""
    _start(tmp_path / "a" / "smoke-20261201-101500")
    _start(tmp_path / "b" / "smoke-20261201-101500")
    _start(tmp_path / "a" / "smoke-20261201-101500")  # a resume of the first
    first, second, resumed = (call["id"] for call in wandb_runs)
    assert first != second
    assert resumed == first and wandb_runs[2]["resume"] == "allow"
    assert all(call["name"] == "smoke-20261201-101500" for call in wandb_runs)  # the name people read stays
    assert first.startswith("smoke-20261201-101500-")


def test_a_log_gets_each_learner_step_once_and_a_forced_line_only_when_new(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from diprl import tracking

    clock = [100.0]
    monkeypatch.setattr(tracking.time, "monotonic", lambda: clock[0])
    out = io.StringIO()  # not a terminal: a log file
    line = tracking.ProgressLine(every_s=10.0, stream=out)
    for t, step in [(0, 0), (11, 0), (30, 0), (31, 1), (35, 2), (50, 2), (61, 3)]:
        clock[0] = 100.0 + t
        line.update({"step": step, "reward": 0.5})
    line.update({"step": 3, "reward": 0.5}, force=True)  # the same text: not again
    line.update({"step": 3, "reward": 0.5, "eval_sc": 4.0}, force=True)  # the final evaluation: new
    assert [row.split("  ")[0] for row in out.getvalue().splitlines()] == [
        "step 0",
        "step 1",
        "step 2",
        "step 3",
        "step 3",
    ]
    assert out.getvalue().splitlines()[-1].endswith("eval_sc 4")


def test_an_evaluation_per_opponent_is_its_own_series(tmp_path: Path, wandb_runs: list[dict[str, Any]]) -> None:
    """Random's and DumbBot's evaluation of one version are two series in the gauges and in W&B, not one."""
    from diprl.tracking import TAGGED_BY_OPPONENTS

    logged: list[dict[str, float]] = []
    sets: list[tuple[str, float, dict[str, str]]] = []
    tracker = Tracker(tmp_path, {"experiment": "smoke"}, use_wandb=True)
    tracker._wandb = SimpleNamespace(log=logged.append, finish=lambda: None)
    tracker._gauges = {
        key: SimpleNamespace(set=lambda value, tags, key=key: sets.append((key, value, tags)))
        for key in ("eval/hero_mean_sc", "learner/step")
    }
    for opponents, centres in (("bot:random", 9.5), ("bot:dumbbot", 3.5)):
        tracker.log("eval", {"step": 4, "opponents": opponents, "eval/hero_mean_sc": centres})
    tracker.log("learner", {"learner/step": 4})
    tracker.close()
    assert sets == [
        ("eval/hero_mean_sc", 9.5, {"policy": "main", "opponents": "bot:random"}),
        ("eval/hero_mean_sc", 3.5, {"policy": "main", "opponents": "bot:dumbbot"}),
        ("learner/step", 4.0, {"policy": "main"}),
    ]
    assert logged[0]["main/eval/hero_mean_sc[bot:random]"] == 9.5
    assert logged[1]["main/eval/hero_mean_sc[bot:dumbbot]"] == 3.5
    assert "eval/hero_mean_sc" in TAGGED_BY_OPPONENTS


def test_rollout_health_reaches_the_dashboard_and_each_stage_is_a_series_of_one_gauge(tmp_path: Path) -> None:
    """Bad completions, tied groups and per-stage seconds were dropped before any gauge saw them."""
    from diprl.messages import MATCH_STAGES
    from diprl.tracking import RAY_GAUGES, STAGE_GAUGE, gauge_tags

    assert {"rollout/bad_completion_rate", "rollout/zero_variance_rate"} <= set(RAY_GAUGES)
    assert gauge_tags("rollout/engine_s", "main", "") == {"policy": "main", "stage": "engine"}
    assert gauge_tags("rollout/bad_completion_rate", "main", "") == {"policy": "main"}
    sets: list[tuple[str, float, dict[str, str]]] = []
    tracker = Tracker(tmp_path, {}, use_wandb=False)
    stage = SimpleNamespace(set=lambda value, tags: sets.append((STAGE_GAUGE, value, tags)))
    tracker._gauges = {f"rollout/{s}_s": stage for s in MATCH_STAGES}
    tracker.log("rollout", {"rollout/play_s": 3.0, "rollout/bots_s": 0.5})
    tracker.close()
    assert sets == [
        (STAGE_GAUGE, 3.0, {"policy": "main", "stage": "play"}),
        (STAGE_GAUGE, 0.5, {"policy": "main", "stage": "bots"}),
    ]


def test_the_league_health_figures_reach_the_dashboard(tmp_path: Path) -> None:
    """Exploitability, Nash, RPP, best version and rollbacks were in metrics.jsonl and W&B but no gauge."""
    from diprl.league import LeagueConfig, LeagueManager
    from diprl.league.health import HealthConfig
    from diprl.tracking import RAY_GAUGES
    from tests.league.helpers import hero_loses, hero_wins

    config = LeagueConfig(roles=["main", "main_exploiter"], anchors=["bot:dumbbot"], health=HealthConfig(rollback=True))
    manager = LeagueManager(config, tmp_path / "league-run")
    for policy in ("main", "main_exploiter"):
        manager.register_version(policy, f"{policy}@v1", 0)
    for _ in range(12):  # an exploiter that always wins: a lower bound above 0 on main@v1's exploitability
        manager.report(hero_wins(manager.next_match("main_exploiter")))
    for _ in range(20):
        match = manager.next_match("main")
        manager.report(
            hero_wins(match) if "bot:dumbbot" in {str(r) for r in match.seats.values()} else hero_loses(match)
        )
    manager.observe_evaluation("main@v1", 0, 4.0, 3.6, 4.4)
    manager.register_version("main", "main@v2", 1)
    manager.observe_evaluation("main@v2", 1, 3.0, 2.6, 3.4, {"hold_rate": 1.0})  # a collapse: one rollback
    record = manager.health()
    health_gauges = {k for k in RAY_GAUGES if k.startswith("league/") and k != "league/rating"}
    issue_36 = {"exploitability_lb", "exploitability_lb_max", "nash_entropy", "nash_support", "nash_main", "rpp"}
    issue_36 |= {"best_version_number", "best_score", "rollbacks"}
    assert {f"league/{name}" for name in issue_36} <= health_gauges
    assert health_gauges <= set(record), health_gauges - set(record)
    sets: list[tuple[str, float, dict[str, str]]] = []
    tracker = Tracker(tmp_path, {}, use_wandb=False)
    tracker._gauges = {
        key: SimpleNamespace(set=lambda value, tags, key=key: sets.append((key, value, tags))) for key in RAY_GAUGES
    }
    tracker.log("league", {"step": 1} | record)
    tracker.close()
    exported = {key: value for key, value, tags in sets if tags == {"policy": "main"}}
    assert set(exported) == health_gauges
    assert exported["league/exploitability_lb"] > 0.0 and exported["league/rollbacks"] == 1.0
    assert exported["league/best_version_number"] == 1.0
