"""Ratings of league members from the 7 ranks of each game: openskill's Plackett-Luce model.

Plackett-Luce rates a full ranking of many players at once (ties share a rank natively), which
suits a 7-seat game better than pairwise Elo. A rating is a Gaussian belief (mu, sigma); we report
the conservative `ordinal` mu - 3 sigma, which only rises once the model is sure.

Two things differ from rating independent players:
- A member may hold several seats (one opponent in all six). Each seat is rated as its own
  player from the member's rating; the member then moves by the mean of its seats' updates, so
  holding six seats counts as one appearance, not six.
- The G forks of one match are one game: each fork is rated from the same prior and the member
  moves by the mean of the G updates (mu directly; sigma through its variance).
A fork played by a single member (self-play) carries no information about relative skill and is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openskill.models import PlackettLuce


@dataclass(frozen=True)
class Rating:
    mu: float
    sigma: float

    @property
    def ordinal(self) -> float:
        """The conservative estimate mu - 3 sigma (what the league reports)."""
        return self.mu - 3.0 * self.sigma


def fork_updates(
    model: PlackettLuce, ratings: Mapping[str, Rating], seats: Mapping[str, str], ranks: Mapping[str, int]
) -> dict[str, tuple[float, float]]:
    """Member -> (mean mu change, mean sigma^2 change) over its seats in one fork ranked `ranks`."""
    powers = sorted(seats)
    if set(ranks) != set(powers):
        raise ValueError(f"ranks name powers {sorted(ranks)} but seats name {powers}")
    if len({seats[p] for p in powers}) < 2:
        return {}
    teams = [[model.rating(mu=ratings[seats[p]].mu, sigma=ratings[seats[p]].sigma)] for p in powers]
    rated = model.rate(teams, ranks=[float(ranks[p]) for p in powers])
    sums: dict[str, list[float]] = {}
    for power, team in zip(powers, rated, strict=True):
        before = ratings[seats[power]]
        acc = sums.setdefault(seats[power], [0.0, 0.0, 0.0])
        acc[0] += team[0].mu - before.mu
        acc[1] += team[0].sigma ** 2 - before.sigma**2
        acc[2] += 1.0
    return {m: (d_mu / n, d_var / n) for m, (d_mu, d_var, n) in sums.items()}


def rate_match(
    model: PlackettLuce,
    ratings: Mapping[str, Rating],
    forks: Sequence[tuple[Mapping[str, str], Mapping[str, int]]],
) -> dict[str, Rating]:
    """New ratings of the members of one match; `forks` holds (member by power, rank by power) per fork."""
    totals: dict[str, list[float]] = {}
    for seats, ranks in forks:
        for member, (d_mu, d_var) in fork_updates(model, ratings, seats, ranks).items():
            acc = totals.setdefault(member, [0.0, 0.0])
            acc[0] += d_mu
            acc[1] += d_var
    out: dict[str, Rating] = {}
    for member, (d_mu, d_var) in totals.items():
        before = ratings[member]
        n = len(forks)
        out[member] = Rating(before.mu + d_mu / n, math.sqrt(max(before.sigma**2 + d_var / n, 1e-12)))
    return out


class Ratings:
    """Every member's rating (default prior for a newcomer) under one Plackett-Luce model."""

    def __init__(self, mu: float = 25.0, sigma: float = 25.0 / 3.0) -> None:
        self.model = PlackettLuce(mu=mu, sigma=sigma)
        self.prior = Rating(mu, sigma)
        self.table: dict[str, Rating] = {}

    def get(self, member: str) -> Rating:
        return self.table.get(member, self.prior)

    def rate(self, forks: Sequence[tuple[Mapping[str, str], Mapping[str, int]]]) -> None:
        """Apply one match (its forks weighing 1/G each)."""
        members = {m for seats, _ in forks for m in seats.values()}
        current = {m: self.get(m) for m in members}
        self.table.update(rate_match(self.model, current, forks))

    def set(self, member: str, rating: Rating) -> None:
        self.table[member] = rating

    def forget(self, member: str) -> None:
        self.table.pop(member, None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prior": [self.prior.mu, self.prior.sigma],
            "table": {m: [r.mu, r.sigma] for m, r in sorted(self.table.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Ratings:
        mu, sigma = data["prior"]
        ratings = cls(float(mu), float(sigma))
        ratings.table = {str(m): Rating(float(a), float(b)) for m, (a, b) in data["table"].items()}
        return ratings
