"""Legal orders per orderable unit or build site: the single place that asks the engine.

Every consumer (bots, prompts, the decoding constraint, parsers, tests) reads these lists, so the
policy can never be offered an order the engine would reject, and everything is sorted because
the engine's own order depends on Python's hash seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import Any

from diplomacy import Game

from diprl.game.orders import WAIVE


class PhaseKind(StrEnum):
    """What a power must do this phase; adjustment phases split into builds and disbands."""

    MOVEMENT = "movement"
    RETREAT = "retreat"
    BUILD = "build"
    DISBAND = "disband"
    NONE = "none"


@dataclass(frozen=True)
class PowerOrders:
    """The legal orders of one power in one phase.

    `by_loc` maps each orderable province (a unit's province, or a build site) to its sorted legal
    orders. `n_required` is how many orders the phase takes: one per unit for movement and retreats,
    the number of builds allowed (each site at most once, the rest WAIVE) or disbands required.
    Treat instances as immutable: forks of one phase share them.
    """

    power: str
    phase: str
    kind: PhaseKind
    by_loc: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    n_required: int = 0

    @property
    def locs(self) -> tuple[str, ...]:
        return tuple(self.by_loc)

    @property
    def allows_waive(self) -> bool:
        return self.kind is PhaseKind.BUILD

    @cached_property
    def loc_of(self) -> dict[str, str]:
        """Order text -> the province it belongs to (WAIVE excluded: it has no site)."""
        return {order: loc for loc, orders in self.by_loc.items() for order in orders}

    @cached_property
    def signature(self) -> tuple[object, ...]:
        """Everything that determines which completions are legal: equal signatures, equal grammars."""
        return (self.kind.value, self.n_required, tuple(self.by_loc.items()))

    def default_order(self, loc: str) -> str:
        """The order a unit gets when it has none: hold in movement, disband in retreats."""
        suffix = {PhaseKind.MOVEMENT: " H", PhaseKind.RETREAT: " D"}.get(self.kind)
        if suffix is None:
            return WAIVE if self.kind is PhaseKind.BUILD else ""
        return next(o for o in self.by_loc[loc] if o.endswith(suffix) and len(o.split()) == 3)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/msgpack-safe) for requests, queues and training records."""
        return {
            "power": self.power,
            "phase": self.phase,
            "kind": self.kind.value,
            "n_required": self.n_required,
            "by_loc": {loc: list(orders) for loc, orders in self.by_loc.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PowerOrders:
        """Inverse of `to_dict`; malformed data is a clear `ValueError`, never a silent default."""
        try:
            kind = PhaseKind(data["kind"])
            by_loc = {str(loc): tuple(str(o) for o in orders) for loc, orders in dict(data["by_loc"]).items()}
            n_required = int(data["n_required"])
            power, phase = str(data["power"]), str(data["phase"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed legal-orders payload: {exc!r}") from exc
        if n_required < 0 or (kind is not PhaseKind.NONE and not 0 < n_required <= max(len(by_loc), 1)):
            raise ValueError(f"malformed legal-orders payload: n_required={n_required} with {len(by_loc)} locations")
        if any(not orders for orders in by_loc.values()):
            raise ValueError("malformed legal-orders payload: a location without legal orders")
        return cls(power=power, phase=phase, kind=kind, by_loc=by_loc, n_required=n_required)

    def num_orders(self) -> int:
        """How many legal orders in total (a size measure for prompts and benchmarks)."""
        return sum(len(v) for v in self.by_loc.values())


def _phase_kind(engine: Game, power_name: str, locs: list[str]) -> PhaseKind:
    if not locs:
        return PhaseKind.NONE
    phase_type = engine.phase_type
    if phase_type == "M":
        return PhaseKind.MOVEMENT
    if phase_type == "R":
        return PhaseKind.RETREAT
    power = engine.get_power(power_name)
    return PhaseKind.BUILD if len(power.centers) > len(power.units) else PhaseKind.DISBAND


def compute_legal_orders(engine: Game) -> dict[str, PowerOrders]:
    """Ask the engine once for every power's legal orders in the current phase."""
    phase = engine.get_current_phase()
    possible = engine.get_all_possible_orders() if engine.phase_type in ("M", "R", "A") else {}
    out: dict[str, PowerOrders] = {}
    for name in sorted(engine.powers):
        locs = sorted(engine.get_orderable_locations(name)) if possible else []
        kind = _phase_kind(engine, name, locs)
        by_loc = {loc: tuple(sorted(o for o in possible.get(loc, ()) if o != WAIVE)) for loc in locs}
        by_loc = {loc: orders for loc, orders in by_loc.items() if orders}
        power = engine.get_power(name)
        if kind is PhaseKind.BUILD:
            n_required = min(len(power.centers) - len(power.units), len(by_loc))
        elif kind is PhaseKind.DISBAND:
            n_required = len(power.units) - len(power.centers)
        else:
            n_required = len(by_loc)
        if n_required == 0:
            kind, by_loc = PhaseKind.NONE, {}
        out[name] = PowerOrders(power=name, phase=phase, kind=kind, by_loc=by_loc, n_required=n_required)
    return out
