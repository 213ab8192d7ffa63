"""LeagueManager: matches, reports, snapshots, resets, persistence and errors (no Ray)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import LeagueExploiterConfig, MainRoleConfig
from diprl.league.members import POWERS
from diprl.league.persist import PREVIOUS_FILE, STATE_FILE, CorruptLeagueState
from diprl.league.role_state import VersionDecision
from diprl.messages import BASE_REF, PolicyRef, UnknownPolicyRef, seat_texts

from .helpers import hero_loses, hero_wins, results_for

ONLY_ANCHORS = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=1.0)


def league(tmp_path: Path, **kw: object) -> LeagueManager:
    manager = LeagueManager(LeagueConfig(**kw), tmp_path)  # type: ignore[arg-type]
    for policy in manager.config.roles:
        manager.register_version(policy, f"{policy}@v1", 0)
    return manager


def test_hero_power_is_stratified_and_seats_hold_refs(tmp_path: Path) -> None:
    manager = league(tmp_path)
    matches = [manager.next_match("main") for _ in range(21)]
    assert Counter(m.hero for m in matches) == dict.fromkeys(POWERS, 3)
    for m in matches:
        assert str(m.seats[m.hero]) == "main@v1" and m.trains
        assert set(seat_texts(m.seats).values()) <= {"main@v1", "bot:random", "bot:dumbbot", "base"}
    assert len({m.match_id for m in matches}) == 21


def test_forks_weigh_one_over_g_in_the_payoff(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS, decay=1.0)
    match = manager.next_match("main")
    win, lose = hero_wins(match, forks=2)[0], hero_loses(match, forks=2)[1]
    manager.report([win, lose])
    payoff = manager.summary()["payoff"]
    i, j = payoff["members"].index("main"), payoff["members"].index("bot:dumbbot")
    assert payoff["games"][i][j] == pytest.approx(1.0)  # two forks, one game
    assert payoff["win_rate"][i][j] == pytest.approx(0.5)
    assert payoff["win_rate"][j][i] == pytest.approx(0.5)
    manager.report([win, lose])  # Ray retried the call: counted once
    assert manager.summary()["reported"] == {"matches": 1, "results": 2, "ignored": 1}


def test_a_match_is_reported_with_all_its_forks_and_one_g(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS)
    match = manager.next_match("main")
    first, second = hero_wins(match, forks=2)
    with pytest.raises(ValueError, match="1 of its G=2 forks reported"):
        manager.report([first])
    with pytest.raises(ValueError, match="forks disagree on G"):
        manager.report([first, replace(second, forks=3)])
    with pytest.raises(ValueError, match="fork 2 is not one of its G=2 forks"):
        manager.report([first, replace(second, fork=2)])
    with pytest.raises(ValueError, match="positive int"):
        manager.report([replace(first, forks=0)])
    assert manager.summary()["reported"] == {"matches": 0, "results": 0, "ignored": 0}  # nothing counted
    manager.report([second, first])
    assert manager.summary()["reported"] == {"matches": 1, "results": 2, "ignored": 0}


def test_snapshot_rule_through_the_manager(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS, snapshot_steps=10)
    assert manager.register_version("main", "main@v2", 9).snapshot is False  # < N
    answer = manager.register_version("main", "main@v3", 10)
    assert answer.snapshot is False and answer.win_rate == 0.5  # N reached, nothing beaten yet
    for _ in range(3):
        manager.report(hero_wins(manager.next_match("main")))
    answer = manager.register_version("main", "main@v4", 11)
    assert replace(answer, steps_since_snapshot=11) == VersionDecision(
        snapshot=True, reset=False, member="main@v4", steps_since_snapshot=11, win_rate=1.0
    )
    assert manager.register_version("main", "main@v4", 11) == answer  # a retried call: same answer
    assert manager.register_version("main", "main@v5", 30).snapshot is False  # 19 steps since the last
    assert manager.register_version("main", "main@v6", 31).snapshot is True  # 2N since the last one
    pool = {m["member"]: m["kind"] for m in manager.summary()["pool"]}
    assert pool == {"bot:dumbbot": "anchor", "main": "learner", "main@v4": "snapshot", "main@v6": "snapshot"}
    with pytest.raises(ValueError, match="not newer"):
        manager.register_version("main", "main@v2", 40)


def test_main_exploiter_resets_when_it_beats_main_and_on_timeout(tmp_path: Path) -> None:
    manager = league(tmp_path, roles=["main", "main_exploiter"], snapshot_steps=10)
    match = manager.next_match("main_exploiter")
    assert set(seat_texts(match.seats).values()) == {"main@v1", "main_exploiter@v1"}
    assert str(match.seats[match.hero]) == "main_exploiter@v1"
    for _ in range(3):
        manager.report(hero_wins(manager.next_match("main_exploiter")))
    answer = manager.register_version("main_exploiter", "main_exploiter@v2", 10)
    assert answer.snapshot and answer.reset and answer.win_rate == 1.0
    summary = manager.summary()
    assert summary["resets"]["main_exploiter"] == 1
    i = summary["payoff"]["members"].index("main_exploiter")
    assert sum(summary["payoff"]["games"][i]) == 0.0  # a fresh adapter starts with no statistics
    # the driver reset the learner and registers the fresh version: the snapshot clock restarts there
    assert manager.register_version("main_exploiter", "main_exploiter@v3", 3).snapshot is False
    assert manager.register_version("main_exploiter", "main_exploiter@v4", 12).snapshot is False
    answer = manager.register_version("main_exploiter", "main_exploiter@v5", 23)  # losing, but 2N passed
    assert answer.snapshot and answer.reset and answer.win_rate == 0.5


@pytest.mark.parametrize(("probability", "snapshots", "resets"), [(0.0, 5, 0), (1.0, 3, 3)])
def test_league_exploiter_resets_with_its_probability(
    tmp_path: Path, probability: float, snapshots: int, resets: int
) -> None:
    manager = league(
        tmp_path,
        roles=["league_exploiter"],
        snapshot_steps=1,
        league_exploiter=LeagueExploiterConfig(reset_probability=probability),
    )
    answers = [manager.register_version("league_exploiter", f"league_exploiter@v{v}", 2 * v) for v in range(2, 7)]
    # after a reset the next registration is the fresh adapter: its step starts the clock, no snapshot
    assert sum(a.snapshot for a in answers) == snapshots
    assert sum(a.reset for a in answers) == resets == manager.summary()["resets"]["league_exploiter"]


def test_reset_drops_unreported_matches_of_the_old_adapter(tmp_path: Path) -> None:
    manager = league(tmp_path, roles=["main", "main_exploiter"], snapshot_steps=1)
    stale = manager.next_match("main_exploiter")
    assert manager.register_version("main_exploiter", "main_exploiter@v2", 2).reset
    manager.report(hero_wins(stale))
    assert manager.summary()["reported"]["ignored"] == 1


def test_restart_restores_everything_and_continues_the_same_stream(tmp_path: Path) -> None:
    config = LeagueConfig(roles=["main", "league_exploiter"], snapshot_steps=1)
    manager = league(tmp_path, roles=["main", "league_exploiter"], snapshot_steps=1)
    for _ in range(5):
        manager.report(hero_wins(manager.next_match("main")))
    manager.register_version("main", "main@v2", 5)
    pending = manager.next_match("main")
    before = manager.summary()
    restarted = LeagueManager(config, tmp_path)  # the process died here; a new one reads run_dir/league/
    assert restarted.summary() == before
    assert [restarted.next_match("league_exploiter") for _ in range(3)] == [
        manager.next_match("league_exploiter") for _ in range(3)
    ]  # same RNG, counters and hero cycles: the same matches
    restarted.report(hero_wins(pending))  # a match handed out before the restart is still recognised
    assert restarted.summary()["reported"]["matches"] == 6


def test_corrupt_state_falls_back_to_the_previous_good_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = league(tmp_path)
    manager.report(hero_wins(manager.next_match("main")))
    good = json.loads((tmp_path / "league" / STATE_FILE).read_text())
    manager.next_match("main")  # one more change: state.prev.json now holds `good`
    (tmp_path / "league" / STATE_FILE).write_text('{"format": "diprl-league/1", "sha256": "00", "state": "{}"}')
    with caplog.at_level(logging.ERROR, logger="diprl.league.persist"):
        restored = LeagueManager(LeagueConfig(), tmp_path)
    assert "checksum mismatch" in caplog.text
    assert restored.summary()["reported"]["matches"] == 1
    assert restored.state()["roles"]["main"]["matches"] == json.loads(good["state"])["roles"]["main"]["matches"]
    (tmp_path / "league" / STATE_FILE).write_text("{truncated")
    (tmp_path / "league" / PREVIOUS_FILE).write_text("")
    with pytest.raises(CorruptLeagueState, match="no readable league state"):
        LeagueManager(LeagueConfig(), tmp_path)


def test_a_deeply_nested_state_falls_back_to_the_previous_good_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review (N5): a state file nested deeply (its checksum made to match) escaped the league's
    restore as a `RecursionError` instead of being refused for the previous good copy."""
    import hashlib

    manager = league(tmp_path)
    manager.report(hero_wins(manager.next_match("main")))
    manager.next_match("main")  # state.prev.json now holds the state after the report
    payload = '{"roles": ' + "[" * 100_000 + "]" * 100_000 + "}"
    blob = {"format": "diprl-league/1", "sha256": hashlib.sha256(payload.encode()).hexdigest(), "state": payload}
    (tmp_path / "league" / STATE_FILE).write_text(json.dumps(blob))
    with caplog.at_level(logging.ERROR, logger="diprl.league.persist"):
        restored = LeagueManager(LeagueConfig(), tmp_path)
    assert "nested" in caplog.text
    assert restored.summary()["reported"]["matches"] == 1


def test_unknown_refs_and_bad_options_are_clear_errors(tmp_path: Path) -> None:
    manager = league(tmp_path)
    with pytest.raises(UnknownPolicyRef, match="not a trained role"):
        manager.next_match("main_exploiter")
    with pytest.raises(UnknownPolicyRef, match="invalid adapter name"):
        manager.register_version("main", "main@v0", 1)
    with pytest.raises(UnknownPolicyRef, match="does not belong"):
        manager.register_version("main", "other@v2", 1)
    match = manager.next_match("main")
    result = results_for(match, lambda p, ref: 3)[0]
    stranger = replace(result, match_id="elsewhere-1", seats=dict.fromkeys(POWERS, PolicyRef.parse("bot:hold")))
    with pytest.raises(UnknownPolicyRef, match="not an anchor"):
        manager.report([stranger])
    with pytest.raises(TypeError, match="MatchResult objects, got dict"):
        manager.report([{"match_id": "x"}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="seven powers"):
        manager.report([replace(result, centres={"AUSTRIA": 3})])
    with pytest.raises(ValueError, match="differ"):
        manager.report([replace(result, seats=dict.fromkeys(POWERS, BASE_REF))])
    for bad in (
        {"roles": ["main", "coach"]},
        {"roles": ["main_exploiter"]},
        {"anchors": ["bot:nobody"]},
        {"anchors": ["main@v1"]},
        {"seats": "all"},
        {"decay": 1.5},
        {"snapshot_steps": 0},
    ):
        with pytest.raises(ValueError):
            LeagueConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sum to 1"):
        MainRoleConfig(self_play=0.5)
    with pytest.raises(ValueError, match="weighting"):
        MainRoleConfig(weighting="elo")
    with pytest.raises(RuntimeError, match="register_version"):
        LeagueManager(LeagueConfig(roles=["main"]), tmp_path / "fresh").next_match("main")


def test_nash_weights_come_from_measured_payoffs_only(tmp_path: Path) -> None:
    """Main beats Random 9 in 10 and loses to DumbBot 9 in 10; no bot ever met another, `base` met nobody.

    Over the 0.5-filled table the equilibrium was a third each for Random, DumbBot and `base`. Over what
    was measured ({main, DumbBot} once Random, whose pair with DumbBot is unplayed, is left out), DumbBot
    beats main: all the weight is DumbBot's, and members never measured get none.
    """
    manager = league(tmp_path, anchors=["bot:random", "bot:dumbbot", "base"])
    keys = set(manager.members)
    main = next(k for k in keys if k.startswith("main"))
    for i in range(10):
        manager.payoff.update(main, "bot:random", 0.0 if i == 0 else 1.0)
        manager.payoff.update(main, "bot:dumbbot", 1.0 if i == 0 else 0.0)
    nash = manager.summary()["nash"]
    assert set(nash) == keys
    assert nash["bot:dumbbot"] == pytest.approx(1.0, abs=1e-6)
    assert nash["base"] == 0.0 and nash["bot:random"] == 0.0 and nash[main] == pytest.approx(0.0, abs=1e-6)


def test_summary_shape(tmp_path: Path) -> None:
    manager = league(tmp_path, roles=["main", "main_exploiter", "league_exploiter"])
    for policy in ("main", "main_exploiter", "league_exploiter"):
        for _ in range(3):
            manager.report(hero_wins(manager.next_match(policy)))
    summary = manager.summary()
    keys = summary["payoff"]["members"]
    assert len(keys) == 6 and len(summary["payoff"]["win_rate"]) == 6
    assert sum(summary["nash"].values()) == pytest.approx(1.0)
    assert set(summary["ratings"]) == set(keys)
    assert summary["matches"]["main_exploiter"]["main"] == 3
    assert summary["current"] == {p: f"{p}@v1" for p in ("main", "main_exploiter", "league_exploiter")}
    assert {m["kind"] for m in summary["pool"]} == {"anchor", "learner"}
    json.dumps(summary)  # plain data: goes into league_summary.json as it is


def test_self_play_matches_are_reported_whatever_the_hero_power(tmp_path: Path) -> None:
    """Every seat of a self-play match is `main`: the hero power handed out identifies the hero."""
    manager = league(tmp_path, main=MainRoleConfig(self_play=1.0, pfsp=0.0, verification=0.0, anchors=0.0))
    matches = [manager.next_match("main") for _ in range(7)]
    assert {m.hero for m in matches} == set(POWERS)
    for match in matches:
        assert set(seat_texts(match.seats).values()) == {"main@v1"}
        manager.report(hero_wins(match))
    assert manager.summary()["reported"]["matches"] == 7


def test_rating_of_a_ref_matches_the_summary_without_solving_nash(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS)
    for _ in range(3):
        manager.report(hero_wins(manager.next_match("main")))
    rows = {row["ref"]: row["rating"] for row in manager.summary()["pool"] if row["ref"]}
    assert manager.rating("main@v1") == pytest.approx(rows["main@v1"])
    assert manager.rating("bot:dumbbot") == pytest.approx(rows["bot:dumbbot"])
    assert manager.rating("main@v1") > manager.rating("bot:dumbbot")  # main won every match
    assert manager.rating("main@v9") is None


def test_a_resumed_learner_registers_its_current_version_again_and_versions_only_move_forward(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS, snapshot_steps=1)
    answer = manager.register_version("main", "main@v2", 10)
    assert answer.snapshot and answer.member == "main@v2"
    # A resume whose learner checkpointed exactly this version registers it again at its own step.
    assert manager.register_version("main", "main@v2", 9) == answer
    # A learner restored from an older checkpoint publishes its weights anew (v3); v2 stays a snapshot.
    manager.register_version("main", "main@v3", 8)
    assert manager.current("main") == "main@v3" and "main@v2" in [m["member"] for m in manager.summary()["pool"]]
    with pytest.raises(ValueError, match="under a new number"):
        manager.register_version("main", "main@v2", 8)


def test_a_reset_the_learner_never_made_is_pending_after_a_restart(tmp_path: Path) -> None:
    config = LeagueConfig(roles=["main", "main_exploiter"], snapshot_steps=1)
    manager = league(tmp_path, roles=["main", "main_exploiter"], snapshot_steps=1)
    assert not manager.pending_reset("main_exploiter")
    assert manager.register_version("main_exploiter", "main_exploiter@v2", 2).reset
    assert LeagueManager(config, tmp_path).pending_reset("main_exploiter")  # the driver died before reset()
    manager.register_version("main_exploiter", "main_exploiter@v3", 2)  # the reset's version arrived
    assert not LeagueManager(config, tmp_path).pending_reset("main_exploiter")


def test_refs_in_use_are_what_the_adapter_store_must_keep(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=["bot:dumbbot"], main=ONLY_ANCHORS, snapshot_steps=100)
    in_flight = manager.next_match("main")  # handed out while main@v1 is current, not yet reported
    manager.register_version("main", "main@v2", 1)
    manager.register_version("main", "main@v3", 2)
    assert manager.refs_in_use() == ["bot:dumbbot", "main@v1", "main@v3"]  # v2: nothing holds it
    manager.report(hero_wins(in_flight))
    assert manager.refs_in_use() == ["bot:dumbbot", "main@v1", "main@v3"]  # v1: the fallback while none is proven
    for _ in range(3):
        manager.report(hero_wins(manager.next_match("main")))
    assert manager.register_version("main", "main@v4", 200).snapshot is True
    manager.register_version("main", "main@v5", 201)
    manager.prove_version("main@v3")  # a replica's canary passed: the fallback now
    assert manager.refs_in_use() == ["bot:dumbbot", "main@v3", "main@v4", "main@v5"]  # v4 stays: a pool snapshot
