"""Who sits where in a numbered series of games, and each game's seed.

Training matches, the evaluation suite, the arena and imitation's teacher games all play series of
games where game `i` seats a hero on the `i % 7`-th power (sorted names), so every seven games cover
every power once and a power's own strength (Russia's four centres, England's island) does not bias
the result; the other six seats take the opponents round-robin, shifted each game. Game `i` of a series
seeded `s` has seed `s * SEED_STRIDE + i`: series with nearby seeds never share a game.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

SEED_STRIDE = 100003


@lru_cache(maxsize=1)
def standard_powers() -> tuple[str, ...]:
    """The seven powers, sorted, read from the engine's map rather than written out by hand."""
    from diprl.game.game import DiplomacyGame

    return DiplomacyGame().powers


def game_seed(base_seed: int, index: int) -> int:
    return base_seed * SEED_STRIDE + index


def rotated_seats(index: int, hero: str, opponents: Sequence[str]) -> tuple[str, dict[str, str]]:
    """(the hero's power, power -> who plays it) of game `index`: the hero on power `index % 7`, the
    other six seats filled round-robin from `opponents`, starting `index` places along."""
    if not opponents:
        raise ValueError("a seating needs at least one opponent")
    powers = standard_powers()
    hero_power = powers[index % len(powers)]
    others = [p for p in powers if p != hero_power]
    seats = {hero_power: hero} | {p: opponents[(index + j) % len(opponents)] for j, p in enumerate(others)}
    return hero_power, dict(sorted(seats.items()))
