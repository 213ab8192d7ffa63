"""The league's payoff table: decayed win rates between members, from 7-player games.

Diplomacy has seven seats, so "who beat whom" is per pair of seats. For a game seen from the hero
(the trained seat), the outcome against a member that holds one or more of the other seats is the
probability that the hero outranks a uniformly chosen seat of that member by supply centres, ties
counting half (`hero_outcome`). One game then updates one hero-member pair per member present.

Counts are decayed per pair, AlphaStar style: every update of a pair first multiplies its win and
game counts by `decay`, so an old result weighs decay^k after k newer games of the same pair and the
table follows learners that improve. A pair with fewer than `min_games` (decayed) games reads 0.5.

The G forks of one match are correlated continuations of one state, not G games: each fork's outcome
weighs 1/G (`MatchResult.forks` = G) and the pair's counts decay once per match (`match_outcomes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def hero_outcome(centres: Mapping[str, int], hero: str, member_seats: Iterable[str]) -> float:
    """P(hero outranks a seat of the member by centres), ties half: 1 beats all, 0 loses to all."""
    seats = list(member_seats)
    if not seats:
        raise ValueError("a member with no seats has no outcome")
    if hero in seats:
        raise ValueError(f"the hero's own seat {hero!r} cannot be an opponent seat")
    mine = centres[hero]
    total = 0.0
    for seat in seats:
        theirs = centres[seat]
        total += 1.0 if mine > theirs else 0.5 if mine == theirs else 0.0
    return total / len(seats)


Fork = tuple[Mapping[str, int], str, Mapping[str, str]]
"""(centres by power, hero power, member by power) of one fork."""


def match_outcomes(forks: Sequence[Fork], hero_member: str, weights: Sequence[float] | None = None) -> dict[str, float]:
    """Member -> outcome of one match for the hero: the forks' outcomes averaged with `weights`.

    `forks` holds, per fork, (centres by power, hero power, member by power); `weights` is each fork's
    weight, 1/G for the G forks of a match (equal weights when omitted). Seats played by the hero's own
    member are not opponents (self-play yields nothing). A member missing from some forks is averaged
    over the forks it appears in.
    """
    if not forks:
        raise ValueError("a match needs at least one fork")
    if weights is None:
        weights = [1.0] * len(forks)
    if len(weights) != len(forks) or any(not w > 0.0 for w in weights):
        raise ValueError(f"need one positive weight per fork, got {list(weights)} for {len(forks)} forks")
    sums: dict[str, float] = {}
    totals: dict[str, float] = {}
    for (centres, hero, members), weight in zip(forks, weights, strict=True):
        by_member: dict[str, list[str]] = {}
        for power, member in members.items():
            if power != hero and member != hero_member:
                by_member.setdefault(member, []).append(power)
        for member, seats in by_member.items():
            sums[member] = sums.get(member, 0.0) + weight * hero_outcome(centres, hero, seats)
            totals[member] = totals.get(member, 0.0) + weight
    return {m: sums[m] / totals[m] for m in sorted(sums)}


@dataclass
class PairStats:
    wins: float = 0.0  # decayed sum of outcomes (1 win, 0.5 tie, 0 loss)
    games: float = 0.0  # decayed number of games


class Payoff:
    """Decayed hero-vs-member win rates; stored both ways, so win_rate(a, b) + win_rate(b, a) = 1."""

    def __init__(self, decay: float = 0.99, min_games: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"payoff decay must be in (0, 1], got {decay}")
        if min_games < 0.0:
            raise ValueError(f"payoff min_games must be >= 0, got {min_games}")
        self.decay = decay
        self.min_games = min_games
        self._pairs: dict[tuple[str, str], PairStats] = {}

    def update(self, hero: str, member: str, outcome: float, weight: float = 1.0) -> None:
        """One game (of weight `weight`) between `hero` and `member`, `outcome` in [0, 1] for the hero."""
        if hero == member:
            raise ValueError(f"{hero!r} against itself has no payoff")
        if not 0.0 <= outcome <= 1.0:
            raise ValueError(f"outcome must be in [0, 1], got {outcome}")
        if weight <= 0.0:
            raise ValueError(f"game weight must be positive, got {weight}")
        for a, b, x in ((hero, member, outcome), (member, hero, 1.0 - outcome)):
            stats = self._pairs.setdefault((a, b), PairStats())
            stats.wins = stats.wins * self.decay + weight * x
            stats.games = stats.games * self.decay + weight

    def games(self, a: str, b: str) -> float:
        stats = self._pairs.get((a, b))
        return stats.games if stats else 0.0

    def win_rate(self, a: str, b: str) -> float:
        """a's decayed win rate against b; 0.5 for itself and below `min_games`."""
        if a == b:
            return 0.5
        stats = self._pairs.get((a, b))
        if stats is None or stats.games <= 0.0 or stats.games < self.min_games:
            return 0.5
        return stats.wins / stats.games

    def win_rates(self, a: str, others: Sequence[str]) -> list[float]:
        return [self.win_rate(a, b) for b in others]

    def measured(self, a: str, b: str) -> bool:
        """Whether a and b have played enough (`min_games`, and at least one game) for a real win rate."""
        return a == b or self.games(a, b) >= max(self.min_games, 1e-9)

    def measured_subset(self, members: Sequence[str]) -> list[str]:
        """Members, less those that leave a pair unmeasured: every pair of the result has played.

        Greedy: repeatedly drop the member with the most unmeasured pairs (ties: fewer games, then
        name), so a table where a bot never met another bot keeps the learner and whichever bots it
        played. An unmeasured pair reads 0.5 in `matrix`, a result nobody observed; a Nash equilibrium
        solved over it is a fiction (main beating Random 90% and losing to DumbBot 90% would give
        Random, DumbBot and an unplayed `base` a third each).
        """
        keep = list(members)
        while len(keep) > 1:
            missing = {m: sum(not self.measured(m, o) for o in keep) for m in keep}
            played = {m: sum(self.games(m, o) for o in keep if o != m) for m in keep}
            worst = max(keep, key=lambda m: (missing[m], -played[m], m))
            if missing[worst] == 0:
                break
            keep.remove(worst)
        return keep

    def matrix(self, members: Sequence[str]) -> list[list[float]]:
        return [[self.win_rate(a, b) for b in members] for a in members]

    def forget(self, member: str) -> None:
        """Drop every pair that involves `member` (an exploiter reset to a fresh adapter)."""
        self._pairs = {k: v for k, v in self._pairs.items() if member not in k}

    def members(self) -> list[str]:
        return sorted({m for pair in self._pairs for m in pair})

    def to_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "min_games": self.min_games,
            "pairs": [[a, b, s.wins, s.games] for (a, b), s in sorted(self._pairs.items())],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Payoff:
        payoff = cls(float(data["decay"]), float(data["min_games"]))
        for a, b, wins, games in data["pairs"]:
            payoff._pairs[(str(a), str(b))] = PairStats(float(wins), float(games))
        return payoff
