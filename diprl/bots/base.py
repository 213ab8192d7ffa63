"""The one interface every player implements, rule bots now and LLM policies later."""

from __future__ import annotations

import random
from typing import Protocol, runtime_checkable

from diprl.game import DiplomacyGame, PhaseKind, PowerOrders


@runtime_checkable
class Agent(Protocol):
    """Returns the orders of `power` for the game's current phase: legal, one per unit or site."""

    name: str

    def orders(self, game: DiplomacyGame, power: str) -> list[str]: ...


def pick_adjustments(
    legal: PowerOrders, ranked_locs: list[str], choose_order: dict[str, str] | None = None
) -> list[str]:
    """Turn a ranking of sites (builds) or units (disbands) into exactly `n_required` orders.

    Builds take the first sites of the ranking (WAIVE for any the ranking leaves out); disbands
    take the first units. `choose_order` picks the order for a site (e.g. army vs fleet).
    """
    chosen = ranked_locs[: legal.n_required]
    orders = [(choose_order or {}).get(loc, legal.by_loc[loc][0]) for loc in chosen]
    if legal.kind is PhaseKind.BUILD:
        orders += ["WAIVE"] * (legal.n_required - len(orders))
    return orders


class SeededAgent:
    """Base for bots with their own random stream, so a seeded game replays exactly."""

    name = "seeded"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
