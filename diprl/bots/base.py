"""The one interface every player implements, rule bots now and LLM policies later."""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

from diprl.game import DiplomacyGame


@runtime_checkable
class Agent(Protocol):
    """Returns the orders of `power` for the game's current phase: legal, one per unit or site."""

    name: str

    def orders(self, game: DiplomacyGame, power: str) -> list[str]: ...


class SeededAgent:
    """Base for bots with their own random stream, so a seeded game replays exactly."""

    name = "seeded"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)


_MASK64 = (1 << 64) - 1


def seat_seed(game_seed: int, seat: int) -> int:
    """A 32-bit seed for the agent in `seat` (power index) of the game seeded `game_seed`.

    Python's `hash` is salted per process, so it cannot be used: worker processes would disagree.
    A splitmix64 finaliser decorrelates neighbouring games and seats; 32 bits keep the result
    valid for every RNG a bot might use (`random.Random`, `numpy.random.seed`).
    """
    x = (game_seed * 0x9E3779B97F4A7C15 + (seat + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & 0xFFFFFFFF
