"""Uniformly random legal orders: the one definition behind RandomBot, the engine benchmark and tests.

One function, so that "random play" means the same thing wherever a figure is measured, and so that
a seeded stream gives the same game everywhere. It reads only the sorted legal lists (never the
engine's hash-seed-dependent order) and draws from `rng` only for powers with something to order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from diprl.game.legal import PhaseKind, PowerOrders


def random_power_orders(legal: PowerOrders, rng: random.Random) -> list[str]:
    """Random legal orders for one power, exactly `legal.n_required` of them.

    Movement and retreats: each unit picks uniformly among its legal orders (a retreat phase's
    options include the disband). Builds: `n_required` distinct sites in random order, each with a
    uniformly chosen unit type or coast; never a voluntary WAIVE. Disbands: `n_required` distinct
    units chosen uniformly. A power with nothing to order gets `[]` and consumes no randomness.
    """
    if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        return [rng.choice(legal.by_loc[loc]) for loc in sorted(legal.by_loc)]
    if legal.kind is PhaseKind.BUILD:
        sites = sorted(legal.by_loc)
        rng.shuffle(sites)
        return [rng.choice(legal.by_loc[site]) for site in sites[: legal.n_required]]
    if legal.kind is PhaseKind.DISBAND:
        locs = sorted(legal.by_loc)
        rng.shuffle(locs)
        return [legal.by_loc[loc][0] for loc in locs[: legal.n_required]]
    return []


def random_orders(legal: Mapping[str, PowerOrders], rng: random.Random) -> dict[str, list[str]]:
    """Random legal orders for every power (e.g. `game.all_legal_orders()`), drawn in sorted power order.

    Powers with nothing to order are left out, so the result can go straight to `DiplomacyGame.step`.
    """
    out: dict[str, list[str]] = {}
    for power in sorted(legal):
        orders = random_power_orders(legal[power], rng)
        if orders:
            out[power] = orders
    return out
