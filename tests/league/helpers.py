"""Results for matches handed out by a LeagueManager, with centres chosen by the test."""

from __future__ import annotations

from collections.abc import Callable

from diprl.game.scoring import ranks
from diprl.messages import Match, MatchResult


def results_for(match: Match, centres_of: Callable[[str, str], int], forks: int = 1) -> list[MatchResult]:
    """The MatchResults of all G=`forks` forks; `centres_of(power, ref)`: each seat's centres (in every fork)."""
    out = []
    for fork in range(forks):
        centres = {p: centres_of(p, ref) for p, ref in match.seats.items()}
        out.append(
            MatchResult(
                match_id=match.match_id,
                fork=fork,
                seats=dict(match.seats),
                hero=match.hero,
                centres=centres,
                ranks=ranks(centres),
                final_phase="W1905A",
                solo=None,
                forks=forks,
            )
        )
    return out


def hero_wins(match: Match, forks: int = 1) -> list[MatchResult]:
    return results_for(match, lambda p, ref: 6 if p == match.hero else 3, forks)


def hero_loses(match: Match, forks: int = 1) -> list[MatchResult]:
    return results_for(match, lambda p, ref: 1 if p == match.hero else 3, forks)
