"""Behavioural metrics: how a seat plays, not only how it finishes.

Final centres say whether a policy wins; these say how. A policy that learned to coordinate gives
supports that hold (few void supports: the supported unit did something else) and that decide
fights (critical: re-adjudicated without the support, the supported order fails); one that learned
to grab grows steadily (centres gained per year); and a treacherous one attacks the power that
helped it the turn before. Everything is read from the phase records the game layer keeps, so the
same numbers come out of any game, whoever played it.

Definitions (all for one seat, the "hero", over the movement phases it had units in):
- order-kind mix: holds, moves, supports and convoys, each / all movement orders of the hero (the hold
  rate is the first). A policy that collapses to one kind (every unit holding) has no mix left.
- support rate: support orders / all movement orders of the hero.
- void-support rate: supports the engine marked `void` / supports.
- critical-support rate: supports whose removal (a fork adjudicated with that unit holding instead)
  makes the supported order fail / supports (`diprl.game.outcomes.classify_supports`).
- centres gained per year: (final centres - centres at the start) / years played.
- waived builds: WAIVE orders / build slots (builds + WAIVEs) in the hero's adjustment phases. A
  policy that waives a build it could make throws strength away; rule bots never do.
- attacks on a recent supporter: a movement phase after one in which another power gave a
  non-void support to one of the hero's units is an opportunity; it counts as an attack when the
  hero orders a move into a province holding that power's unit or a centre it owns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from diprl.game import DiplomacyGame, PhaseRecord
from diprl.game.orders import BUILD, CONVOY, HOLD, MOVE, SUPPORT, WAIVE, OrderSyntaxError, parse_order
from diprl.game.outcomes import SupportVerdict, classify_supports

ORDER_KINDS = {HOLD: "hold", MOVE: "move", SUPPORT: "support", CONVOY: "convoy"}
"""Movement-phase order kinds by their parsed `kind`, named as the order-kind mix reports them."""


@dataclass
class BehaviourCounts:
    """Counts for one seat of one game; they add up across games (see `merge`)."""

    movement_phases: int = 0
    orders: int = 0
    kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ORDER_KINDS.values(), 0))  # "hold": n, ...
    verdicts: dict[str, int] = field(default_factory=lambda: {v.value: 0 for v in SupportVerdict})
    start_centres: int = 0
    final_centres: int = 0
    years: int = 0
    supporter_opportunities: int = 0
    supporter_attacks: int = 0  # phases with at least one attack on a recent supporter
    supporter_attack_orders: int = 0
    builds: int = 0
    waived_builds: int = 0

    def kind_shares(self) -> dict[str, float] | None:
        """The order-kind mix: each kind's share of the movement orders (None without any order)."""
        if not self.orders:
            return None
        return {name: n / self.orders for name, n in self.kinds.items()}

    @property
    def centres_gained_per_year(self) -> float:
        return (self.final_centres - self.start_centres) / self.years if self.years else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"centres_gained_per_year": self.centres_gained_per_year}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BehaviourCounts:
        """Inverse of `to_dict` (the derived rate is dropped; counts written before `kinds` are read into it)."""
        counts = {k: v for k, v in data.items() if k != "centres_gained_per_year" and k not in _KIND_FIELDS}
        if "kinds" not in counts:
            counts["kinds"] = {name: int(data.get(key, 0)) for key, name in _KIND_FIELDS.items()}
        return cls(**counts)


_KIND_FIELDS = {f"{name}s": name for name in ORDER_KINDS.values()}
"""The per-kind fields `BehaviourCounts` had before `kinds` (`holds`, `moves`, ...), as older results hold them."""


def _owner_by_province(units: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Province (no coast) -> power of the unit standing there, from an engine state's `units`."""
    owners: dict[str, str] = {}
    for power, listed in units.items():
        for unit in listed:
            if not unit.startswith("*"):  # '*' marks a dislodged unit in retreat-phase states
                owners[unit[2:5]] = power
    return owners


def _centre_owner(centres: Mapping[str, Sequence[str]]) -> dict[str, str]:
    return {loc[:3]: power for power, locs in centres.items() for loc in locs}


def _parsed(orders: Sequence[str]) -> list[Any]:
    out = []
    for text in orders:
        try:
            out.append(parse_order(text))
        except OrderSyntaxError:
            continue  # the engine's own record; nothing unparseable is expected, and none is counted
    return out


class BehaviourTracker:
    """Accumulates `BehaviourCounts` for `hero` from the phase records of one game, in order.

    Feed every processed phase to `observe` (any phase type; only movement phases count) and call
    `finish` with the game at its end. `critical_supports=False` skips the re-adjudication (a few
    milliseconds per successful support) when only the cheap metrics are wanted.
    """

    def __init__(self, hero: str, start_centres: int, critical_supports: bool = True, max_year: int = 1935) -> None:
        self.hero = hero
        self.critical_supports = critical_supports
        self.max_year = max_year
        self.counts = BehaviourCounts(start_centres=start_centres)
        self._recent_supporters: set[str] = set()

    def observe(self, record: PhaseRecord) -> None:
        if record.name.endswith("A"):
            self._count_builds(record)
        if not record.name.endswith("M"):
            return
        hero = self.hero
        units = record.state.get("units", {})
        owners = _owner_by_province(units)
        hero_orders = _parsed(record.orders.get(hero, ()))
        supporters = self._recent_supporters
        self._recent_supporters = self._supporters_of(record, owners)
        if not hero_orders:
            return
        counts = self.counts
        counts.movement_phases += 1
        counts.orders += len(hero_orders)
        for order in hero_orders:
            if order.kind in ORDER_KINDS:
                counts.kinds[ORDER_KINDS[order.kind]] += 1
        supports = [o for o in hero_orders if o.kind == SUPPORT]
        if supports:
            self._classify(record, supports)
        if supporters:
            counts.supporter_opportunities += 1
            centre_owners = _centre_owner(record.state.get("centers", {}))
            attacks = sum(
                1
                for o in hero_orders
                if o.kind == MOVE
                and (owners.get(o.target_province) in supporters or centre_owners.get(o.target_province) in supporters)
            )
            counts.supporter_attack_orders += attacks
            counts.supporter_attacks += attacks > 0

    def _count_builds(self, record: PhaseRecord) -> None:
        orders = _parsed(record.orders.get(self.hero, ()))
        self.counts.builds += sum(o.kind == BUILD for o in orders)
        self.counts.waived_builds += sum(o.kind == WAIVE for o in orders)

    def _supporters_of(self, record: PhaseRecord, owners: Mapping[str, str]) -> set[str]:
        """Powers other than the hero that gave a non-void support to a hero unit in `record`."""
        found: set[str] = set()
        for power, orders in record.orders.items():
            if power == self.hero:
                continue
            for order in _parsed(orders):
                if order.kind != SUPPORT or "void" in record.results.get(order.unit, ()):
                    continue
                if owners.get(order.supported_unit[2:5]) == self.hero:
                    found.add(power)
        return found

    def _classify(self, record: PhaseRecord, supports: Sequence[Any]) -> None:
        verdicts = self.counts.verdicts
        if self.critical_supports:
            before = DiplomacyGame.from_state(record.state, max_year=self.max_year)
            for verdict in classify_supports(before, record, powers=[self.hero]).values():
                verdicts[verdict.value] += 1
            return
        for order in supports:  # without re-adjudication: void and cut are read off the results
            codes = record.results.get(order.unit, ())
            if "void" in codes:
                verdicts[SupportVerdict.VOID.value] += 1
            elif "cut" in codes or "dislodged" in codes:
                verdicts[SupportVerdict.CUT.value] += 1

    def finish(self, game: DiplomacyGame, first_year: int = 1901) -> BehaviourCounts:
        last = game.history[-1].name if game.history else "S1901M"
        self.counts.final_centres = len(game.centres(self.hero))
        self.counts.years = int(last[1:5]) - first_year + 1
        return self.counts


def merge(counts: Sequence[BehaviourCounts]) -> BehaviourCounts:
    """Sum of per-game counts, field by field (start/final centres and years summed too: only rates use them)."""
    total = BehaviourCounts()
    for c in counts:
        for f in fields(BehaviourCounts):
            mine, theirs = getattr(total, f.name), getattr(c, f.name)
            if isinstance(mine, dict):
                for key, n in theirs.items():
                    mine[key] = mine.get(key, 0) + n
            else:
                setattr(total, f.name, mine + theirs)
    return total
