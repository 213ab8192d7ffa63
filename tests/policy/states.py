"""Decision states of every phase type, from seeded bot games (cached per test session)."""

from __future__ import annotations

import random
from functools import lru_cache

from diprl.bots import make_agent
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders
from diprl.game.randomplay import random_orders

KINDS = (PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND)


@lru_cache(maxsize=1)
def legal_order_sets(per_kind: int = 40) -> tuple[PowerOrders, ...]:
    """At least `per_kind` legal-order sets of each phase kind, movement sets of all sizes."""
    found: dict[PhaseKind, list[PowerOrders]] = {k: [] for k in KINDS}
    seed = 0
    while any(len(v) < per_kind for v in found.values()):
        game = DiplomacyGame(max_year=1920)
        mix = ["dumbbot", "random", "chaos", "dumbbot", "territorial", "random", "dumbbot"]
        agents = {p: make_agent(mix[(i + seed) % 7], seed * 7 + i) for i, p in enumerate(game.powers)}
        while not game.is_done:
            for legal in game.all_legal_orders().values():
                if legal.kind in found and len(found[legal.kind]) < per_kind * 4:
                    found[legal.kind].append(legal)
            game.step({p: agents[p].orders(game, p) for p in game.orderable_powers()})
        seed += 1
    return tuple(legal for kind in KINDS for legal in found[kind])


def mid_game_movement_sets(min_units: int = 8) -> list[PowerOrders]:
    return [lo for lo in legal_order_sets() if lo.kind is PhaseKind.MOVEMENT and len(lo.locs) >= min_units]


def random_step(game: DiplomacyGame, rng: random.Random) -> None:
    """Advance one phase with uniformly random legal orders for every power."""
    game.step(random_orders(game.all_legal_orders(), rng))
