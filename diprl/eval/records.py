"""A finished game as the evaluation reads it: its record, the hero's view of it, DipNet's categories.

Every suite game (the fixed benchmark, the arena, the ladder, crossplay, the training run's
evaluator) is played by the lockstep runner (`diprl.rollout.lockstep`, through `diprl.eval.suite`);
what is kept of it once it is over lives here, free of any playing, CLI or multiprocessing concern.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from diprl.game import DiplomacyGame
from diprl.game.scoring import GameScore, score_game


@dataclass(frozen=True)
class GameRecord:
    """The outcome of one played game: the final position's score, seat by seat, and how it got there.

    `final_year` is the year of the last phase actually played (a game capped at `max_year` ends
    after that year's last phase), and `issues` counts, per power, the orders the game layer had to
    replace: rule bots must keep it at zero, a policy's count is a quality signal.
    """

    score: GameScore
    phases: int
    last_phase: str
    final_year: int
    issues: dict[str, int]


def game_record(game: DiplomacyGame, phases: int, issues: Mapping[str, int]) -> GameRecord:
    """The record of a finished game: its score, where it stopped and the order issues counted on the way."""
    last_phase = game.history[-1].name if game.history else game.phase
    return GameRecord(
        score=score_game(game),
        phases=phases,
        last_phase=last_phase,
        final_year=int(last_phase[1:5]),
        issues={power: issues.get(power, 0) for power in game.powers},
    )


@dataclass(frozen=True)
class HeroGame:
    """One finished game from the hero's seat (a suite's `PlayedGame` adds what was measured on the way);
    `centres` keeps every power's count for context."""

    index: int
    seed: int
    hero_power: str
    hero_centres: int
    hero_units: int
    hero_rank: int
    hero_sum_of_squares: float
    solo_winner: str | None
    category: str
    phases: int
    last_phase: str
    final_year: int
    centres: dict[str, int]


def hero_fields(record: GameRecord, hero: str) -> dict[str, Any]:
    """`HeroGame`'s fields (all but index and seed) read from a game record for the hero's seat."""
    score = record.score
    return {
        "hero_power": hero,
        "hero_centres": score.centres[hero],
        "hero_units": score.units[hero],
        "hero_rank": score.ranks[hero],
        "hero_sum_of_squares": score.sum_of_squares[hero],
        "solo_winner": score.solo,
        "category": categorize(score, hero).value,
        "phases": record.phases,
        "last_phase": record.last_phase,
        "final_year": record.final_year,
        "centres": dict(score.centres),
    }


class Category(StrEnum):
    """DipNet's mutually exclusive outcome of one seat (Paquette et al., 2019, table 2)."""

    SOLO = "solo"
    TOP = "top"
    SURVIVED = "survived"
    ELIMINATED = "eliminated"


CATEGORIES: tuple[Category, ...] = tuple(Category)


def categorize(score: GameScore, power: str) -> Category:
    """Which of DipNet's categories `power` ended the game in.

    - solo: `power` itself reached a solo.
    - top: nobody soloed and `power` has the most centres; a tie for first counts as top for every
      tied power (DipNet's "most SC" is not split by tie-breaks), so top rates can sum above 1/7.
    - survived: not the above, and `power` still has something on the board (units, centres, or a
      dislodged unit): this includes surviving another power's solo.
    - eliminated: nothing left.
    """
    if power not in score.centres:
        raise ValueError(f"unknown power {power!r}")
    if score.solo == power:
        return Category.SOLO
    if score.solo is None and score.centres[power] == max(score.centres.values()):
        return Category.TOP
    if power in score.eliminated:
        return Category.ELIMINATED
    return Category.SURVIVED
