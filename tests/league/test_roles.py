"""The role table drives the manager (a new role is one row), and which seats of a match train."""

from __future__ import annotations

from pathlib import Path

import pytest

from diprl.league import LeagueConfig, LeagueManager
from diprl.league.config import MainRoleConfig
from diprl.league.matchmaking import ANCHORS, OPPONENT_SEATS, Pick
from diprl.league.members import POWERS
from diprl.league.roles import ROLE_TABLE, Role, exploiter_roles, trained_seats
from diprl.messages import seat_texts

from .helpers import hero_wins

A, E, F, G, I, R, T = POWERS  # noqa: E741 (the initials of the seven powers)
SELF_PLAY = MainRoleConfig(self_play=1.0, pfsp=0.0, verification=0.0, anchors=0.0)
PFSP_ONLY = MainRoleConfig(self_play=0.0, pfsp=1.0, verification=0.0, anchors=0.0)


def league(tmp_path: Path, **kw: object) -> LeagueManager:
    manager = LeagueManager(LeagueConfig(**kw), tmp_path)  # type: ignore[arg-type]
    for policy in manager.config.roles:
        manager.register_version(policy, f"{policy}@v1", 0)
    return manager


# ------------------------------------------------------------------------------- trained seats, by hand
def test_a_self_play_match_trains_all_seven_seats_hero_first() -> None:
    members = dict.fromkeys(POWERS, "main")  # main@v3 in every seat
    assert trained_seats(F, members, {"main"}, "learners") == (F, A, E, G, I, R, T)
    assert trained_seats(F, members, {"main"}, "hero") == (F,)


def test_an_exploiter_match_trains_the_hero_and_mains_three_seats() -> None:
    # main_exploiter@v2 against main's current version in three seats, a snapshot of main, a bot and base
    members = {A: "main_exploiter", E: "main", F: "main", G: "main", I: "main@v4", R: "bot:dumbbot", T: "base"}
    learners = {"main", "main_exploiter"}
    assert trained_seats(A, members, learners, "learners") == (A, E, F, G)
    assert trained_seats(A, members, learners, "hero") == (A,)


def test_a_pfsp_match_against_snapshots_trains_the_hero_only() -> None:
    # main@v4 is both main's current version and a snapshot taken of it: the snapshot's seats are frozen.
    members = dict.fromkeys(POWERS, "main@v4") | {R: "main"}
    assert trained_seats(R, members, {"main"}, "learners") == (R,)


def test_a_bot_hero_trains_nothing_of_its_own() -> None:
    members = dict.fromkeys(POWERS, "main") | {E: "bot:dumbbot"}
    assert trained_seats(E, members, {"main"}, "hero") == ()
    assert trained_seats(E, members, {"main"}, "learners") == (A, F, G, I, R, T)
    with pytest.raises(ValueError, match=r"\('hero', 'learners'\)"):
        trained_seats(E, members, {"main"}, "all")


# ------------------------------------------------------------------------------ trained seats, by the league
def test_the_league_fills_match_train_from_its_members(tmp_path: Path) -> None:
    selfplay = league(tmp_path / "a", main=SELF_PLAY)
    match = selfplay.next_match("main")
    assert match.train == (match.hero, *(p for p in POWERS if p != match.hero))

    hero_only = league(tmp_path / "b", main=SELF_PLAY, train_seats="hero")
    match = hero_only.next_match("main")
    assert match.train == (match.hero,)

    exploiter = league(tmp_path / "c", roles=["main", "main_exploiter"])
    match = exploiter.next_match("main_exploiter")
    assert str(match.seats[match.hero]) == "main_exploiter@v1" and len(match.train) == 7  # the hero + main's six

    anchors = league(tmp_path / "d", anchors=["bot:dumbbot"], main=MainRoleConfig(anchors=1.0))
    match = anchors.next_match("main")
    assert set(seat_texts(match.seats).values()) == {"main@v1", "bot:dumbbot"} and match.train == (match.hero,)


def test_a_pfsp_match_against_a_snapshot_of_the_current_version_trains_the_hero_only(tmp_path: Path) -> None:
    manager = league(tmp_path, anchors=[], main=PFSP_ONLY, snapshot_steps=1)
    assert manager.register_version("main", "main@v2", 2).snapshot  # the pool is main@v2 alone
    match = manager.next_match("main")
    assert set(seat_texts(match.seats).values()) == {"main@v2"}  # seven equal refs, but six seats are the snapshot
    assert match.train == (match.hero,)
    manager.register_version("main", "main@v3", 3)
    match = manager.next_match("main")
    assert str(match.seats[match.hero]) == "main@v3" and match.train == (match.hero,)


def test_train_seats_is_validated() -> None:
    with pytest.raises(ValueError, match="train_seats"):
        LeagueConfig(train_seats="all")


# ------------------------------------------------------------------------------------------ role table
def test_the_table_holds_alphastars_three_roles() -> None:
    assert list(ROLE_TABLE) == ["main", "main_exploiter", "league_exploiter"]
    assert all(name == role.name for name, role in ROLE_TABLE.items())
    assert exploiter_roles() == ("main_exploiter", "league_exploiter")
    assert ROLE_TABLE["main_exploiter"].requires == ("main",)
    config = LeagueConfig()
    assert [ROLE_TABLE[r].reset_probability(config) for r in ROLE_TABLE] == [0.0, 1.0, 0.25]


def test_a_new_role_is_one_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A "sparring" role that plays only the anchors, snapshots on beating them and always resets."""
    sparring = Role(
        "sparring",
        plays="only the anchors",
        pick=lambda league, policy: Pick(ANCHORS, (league.anchors()[0],) * OPPONENT_SEATS),
        snapshot_opponents=lambda league, policy: league.anchors(),
        reset_probability=lambda cfg: 1.0,
        requires=("main",),
    )
    monkeypatch.setitem(ROLE_TABLE, "sparring", sparring)
    with pytest.raises(ValueError, match=r"sparring plays only the anchors, so it needs \['main'\]"):
        LeagueConfig(roles=["sparring"])
    manager = league(tmp_path, roles=["main", "sparring"], anchors=["bot:dumbbot"], snapshot_steps=10)
    for _ in range(3):
        match = manager.next_match("sparring")
        assert set(seat_texts(match.seats).values()) == {"sparring@v1", "bot:dumbbot"} and match.train == (match.hero,)
        manager.report(hero_wins(match))
    decision = manager.register_version("sparring", "sparring@v2", 10)
    assert decision.snapshot and decision.reset and decision.win_rate == 1.0
    counts = manager.summary()["matches"]["sparring"]
    assert counts == {"self_play": 0, "pfsp": 0, "verification": 0, "anchor": 3, "main": 0}
