"""Typed role state in the league's state file: round trip, a schema-1 file from before, and clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from diprl.league import LeagueConfig, LeagueManager
from diprl.league.members import POWERS
from diprl.league.persist import STATE_FILE, load_state, save_state
from diprl.league.role_state import STATE_VERSION, LeagueStateError, RoleState, VersionDecision
from diprl.messages import Match, PolicyRef, seat_texts

from .helpers import hero_wins

DATA = Path(__file__).parent / "data"
V1_CONFIG = LeagueConfig(
    roles=["main", "main_exploiter", "league_exploiter"], snapshot_steps=2, anchors=["bot:dumbbot", "base"]
)


def test_role_state_round_trips() -> None:
    state = RoleState("main@v3", 4, True, 2, 1, 9, ["ITALY", "FRANCE"], VersionDecision(True, True, "main@v3", 4, 0.75))
    assert RoleState.from_dict(json.loads(json.dumps(state.to_dict())), "main") == state
    assert RoleState.from_dict(RoleState().to_dict()) == RoleState()


def test_a_state_file_from_before_the_typed_roles_loads_and_continues(tmp_path: Path) -> None:
    """`data/state_v1.json` was written by the league before RoleState (schema 1): three roles, two snapshots,
    a reset awaited, one match handed out and unreported. `.expected.json` holds what that league then
    reported and handed out next."""
    (tmp_path / "league").mkdir()
    shutil.copy(DATA / "state_v1.json", tmp_path / "league" / STATE_FILE)
    expected = json.loads((DATA / "state_v1.expected.json").read_text())
    manager = LeagueManager(V1_CONFIG, tmp_path)
    assert load_state(tmp_path / "league")["version"] == STATE_VERSION  # rewritten in the new schema
    summary = json.loads(json.dumps(manager.summary()))
    health = summary.pop("health")  # added after that league: starts empty, with no exploiter games
    refused, serving = summary.pop("canary_refused"), summary.pop("serving")  # added later still: none refused
    assert refused == {} and serving == summary["current"]
    assert summary == expected["summary"]
    assert health["exploiters"] == [] and health["events"] == [] and health["best"] is None
    assert manager.pending_reset("main_exploiter")
    assert manager.register_version("main", "main@v2", 4) == VersionDecision(True, False, "main@v2", 4, 0.5)
    nxt = [manager.next_match(p) for p in V1_CONFIG.roles for _ in range(2)]
    assert [[m.match_id, seat_texts(m.seats), m.hero, m.seed] for m in nxt] == expected["next"]
    before = manager.summary()["reported"]["matches"]
    # handed out before the upgrade, unreported
    handed_out = Match("main-3", dict.fromkeys(POWERS, PolicyRef.parse("main@v2")), "TURKEY", 0)
    manager.report(hero_wins(handed_out))
    assert manager.summary()["reported"]["matches"] == before + 1


def test_another_schema_or_a_malformed_role_is_refused_with_what_to_do(tmp_path: Path) -> None:
    manager = LeagueManager(LeagueConfig(), tmp_path)
    state = manager.state()
    save_state(tmp_path / "league", state | {"version": 99})
    with pytest.raises(LeagueStateError, match=r"schema 99 .*move that directory aside to start a fresh league"):
        LeagueManager(LeagueConfig(), tmp_path)
    broken = state | {"roles": {"main": {k: v for k, v in state["roles"]["main"].items() if k != "hero_cycle"}}}
    save_state(tmp_path / "league", broken)
    with pytest.raises(LeagueStateError, match="role 'main' must have the keys"):
        LeagueManager(LeagueConfig(), tmp_path)
    save_state(tmp_path / "league", state | {"roles": {"main": state["roles"]["main"] | {"matches": "many"}}})
    with pytest.raises(LeagueStateError, match="role 'main' is malformed"):
        LeagueManager(LeagueConfig(), tmp_path)
