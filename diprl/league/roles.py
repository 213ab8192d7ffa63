"""What each trained role of the league does, as one table (AlphaStar's main agent and its two exploiters).

A role is a trained policy with its own learner; its name is the policy's name. A row says who the role
plays (its matchmaking mix, a function of the league as it stands), whose win rates decide its snapshots,
how likely a reset to a fresh adapter is after each snapshot, and what it needs beside it. The manager
holds no role names: it asks the row. Adding a role is one row here (plus its config section, if it
has options).

Which seats of a match train is decided here too (`trained_seats`): the hero, and with `learners`
every other seat the league filled with a learner's current version.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from diprl.league.matchmaking import Pick, league_exploiter_pick, main_exploiter_pick, main_pick

if TYPE_CHECKING:
    import numpy as np

    from diprl.league.config import LeagueConfig

MAIN = "main"
MAIN_EXPLOITER = "main_exploiter"
LEAGUE_EXPLOITER = "league_exploiter"
TRAIN_SEAT_MODES = ("hero", "learners")


class LeagueView(Protocol):
    """What a role's rules read of the league (the `LeagueManager` provides it)."""

    config: LeagueConfig
    rng: np.random.Generator

    def anchors(self) -> list[str]: ...

    def pool(self) -> list[str]:
        """Anchors and every snapshot: the frozen members."""
        ...

    def snapshots(self, roles: Sequence[str] | None = None) -> list[str]: ...

    def win_rate(self, member: str, opponent: str) -> float: ...

    def nash(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class Role:
    """One row of the role table (see the module doc)."""

    name: str
    plays: str  # who it plays, in words (for errors and docs)
    pick: Callable[[LeagueView, str], Pick]  # its matchmaking mix: the six opponents of its next match
    snapshot_opponents: Callable[[LeagueView, str], list[str]]  # the snapshot rule reads the lowest win rate
    reset_probability: Callable[[LeagueConfig], float]  # of a reset to a fresh adapter after each snapshot
    exploiter: bool = False  # its snapshots are the past exploiters main verifies against
    requires: tuple[str, ...] = ()  # roles that must be trained beside it


def _main_pick(league: LeagueView, policy: str) -> Pick:
    cfg = league.config
    return main_pick(
        league.rng,
        cfg.main,
        hero=policy,
        anchors=league.anchors(),
        pool=league.pool(),
        exploiter_snapshots=league.snapshots(exploiter_roles()),
        own_snapshots=league.snapshots((policy,)),
        win_rate=lambda member: league.win_rate(policy, member),
        seats=cfg.seats,
        p=cfg.pfsp_p,
        nash=league.nash() if cfg.main.weighting == "nash" else None,
    )


def _league_exploiter_pick(league: LeagueView, policy: str) -> Pick:
    cfg = league.config
    return league_exploiter_pick(
        league.rng,
        hero=policy,
        pool=league.pool(),
        win_rate=lambda member: league.win_rate(policy, member),
        weighting=cfg.league_exploiter.weighting,
        seats=cfg.seats,
        p=cfg.pfsp_p,
        nash=league.nash() if cfg.league_exploiter.weighting == "nash" else None,
    )


ROLE_TABLE: dict[str, Role] = {
    r.name: r
    for r in (
        Role(
            MAIN,
            plays="a reserved share of anchors, then self-play, PFSP over the pool and verification",
            pick=_main_pick,
            # Mastered its own past selves (or, with none yet, the pool): freeze it.
            snapshot_opponents=lambda league, policy: league.snapshots((policy,)) or league.pool(),
            reset_probability=lambda cfg: 0.0,
        ),
        Role(
            MAIN_EXPLOITER,
            plays="only the current main agent, in all six seats",
            pick=lambda league, policy: main_exploiter_pick(MAIN),
            snapshot_opponents=lambda league, policy: [MAIN],
            reset_probability=lambda cfg: cfg.main_exploiter.reset_probability,
            exploiter=True,
            requires=(MAIN,),
        ),
        Role(
            LEAGUE_EXPLOITER,
            plays="PFSP over the whole pool (anchors and every snapshot)",
            pick=_league_exploiter_pick,
            snapshot_opponents=lambda league, policy: league.pool(),
            reset_probability=lambda cfg: cfg.league_exploiter.reset_probability,
            exploiter=True,
        ),
    )
}


def exploiter_roles() -> tuple[str, ...]:
    return tuple(name for name, role in ROLE_TABLE.items() if role.exploiter)


def trained_seats(hero: str, members: Mapping[str, str], learners: Collection[str], mode: str) -> tuple[str, ...]:
    """The powers whose decisions become groups for their policy's learner (`Match.train`), hero first.

    `members` names the member in each power's seat, `learners` the learning members (a learner's
    seat plays its current version). A seat trains when a learner fills it: the hero, and with
    `mode="learners"` every other such seat (self-play seats; `main`'s seats in an exploiter's match
    train `main`). Snapshots, `base` and bots are played, never trained: a snapshot of the current
    version plays the same weights but is frozen, and a hero that is not a learner (a bot) trains nothing.
    """
    if mode not in TRAIN_SEAT_MODES:
        raise ValueError(f"train seats must be one of {TRAIN_SEAT_MODES}, got {mode!r}")
    candidates = [hero] if mode == "hero" else [hero, *(p for p in sorted(members) if p != hero)]
    return tuple(p for p in candidates if members[p] in learners)
