"""Simple rule bots: the bottom rungs of the ladder and cheap league opponents.

Each is a distinct, recognisable style (random, passive, aggressive, greedy for centres,
defensive), so that a learned policy's results against them say something about what it learned.
"""

from __future__ import annotations

import abc

from diprl.bots.base import SeededAgent
from diprl.game import DiplomacyGame, PhaseKind, PowerOrders, random_power_orders
from diprl.game.mapgraph import map_graph
from diprl.game.orders import MOVE, RETREAT, SUPPORT, parse_order


def _of_kind(orders: tuple[str, ...], kind: str) -> list[str]:
    return [o for o in orders if parse_order(o).kind == kind and not parse_order(o).via]


class RandomBot(SeededAgent):
    """Uniform over each unit's legal orders; random build sites and disbands (`random_power_orders`)."""

    name = "random"

    def orders(self, game: DiplomacyGame, power: str) -> list[str]:
        return random_power_orders(game.legal_orders(power), self.rng)

    def retreats_or_adjustments(self, legal: PowerOrders) -> list[str]:
        """Retreat somewhere rather than disband; adjust at random (the non-random bots' default)."""
        if legal.kind is PhaseKind.RETREAT:
            return [self.rng.choice(_of_kind(o, RETREAT) or list(o)) for o in legal.by_loc.values()]
        return random_power_orders(legal, self.rng)


class StyleBot(RandomBot, abc.ABC):
    """A bot whose style is in its movement orders (`movement`); it retreats rather than disbands and
    builds and disbands at random (`retreats_or_adjustments`)."""

    def orders(self, game: DiplomacyGame, power: str) -> list[str]:
        legal = game.legal_orders(power)
        if legal.kind is not PhaseKind.MOVEMENT:
            return self.retreats_or_adjustments(legal)
        return self.movement(game, power, legal)

    @abc.abstractmethod
    def movement(self, game: DiplomacyGame, power: str, legal: PowerOrders) -> list[str]:
        """The movement orders of `power`, one per unit: the bot's style."""


class HoldBot(StyleBot):
    """Holds every unit; retreats rather than disbands; builds and disbands at random."""

    name = "hold"

    def movement(self, game: DiplomacyGame, power: str, legal: PowerOrders) -> list[str]:
        return [legal.default_order(loc) for loc in legal.locs]


class ChaosBot(StyleBot):
    """Prefers moves: each unit moves to a random neighbour nine times in ten."""

    name = "chaos"
    move_probability = 0.9

    def movement(self, game: DiplomacyGame, power: str, legal: PowerOrders) -> list[str]:
        out = []
        for orders in legal.by_loc.values():
            moves = _of_kind(orders, MOVE)
            pool = moves if moves and self.rng.random() < self.move_probability else list(orders)
            out.append(self.rng.choice(pool))
        return out


class TerritorialBot(StyleBot):
    """Heads for the nearest centre it does not own; never sends two units to one province."""

    name = "territorial"

    def movement(self, game: DiplomacyGame, power: str, legal: PowerOrders) -> list[str]:
        graph = map_graph(game.engine.map_name)
        targets = frozenset(graph.supply_centres - set(game.centres(power)))
        claimed: set[str] = set()
        out = []
        locs = list(legal.locs)
        self.rng.shuffle(locs)
        for loc in locs:
            hold = legal.default_order(loc)
            unit = parse_order(hold).unit
            if loc in targets:
                out.append(hold)  # stay on the centre until the fall adjustment takes it
                claimed.add(loc)
                continue
            scored = []
            for order in _of_kind(legal.by_loc[loc], MOVE):
                dest = parse_order(order).target
                if dest[:3] not in claimed:
                    scored.append((graph.distance_to(f"{unit[0]} {dest}", targets), order))
            if not scored or not targets:
                claimed.add(loc)
                out.append(hold)
                continue
            nearest = min(d for d, _ in scored)
            choice = self.rng.choice([o for d, o in scored if d == nearest])
            claimed.add(parse_order(choice).target[:3])
            out.append(choice)
        return out


class DefensiveBot(StyleBot):
    """Guards its own centres: units on centres hold, others support them or step onto empty ones."""

    name = "defensive"

    def movement(self, game: DiplomacyGame, power: str, legal: PowerOrders) -> list[str]:
        mine = set(game.centres(power))
        my_units = {u[2:5]: u for u in game.units(power)}
        empty_own = mine - set(my_units)
        claimed: set[str] = set()
        out = []
        for loc in legal.locs:
            orders = legal.by_loc[loc]
            hold = legal.default_order(loc)
            if loc in mine:
                out.append(hold)
                continue
            moves = [o for o in _of_kind(orders, MOVE) if parse_order(o).target[:3] in empty_own - claimed]
            if moves:
                choice = self.rng.choice(moves)
                claimed.add(parse_order(choice).target[:3])
                out.append(choice)
                continue
            supports = [
                o
                for o in orders
                if parse_order(o).kind == SUPPORT
                and parse_order(o).supports_hold
                and parse_order(o).supported_unit[2:5] in mine
                and parse_order(o).supported_unit in my_units.values()
            ]
            out.append(self.rng.choice(supports) if supports else hold)
        return out


__all__ = ["ChaosBot", "DefensiveBot", "HoldBot", "RandomBot", "TerritorialBot"]
