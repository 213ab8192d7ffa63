"""Scores of a finished (or capped) game: centres, ranks with ties, sum-of-squares, solo."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diprl.game.game import SOLO_CENTRES, DiplomacyGame


def ranks(centres: Mapping[str, int]) -> dict[str, int]:
    """Competition ranking: most centres is 1, tied powers share the best rank (10,8,8,5 -> 1,2,2,4)."""
    return {p: 1 + sum(1 for m in centres.values() if m > n) for p, n in centres.items()}


def sum_of_squares(centres: Mapping[str, int], solo_at: int = SOLO_CENTRES) -> dict[str, float]:
    """Sum-of-squares score in [0, 100]; a solo takes 100 and everyone else 0."""
    winner = next((p for p, n in centres.items() if n >= solo_at), None)
    if winner is not None:
        return {p: 100.0 if p == winner else 0.0 for p in centres}
    total = sum(n * n for n in centres.values())
    if total == 0:
        return {p: 0.0 for p in centres}
    return {p: 100.0 * n * n / total for p, n in centres.items()}


@dataclass(frozen=True)
class GameScore:
    centres: dict[str, int]
    units: dict[str, int]
    ranks: dict[str, int]
    sum_of_squares: dict[str, float]
    solo: str | None
    eliminated: tuple[str, ...]
    final_phase: str
    year: int


def score_game(game: DiplomacyGame) -> GameScore:
    centres = game.centre_counts()
    return GameScore(
        centres=centres,
        units={p: len(game.units(p)) for p in game.powers},
        ranks=ranks(centres),
        sum_of_squares=sum_of_squares(centres),
        solo=game.solo_winner(),
        eliminated=tuple(p for p in game.powers if game.is_eliminated(p)),
        final_phase=game.phase,
        year=game.year,
    )
