"""Playing one game between agents, and DipNet's outcome categories for one seat of it.

The arena CLI, the benchmark suite and crossplay all need the same loop (ask every orderable
power for orders, step, repeat until the game is done) and the same reading of the result, so
both live here, free of any CLI or multiprocessing concerns. Everything is a pure function of the
agents (which carry their own seeds) and `max_year`, which is what makes a benchmark replayable.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from diprl.bots.base import Agent
from diprl.game import DEFAULT_MAX_YEAR, DiplomacyGame
from diprl.game.scoring import score_game


@dataclass(frozen=True)
class GameRecord:
    """The outcome of one played game, seat by seat; no reference to agents or the engine.

    `final_year` is the year of the last phase actually played (a game capped at `max_year` ends
    after that year's last phase), and `issues` counts orders the game layer had to replace: rule
    bots must keep it at zero, a policy's count is a quality signal.
    """

    centres: dict[str, int]
    units: dict[str, int]
    ranks: dict[str, int]
    sum_of_squares: dict[str, float]
    solo: str | None
    eliminated: tuple[str, ...]
    phases: int
    last_phase: str
    final_year: int
    issues: dict[str, int]
    issue_kinds: dict[str, int]
    seconds: float

    @property
    def total_issues(self) -> int:
        return sum(self.issues.values())


def play_game(
    agents: Mapping[str, Agent], max_year: int = DEFAULT_MAX_YEAR, game: DiplomacyGame | None = None
) -> GameRecord:
    """Play `game` (a new standard game capped at `max_year` by default) to its end.

    Powers are asked in sorted order each phase so that agents sharing state or an RNG still
    replay identically. Every power needs an agent, even one eliminated early: a missing seat is a
    configuration error, not a silent civil disorder.
    """
    if game is None:
        game = DiplomacyGame(max_year=max_year)
    missing = sorted(set(game.powers) - set(agents))
    if missing:
        raise ValueError(f"no agent for power(s) {', '.join(missing)}")
    issues: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    start = time.perf_counter()
    phases = 0
    while not game.is_done:
        orders = {power: agents[power].orders(game, power) for power in game.orderable_powers()}
        record = game.step(orders)
        phases += 1
        for issue in record.issues:
            issues[issue.power] += 1
            kinds[issue.kind.value] += 1
    return game_record(game, phases, issues, kinds, time.perf_counter() - start)


def game_record(
    game: DiplomacyGame, phases: int, issues: Mapping[str, int], kinds: Mapping[str, int], seconds: float
) -> GameRecord:
    """The record of a finished game: its score, where it stopped and the order issues counted on the way."""
    score = score_game(game)
    last_phase = game.history[-1].name if game.history else game.phase
    return GameRecord(
        centres=dict(score.centres),
        units=dict(score.units),
        ranks=dict(score.ranks),
        sum_of_squares=dict(score.sum_of_squares),
        solo=score.solo,
        eliminated=score.eliminated,
        phases=phases,
        last_phase=last_phase,
        final_year=int(last_phase[1:5]),
        issues={power: issues.get(power, 0) for power in game.powers},
        issue_kinds=dict(sorted(kinds.items())),
        seconds=seconds,
    )


@dataclass(frozen=True)
class HeroGame:
    """One finished game from the hero's seat: what the arena and the evaluation suite both report
    per game (each adds its own fields); `centres` keeps every power's count for context."""

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
    return {
        "hero_power": hero,
        "hero_centres": record.centres[hero],
        "hero_units": record.units[hero],
        "hero_rank": record.ranks[hero],
        "hero_sum_of_squares": record.sum_of_squares[hero],
        "solo_winner": record.solo,
        "category": categorize(record, hero).value,
        "phases": record.phases,
        "last_phase": record.last_phase,
        "final_year": record.final_year,
        "centres": dict(record.centres),
    }


class Category(StrEnum):
    """DipNet's mutually exclusive outcome of one seat (Paquette et al., 2019, table 2)."""

    SOLO = "solo"
    TOP = "top"
    SURVIVED = "survived"
    ELIMINATED = "eliminated"


CATEGORIES: tuple[Category, ...] = tuple(Category)


def categorize(record: GameRecord, power: str) -> Category:
    """Which of DipNet's categories `power` ended the game in.

    - solo: `power` itself reached a solo.
    - top: nobody soloed and `power` has the most centres; a tie for first counts as top for every
      tied power (DipNet's "most SC" is not split by tie-breaks), so top rates can sum above 1/7.
    - survived: not the above, and `power` still has something on the board (units, centres, or a
      dislodged unit): this includes surviving another power's solo.
    - eliminated: nothing left.
    """
    if power not in record.centres:
        raise ValueError(f"unknown power {power!r}")
    if record.solo == power:
        return Category.SOLO
    if record.solo is None and record.centres[power] == max(record.centres.values()):
        return Category.TOP
    if power in record.eliminated:
        return Category.ELIMINATED
    return Category.SURVIVED
