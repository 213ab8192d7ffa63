"""Who the six other seats are, per trained role (AlphaStar's league roles, as pure functions).

- main agent: a reserved share against the anchors (one drawn uniformly) so it never forgets how to
  beat bots and the base model; the rest 35% self-play (current main in every seat), 50% PFSP over
  the pool (anchors and every snapshot), 15% verification: past exploiters it still loses to, then
  own snapshots it no longer reliably beats (AlphaStar's exploitation and forgetting checks).
  Verification with nobody to verify against falls back to PFSP.
- main exploiter: only the current main, in all six seats.
- league exploiter: PFSP over the whole pool.
A PFSP or anchor draw fills the six seats with one member (`seats="one"`: a clean 1-vs-member game)
or draws each seat independently (`seats="each"`: mixed tables). An empty pool falls back to self-play.

Members are keys (see `members.py`); the manager turns them into PolicyRefs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from diprl.league.config import MainRoleConfig
from diprl.league.pfsp import normalise, pfsp_probabilities

SELF_PLAY = "self_play"
PFSP = "pfsp"
VERIFICATION = "verification"
ANCHORS = "anchor"
VS_MAIN = "main"
KINDS = (SELF_PLAY, PFSP, VERIFICATION, ANCHORS, VS_MAIN)
OPPONENT_SEATS = 6


@dataclass(frozen=True)
class Pick:
    """One matchmaking decision: its kind (for the per-kind counts) and the six opponent members."""

    kind: str
    opponents: tuple[str, ...]


def pool_probabilities(
    candidates: Sequence[str],
    win_rate: Callable[[str], float],
    weighting: str,
    p: float = 2.0,
    nash: Mapping[str, float] | None = None,
) -> np.ndarray:
    """Sampling distribution over `candidates`: PFSP on the hero's win rates, or the Nash mixture."""
    if weighting == "nash":
        if nash is None:
            raise ValueError("the 'nash' weighting needs the league's Nash weights")
        return normalise([max(0.0, nash.get(c, 0.0)) for c in candidates])
    return pfsp_probabilities([win_rate(c) for c in candidates], weighting, p)


def fill_seats(
    rng: np.random.Generator, candidates: Sequence[str], probs: np.ndarray, mode: str, n: int = OPPONENT_SEATS
) -> tuple[str, ...]:
    """Six opponents: one draw in every seat (`one`) or one draw per seat (`each`)."""
    if not candidates:
        raise ValueError("no candidates to fill the seats with")
    if mode == "one":
        return (candidates[int(rng.choice(len(candidates), p=probs))],) * n
    if mode == "each":
        return tuple(candidates[int(i)] for i in rng.choice(len(candidates), size=n, p=probs))
    raise ValueError(f"unknown seat mode {mode!r}; use 'one' or 'each'")


def _pfsp_pick(
    rng: np.random.Generator,
    hero: str,
    pool: Sequence[str],
    win_rate: Callable[[str], float],
    weighting: str,
    p: float,
    seats: str,
    nash: Mapping[str, float] | None,
    kind: str = PFSP,
) -> Pick:
    if not pool:
        return Pick(SELF_PLAY, (hero,) * OPPONENT_SEATS)
    return Pick(kind, fill_seats(rng, pool, pool_probabilities(pool, win_rate, weighting, p, nash), seats))


def main_pick(
    rng: np.random.Generator,
    config: MainRoleConfig,
    *,
    hero: str,
    anchors: Sequence[str],
    pool: Sequence[str],
    exploiter_snapshots: Sequence[str],
    own_snapshots: Sequence[str],
    win_rate: Callable[[str], float],
    seats: str = "one",
    p: float = 2.0,
    nash: Mapping[str, float] | None = None,
) -> Pick:
    """The main agent's next opponents (see module doc); `win_rate(m)` is main's win rate against m."""
    if anchors and rng.random() < config.anchors:
        uniform = np.full(len(anchors), 1.0 / len(anchors))
        return Pick(ANCHORS, fill_seats(rng, anchors, uniform, seats))
    u = rng.random()
    if u < config.self_play:
        return Pick(SELF_PLAY, (hero,) * OPPONENT_SEATS)
    if u < config.self_play + config.pfsp:
        return _pfsp_pick(rng, hero, pool, win_rate, config.weighting, p, seats, nash)
    hard = [m for m in exploiter_snapshots if win_rate(m) < config.exploiter_win_rate]
    if not hard:
        hard = [m for m in own_snapshots if win_rate(m) < config.forgetting_win_rate]
    if hard:
        probs = pfsp_probabilities([win_rate(m) for m in hard], "hard", p)
        return Pick(VERIFICATION, fill_seats(rng, hard, probs, "one"))
    return _pfsp_pick(rng, hero, pool, win_rate, config.weighting, p, seats, nash)


def main_exploiter_pick(main: str) -> Pick:
    """The main exploiter plays only the current main agent."""
    return Pick(VS_MAIN, (main,) * OPPONENT_SEATS)


def league_exploiter_pick(
    rng: np.random.Generator,
    *,
    hero: str,
    pool: Sequence[str],
    win_rate: Callable[[str], float],
    weighting: str = "linear_capped",
    seats: str = "one",
    p: float = 2.0,
    nash: Mapping[str, float] | None = None,
) -> Pick:
    """The league exploiter plays the whole pool with PFSP, looking for what nobody beats."""
    return _pfsp_pick(rng, hero, pool, win_rate, weighting, p, seats, nash)
