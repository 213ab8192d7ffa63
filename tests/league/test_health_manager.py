"""The LeagueManager's health record (`LeagueManager.health`), rollback decisions and their persistence (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import MainRoleConfig
from diprl.league.health import HealthConfig

from .helpers import hero_loses, hero_wins

ONLY_ANCHORS = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=1.0)


def league(tmp_path: Path, **kw: object) -> LeagueManager:
    manager = LeagueManager(LeagueConfig(**kw), tmp_path)  # type: ignore[arg-type]
    for policy in manager.config.roles:
        manager.register_version(policy, f"{policy}@v1", 0)
    return manager


def test_health_from_the_first_matches_leaves_out_what_was_not_played(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:random", "bot:dumbbot", "base"], main=ONLY_ANCHORS, decay=1.0)
    for _ in range(12):
        match = manager.next_match("main")
        opponent = next(str(ref) for p, ref in match.seats.items() if p != match.hero)
        if opponent != "base":
            manager.report(hero_wins(match) if opponent == "bot:random" else hero_loses(match))
    record = manager.health()
    json.dumps(record)  # one metrics.jsonl line
    assert "base" in record["league/nash_left_out"] and "base" not in record["league/nash"]
    assert set(record["league/nash"]) == {"main", "bot:random", "bot:dumbbot"} - set(record["league/nash_left_out"])
    assert record["league/nash_left_out_count"] == len(record["league/nash_left_out"])
    assert {f"league/rating/{m}" for m in ("main", "bot:random", "bot:dumbbot", "base")} <= set(record)
    assert record["league/exploiters_beat_main"] == 0 and "league/exploitability_lb" not in record
    assert record["league/rpp"] == pytest.approx(-0.5)  # main beats Random, loses every game to DumbBot
    summary = manager.summary()["health"]
    assert "base" in summary["nash"]["left_out"]


def test_a_winning_exploiter_bounds_main_and_a_timed_out_one_is_recorded(tmp_path: Path) -> None:
    manager = league(tmp_path, roles=["main", "main_exploiter"], snapshot_steps=10, decay=1.0)
    for _ in range(12):
        manager.report(hero_wins(manager.next_match("main_exploiter")))
    record = manager.health()
    assert record["league/exploitability_target"] == "main@v1"
    assert record["league/exploitability_lb"] > 0.0  # 12 of 12: Wilson lower bound 0.76
    assert record["league/exploitability"]["main@v1"]["exploiter"] == "main_exploiter#0"
    assert manager.register_version("main_exploiter", "main_exploiter@v2", 10).snapshot  # beat main: frozen, reset
    manager.register_version("main_exploiter", "main_exploiter@v3", 11)  # the fresh adapter
    for _ in range(6):
        manager.report(hero_loses(manager.next_match("main_exploiter")))
    decision = manager.register_version("main_exploiter", "main_exploiter@v4", 31)  # 2N steps: timed out
    assert decision.snapshot and decision.win_rate < 0.7
    record = manager.health()
    assert record["league/exploiters_beat_main"] == 1 and record["league/exploiters_timed_out"] == 1
    closed = manager.summary()["health"]["exploiters"]
    assert [(c["exploiter"], c["beaten"]) for c in closed] == [("main_exploiter#0", True), ("main_exploiter#1", False)]
    # the lower bound is the maximum over exploiters: the losing one does not lower it
    assert record["league/exploitability"]["main@v1"]["exploiter"] == "main_exploiter#0"
    again = LeagueManager(manager.config, tmp_path).health()  # persisted
    assert again["league/exploitability"] == record["league/exploitability"]


def test_games_against_main_versions_count_for_the_snapshot_that_follows(tmp_path: Path) -> None:
    manager = league(tmp_path, roles=["main", "main_exploiter"], snapshot_steps=2, decay=1.0)
    manager.report(hero_wins(manager.next_match("main_exploiter")))
    manager.register_version("main", "main@v2", 1)
    manager.report(hero_wins(manager.next_match("main_exploiter")))
    assert manager.register_version("main", "main@v3", 4).snapshot  # 2N steps: main@v3 is frozen
    manager.register_version("main", "main@v4", 5)
    manager.report(hero_wins(manager.next_match("main_exploiter")))
    bounds = manager.health()["league/exploitability"]
    assert {t: b["games"] for t, b in bounds.items()} == {"main@v3": 2.0, "main@v4": 1.0}


def test_each_snapshot_enters_with_its_rating_once(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS, snapshot_steps=2)
    for _ in range(3):
        manager.report(hero_wins(manager.next_match("main")))
    assert manager.register_version("main", "main@v2", 4).snapshot
    entries = manager.health()["league/snapshot_entries"]
    assert [e["member"] for e in entries] == ["main@v2"] and entries[0]["step"] == 4
    assert entries[0]["rating"] == pytest.approx(manager.health()["league/rating/main@v2"])
    assert "league/snapshot_entries" not in manager.health()  # logged once
    assert [e["member"] for e in manager.summary()["health"]["entries"]] == ["main@v2"]


def test_a_collapse_decides_one_rollback_that_survives_a_restart(tmp_path: Path) -> None:
    manager = league(tmp_path, health=HealthConfig(rollback=True))
    first = manager.observe_evaluation("main@v1", 0, 4.0, 3.6, 4.4, {"support_rate": 0.1})
    assert first == {"best": "main@v1", "became_best": True, "faults": [], "rollback": None}
    manager.register_version("main", "main@v5", 40)
    collapsed = {"support_rate": 0.0056, "void_support_rate": 0.87}
    answer = manager.observe_evaluation("main@v5", 40, 3.9, 3.5, 4.3, collapsed)
    assert [f["guard"] for f in answer["faults"]] == ["support_rate", "void_support_rate"]
    assert answer["rollback"] == {
        "policy": "main",
        "current": "main@v5",
        "to": "main@v1",
        "step": 40,
        "guards": ["support_rate", "void_support_rate"],
    }
    assert manager.observe_evaluation("main@v5", 40, 3.9, 3.5, 4.3, collapsed)["rollback"] == answer["rollback"]
    assert "main@v1" in manager.refs_in_use()  # the best version's weights must survive pruning
    restarted = LeagueManager(manager.config, tmp_path)
    assert restarted.pending_rollback("main") == answer["rollback"]
    health = restarted.health()
    assert health["league/rollback_pending"] == answer["rollback"]
    assert (health["league/rollbacks"], health["league/rollbacks_done"], health["league/best_version_number"]) == (
        1,
        0,
        1,
    )
    assert [e["event"] for e in restarted.summary()["health"]["events"]] == ["rollback"]  # exactly once
    restarted.rollback_done("main", "main@v6")
    restarted.rollback_done("main", "main@v6")  # a retried call
    again = LeagueManager(manager.config, tmp_path)
    assert again.pending_rollback("main") is None
    assert [e["event"] for e in again.summary()["health"]["events"]] == ["rollback", "rollback_done"]
    assert (again.health()["league/rollbacks"], again.health()["league/rollbacks_done"]) == (1, 1)


def test_a_collapsed_version_that_scores_best_never_becomes_the_best(tmp_path: Path) -> None:
    manager = league(tmp_path, health=HealthConfig(rollback=True))
    manager.observe_evaluation("main@v1", 0, 4.0, 3.6, 4.4, {"support_rate": 0.1})
    manager.register_version("main", "main@v5", 40)
    # It outscores v1 (a collapsed main can, against bots, for a while) and supports in none of its orders.
    answer = manager.observe_evaluation("main@v5", 40, 6.0, 5.5, 6.5, {"support_rate": 0.0})
    assert answer["best"] == "main@v1" and answer["became_best"] is False
    assert answer["rollback"] is not None and answer["rollback"]["to"] == "main@v1"
    # A healthy version that is surely better does become the best.
    manager.register_version("main", "main@v9", 80)
    answer = manager.observe_evaluation("main@v9", 80, 6.0, 5.5, 6.5, {"support_rate": 0.1})
    assert answer["best"] == "main@v9" and answer["became_best"] is True and answer["rollback"] is None


def test_without_rollback_configured_guards_only_report(tmp_path: Path) -> None:
    manager = league(tmp_path)
    manager.observe_evaluation("main@v1", 0, 4.0, 3.6, 4.4)
    answer = manager.observe_evaluation("main@v1", 0, 4.0, 3.6, 4.4, {"hold_rate": 0.99})
    assert [f["guard"] for f in answer["faults"]] == ["hold_rate"] and answer["rollback"] is None
    assert manager.pending_rollback() is None


def test_main_snapshots_are_pinned_on_the_rule_and_the_pool_stays_frozen(tmp_path: Path) -> None:
    """Main's 1st snapshot and every 2nd after it, at most 2: v2 and v4; exploiters' snapshots never."""
    manager = league(
        tmp_path, roles=["main", "main_exploiter"], snapshot_steps=1, health=HealthConfig(pin_every=2, pin_max=2)
    )
    assert manager.eval_pins() == [] and "league/eval_pinned" not in manager.health()
    for n in range(2, 8):
        assert manager.register_version("main", f"main@v{n}", 2 * n).snapshot  # 2N steps after the last: always
        manager.register_version("main_exploiter", f"main_exploiter@v{n}", 2 * n)
    assert manager.snapshots(["main"]) == [f"main@v{n}" for n in range(2, 8)]
    assert manager.snapshots(["main_exploiter"])  # snapshots of its own, none of them pinned
    assert manager.eval_pins() == ["main@v2", "main@v4"]  # full at 2: v6 is not pinned
    assert manager.health()["league/eval_pinned"] == ["main@v2", "main@v4"]
    again = LeagueManager(manager.config, tmp_path)  # persisted
    assert again.eval_pins() == ["main@v2", "main@v4"]
    assert again.summary()["health"]["eval_pinned"] == ["main@v2", "main@v4"]
    again.refuse_version("main@v4", "canary mismatch")  # cannot be played: not handed to the evaluator
    assert again.eval_pins() == ["main@v2"]
    off = league(tmp_path / "off", snapshot_steps=1, health=HealthConfig(pin_every=0))
    assert off.register_version("main", "main@v2", 2).snapshot and off.eval_pins() == []
