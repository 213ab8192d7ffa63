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
