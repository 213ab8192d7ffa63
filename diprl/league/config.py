"""Typed configuration of the league (Hydra group `league`, `conf/league/<name>.yaml`).

Which trained roles exist is configuration: the `pfsp` preset trains `main` alone, `league` adds a
main exploiter and a league exploiter (what each role does: `diprl.league.roles.ROLE_TABLE`). Every
share and probability is range-checked on construction, so a typo'd value fails when the config is
loaded, not hours into a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diprl.league.health import HealthConfig
from diprl.messages import PolicyRef
from diprl.structured_config import load_structured

SEAT_MODES = ("one", "each")
MAIN_WEIGHTINGS = ("hard", "variance", "linear_capped", "nash")


def _positive_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def _unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"league.{name} must be in [0, 1], got {value}")


@dataclass
class MainRoleConfig:
    """The main agent: AlphaStar's mix, plus games reserved for the anchors so nothing is forgotten.

    A share `anchors` of matches is set aside first (one anchor, drawn uniformly); the rest follows
    the mix self_play : pfsp : verification, which must sum to 1. `anchors: 1.0` plays only the anchors
    (a fixed curriculum, e.g. DumbBot alone).
    """

    self_play: float = 0.35  # current main in every seat
    pfsp: float = 0.50  # PFSP over the pool (anchors and every snapshot)
    verification: float = 0.15  # past exploiters it loses to, own snapshots it struggles with
    anchors: float = 0.10  # reserved share against the anchors (bots, base)
    weighting: str = "hard"  # PFSP weighting of the pool: hard | variance | linear_capped | nash
    exploiter_win_rate: float = 0.3  # verify against exploiter snapshots main beats less often than this
    forgetting_win_rate: float = 0.7  # ... and against own snapshots main beats less often than this

    def __post_init__(self) -> None:
        for name in ("self_play", "pfsp", "verification", "anchors", "exploiter_win_rate", "forgetting_win_rate"):
            _unit(f"main.{name}", getattr(self, name))
        if abs(self.self_play + self.pfsp + self.verification - 1.0) > 1e-6:
            raise ValueError(
                "league.main.self_play + pfsp + verification must sum to 1, got "
                f"{self.self_play} + {self.pfsp} + {self.verification}"
            )
        if self.weighting not in MAIN_WEIGHTINGS:
            raise ValueError(f"league.main.weighting must be one of {MAIN_WEIGHTINGS}, got {self.weighting!r}")


@dataclass
class MainExploiterConfig:
    """Plays only the current main; snapshot (and reset to a fresh adapter) once it beats main or times out."""

    reset_probability: float = 1.0  # after each of its snapshots (AlphaStar: always)

    def __post_init__(self) -> None:
        _unit("main_exploiter.reset_probability", self.reset_probability)


@dataclass
class LeagueExploiterConfig:
    """Plays the whole pool with PFSP; after a snapshot it is reset with some probability."""

    weighting: str = "linear_capped"
    reset_probability: float = 0.25

    def __post_init__(self) -> None:
        _unit("league_exploiter.reset_probability", self.reset_probability)
        if self.weighting not in MAIN_WEIGHTINGS:
            raise ValueError(
                f"league.league_exploiter.weighting must be one of {MAIN_WEIGHTINGS}, got {self.weighting!r}"
            )


@dataclass
class LeagueConfig:
    """Everything the LeagueManager decides with: roles, anchors, mixes, payoff, PFSP, snapshots, seed."""

    roles: list[str] = field(default_factory=lambda: ["main"])
    anchors: list[str] = field(default_factory=lambda: ["bot:random", "bot:dumbbot", "base"])
    seats: str = "one"  # a PFSP/anchor match: one opponent in all six seats ("one") or one draw per seat ("each")
    decay: float = 0.99  # every update of a pair multiplies its counts by this
    min_games: float = 1.0  # a pair reads 0.5 until it has this many (decayed) games
    pfsp_p: float = 2.0  # exponent of the "hard" weighting (1 - x)^p
    snapshot_steps: int = 50  # N: no snapshot before N learner steps since the last, always at 2N
    snapshot_win_rate: float = 0.7  # between N and 2N: snapshot once the role's opponents are beaten this often
    main: MainRoleConfig = field(default_factory=MainRoleConfig)
    main_exploiter: MainExploiterConfig = field(default_factory=MainExploiterConfig)
    league_exploiter: LeagueExploiterConfig = field(default_factory=LeagueExploiterConfig)
    max_pending: int = 10_000  # matches handed out and not yet reported that the manager remembers
    # Which seats of a match train (`Match.train`): "learners" = the hero and every seat the league filled
    # with a learner's current version (self-play seats, main's seats in an exploiter's match); "hero" = the
    # hero alone. Snapshots, base and bots are never trained.
    train_seats: str = "learners"
    # How often each role is the hero of a new match, relative to the others (a role left out weighs 1):
    # the rollouts' matches go to the roles in these proportions, interleaved. An exploiter's match trains
    # one seat of its own (and main's seats in it), main's self-play match seven, so equal turns leave the
    # exploiters a seventh of main's groups; `conf/league/league.yaml` gives them more of the matches.
    match_weights: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    health: HealthConfig = field(default_factory=HealthConfig)  # what the league reports about its health

    def __post_init__(self) -> None:
        from diprl.league.roles import ROLE_TABLE, TRAIN_SEAT_MODES

        known = tuple(ROLE_TABLE)
        if not self.roles:
            raise ValueError(f"league.roles must name at least one trained role of {known}")
        unknown = [r for r in self.roles if r not in ROLE_TABLE]
        if unknown or len(set(self.roles)) != len(self.roles):
            raise ValueError(f"league.roles must be distinct names from {known}, got {list(self.roles)}")
        for name in self.roles:
            role = ROLE_TABLE[name]
            missing = [r for r in role.requires if r not in self.roles]
            if missing:
                raise ValueError(f"league.roles: {name} plays {role.plays}, so it needs {missing} too")
        if not self.anchors and "main" in self.roles and self.main.anchors > 0:
            raise ValueError("league.anchors is empty but league.main.anchors reserves a share of games for them")
        from diprl.league.members import validate_anchor

        for ref in self.anchors:
            validate_anchor(ref)
            if PolicyRef.parse(ref).policy in self.roles:
                raise ValueError(
                    f"league.anchors: {ref!r} is a version of a trained role; a frozen anchor is another policy's "
                    "(a role's own snapshots join the pool by themselves)"
                )
        if len(set(self.anchors)) != len(self.anchors):
            raise ValueError(f"league.anchors has duplicates: {list(self.anchors)}")
        if self.seats not in SEAT_MODES:
            raise ValueError(f"league.seats must be one of {SEAT_MODES}, got {self.seats!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"league.decay must be in (0, 1], got {self.decay}")
        if self.min_games < 0.0:
            raise ValueError(f"league.min_games must be >= 0, got {self.min_games}")
        if self.pfsp_p <= 0.0:
            raise ValueError(f"league.pfsp_p must be positive, got {self.pfsp_p}")
        if self.snapshot_steps < 1:
            raise ValueError(f"league.snapshot_steps must be >= 1, got {self.snapshot_steps}")
        _unit("snapshot_win_rate", self.snapshot_win_rate)
        if self.train_seats not in TRAIN_SEAT_MODES:
            raise ValueError(f"league.train_seats must be one of {TRAIN_SEAT_MODES}, got {self.train_seats!r}")
        if self.max_pending < 1:
            raise ValueError(f"league.max_pending must be >= 1, got {self.max_pending}")
        strangers = [r for r in self.match_weights if r not in self.roles]
        if strangers:
            raise ValueError(
                f"league.match_weights names {strangers}, which are not in league.roles {list(self.roles)}"
            )
        bad = {r: w for r, w in self.match_weights.items() if not _positive_finite(w)}
        if bad:
            raise ValueError(f"league.match_weights must be positive finite numbers, got {bad}")


def register_configs() -> None:
    """Register the `base_league` schema (group `league`) that `conf/league/*.yaml` extend."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="league", name="base_league", node=LeagueConfig)


def load_league_config(name: str, conf_dir: Path | None = None) -> LeagueConfig:
    """Read `conf/league/<name>.yaml` into a validated `LeagueConfig` (typos and wrong types fail)."""
    return load_structured(LeagueConfig, "league", name, conf_dir)
