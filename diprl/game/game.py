"""`DiplomacyGame`: the engine behind validated steps, cached legal orders, cheap forks and history.

Forking uses `set_state(get_state())` on a fresh engine: `copy.deepcopy` keeps a stale unit-owner
cache (every order of the copy is silently rejected) and is two orders of magnitude slower. The
engine's own histories are not copied, so this class keeps its own (`history`), which also makes
replays of forks complete.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from diplomacy import Game

from diprl.game.legal import PhaseKind, PowerOrders, compute_legal_orders
from diprl.game.orders import DISBAND, WAIVE, parse_order
from diprl.game.validate import IssueKind, OrderIssue, validate_orders

DEFAULT_MAX_YEAR = 1935
SOLO_CENTRES = 18


class GameOverError(RuntimeError):
    """Raised when a finished game is asked to step."""


class UnknownPowerError(ValueError):
    """Raised for a power name that is not on the map."""


@dataclass(frozen=True)
class PhaseRecord:
    """One processed phase: engine state before adjudication, orders played, results per unit.

    `orders` holds every order that was adjudicated, per power and sorted: the orders as played after
    validation (defaults included), WAIVEs, and the disbands the engine's civil-disorder rule chose for
    a power that ordered too few. `results` is keyed by unit ("A PAR"); an empty tuple is a success.
    """

    name: str
    state: Mapping[str, Any]
    orders: Mapping[str, tuple[str, ...]]
    results: Mapping[str, tuple[str, ...]]
    issues: tuple[OrderIssue, ...]


def _name_civil_disorder_disbands(
    issues: Sequence[OrderIssue], civil_disorder: Mapping[str, Sequence[str]]
) -> tuple[OrderIssue, ...]:
    """Fill in the disband the engine chose for each missing disband order (known only after processing)."""
    remaining = {power: list(disbands) for power, disbands in civil_disorder.items()}
    out = []
    for issue in issues:
        pending = remaining.get(issue.power)
        if issue.kind is IssueKind.MISSING and not issue.replacement and pending:
            issue = replace(issue, replacement=pending.pop(0))
        out.append(issue)
    return tuple(out)


class DiplomacyGame:
    """A game of standard Diplomacy that stops at a solo or after winter of `max_year`."""

    def __init__(
        self, *, max_year: int = DEFAULT_MAX_YEAR, map_name: str = "standard", _engine: Game | None = None
    ) -> None:
        self.max_year = max_year
        self._engine = _engine if _engine is not None else Game(map_name=map_name)
        self._history: list[PhaseRecord] = []
        self._legal: dict[str, PowerOrders] | None = None

    # ----------------------------------------------------------------- views
    @property
    def engine(self) -> Game:
        """The underlying engine, for read-only use (rendering, map queries)."""
        return self._engine

    @property
    def powers(self) -> tuple[str, ...]:
        return tuple(sorted(self._engine.powers))

    @property
    def phase(self) -> str:
        return str(self._engine.get_current_phase())

    @property
    def phase_type(self) -> str:
        """'M' movement, 'R' retreats, 'A' adjustments, '' when the engine has completed the game."""
        return "" if self.phase == "COMPLETED" else str(self._engine.phase_type)

    @property
    def season(self) -> str:
        return self.phase[0] if self.phase_type else ""

    @property
    def year(self) -> int:
        if self.phase_type:
            return int(self.phase[1:5])
        last = self._history[-1].name if self._history else "S1901M"
        return int(last[1:5])

    @property
    def history(self) -> tuple[PhaseRecord, ...]:
        return tuple(self._history)

    @property
    def is_done(self) -> bool:
        return self._engine.is_game_done or self.year > self.max_year or self.solo_winner() is not None

    def check_power(self, power: str) -> str:
        if power not in self._engine.powers:
            raise UnknownPowerError(f"unknown power {power!r}; powers are {', '.join(self.powers)}")
        return power

    def units(self, power: str) -> tuple[str, ...]:
        """Units on the board (dislodged units excluded), e.g. ('A PAR', 'F STP/SC')."""
        return tuple(sorted(self._engine.get_power(self.check_power(power)).units))

    def dislodged(self, power: str) -> dict[str, tuple[str, ...]]:
        """Dislodged units awaiting a retreat order, with their retreat provinces."""
        retreats = self._engine.get_power(self.check_power(power)).retreats
        return {unit: tuple(sorted(dests)) for unit, dests in sorted(retreats.items())}

    def centres(self, power: str) -> tuple[str, ...]:
        return tuple(sorted(self._engine.get_power(self.check_power(power)).centers))

    def homes(self, power: str) -> tuple[str, ...]:
        return tuple(sorted(self._engine.get_power(self.check_power(power)).homes))

    def centre_counts(self) -> dict[str, int]:
        return {p: len(self._engine.get_power(p).centers) for p in self.powers}

    def solo_winner(self) -> str | None:
        for power, n in self.centre_counts().items():
            if n >= SOLO_CENTRES:
                return power
        return None

    def is_eliminated(self, power: str) -> bool:
        p = self._engine.get_power(self.check_power(power))
        return not p.units and not p.centers and not p.retreats

    def state(self) -> dict[str, Any]:
        """The engine's state dict for the current phase (what a fork is built from)."""
        return dict(self._engine.get_state())

    # --------------------------------------------------------------- orders
    def all_legal_orders(self) -> dict[str, PowerOrders]:
        """Legal orders of every power, computed once per phase and shared with forks."""
        if self._legal is None:
            self._legal = compute_legal_orders(self._engine)
        return self._legal

    def legal_orders(self, power: str) -> PowerOrders:
        return self.all_legal_orders()[self.check_power(power)]

    def orderable_powers(self) -> tuple[str, ...]:
        return tuple(p for p, po in self.all_legal_orders().items() if po.kind is not PhaseKind.NONE)

    def step(self, orders: Mapping[str, Sequence[str]]) -> PhaseRecord:
        """Validate everyone's orders, adjudicate the phase and record it.

        Illegal, duplicate, malformed, excess and missing orders are replaced by defaults (hold,
        disband, waive) and reported in the returned record's `issues`; nothing is dropped silently.
        """
        if self.is_done:
            raise GameOverError(f"the game is over at {self.phase}")
        for power in orders:
            self.check_power(power)
        issues: list[OrderIssue] = []
        waives: dict[str, int] = {}
        disbanding: dict[str, tuple[str, ...]] = {}
        for power, legal in self.all_legal_orders().items():
            accepted, power_issues = validate_orders(legal, orders.get(power, ()))
            issues.extend(power_issues)
            waives[power] = accepted.count(WAIVE)
            if legal.kind is PhaseKind.DISBAND:
                disbanding[power] = self.units(power)
            if accepted:
                # Orders are validated against the engine's own lists: the fast path is safe.
                self._engine.set_orders(power, accepted, expand=False)
        data = self._engine.process()
        played = {p: list(o or ()) for p, o in data.orders.items()}
        # The engine's record of the phase leaves out two kinds of adjudicated orders: WAIVEs (its
        # `get_orders` filters them) and the disbands its civil-disorder rule adds during processing
        # (the orders are read before processing). Both are restored here so replays, prompts and
        # behavioural metrics see everything that was adjudicated.
        for power, n in waives.items():
            played.setdefault(power, []).extend([WAIVE] * n)
        civil_disorder: dict[str, list[str]] = {}
        for power, before in disbanding.items():
            ordered = {parse_order(o).unit for o in played.get(power, ())}
            removed = sorted(set(before) - set(self.units(power)) - ordered)
            civil_disorder[power] = [f"{unit} {DISBAND}" for unit in removed]
            played.setdefault(power, []).extend(civil_disorder[power])
        record = PhaseRecord(
            name=str(data.name),
            state=data.state,
            orders={p: tuple(sorted(o)) for p, o in sorted(played.items())},
            # The engine files a 'void' under the pseudo-unit "WAIVE" for every waived build it then
            # re-adds itself; a WAIVE has no unit and no outcome, so that entry is dropped.
            results={
                unit: tuple(str(c) for c in codes if str(c)) for unit, codes in data.results.items() if unit != WAIVE
            },
            issues=_name_civil_disorder_disbands(issues, civil_disorder),
        )
        self._history.append(record)
        self._legal = None
        return record

    # ----------------------------------------------------------------- forks
    def fork(self) -> DiplomacyGame:
        """An independent copy of the current state that shares this phase's legal orders."""
        engine = Game(map_name=self._engine.map_name, rules=list(self._engine.rules))
        engine.set_state(self._engine.get_state())
        # Not part of the state: in a retreat phase the engine reports 'disband' only for units in here.
        engine.dislodged = dict(self._engine.dislodged)
        child = DiplomacyGame(max_year=self.max_year, _engine=engine)
        child._history = list(self._history)
        child._legal = self._legal
        return child

    @classmethod
    def from_state(
        cls, state: Mapping[str, Any], *, max_year: int = DEFAULT_MAX_YEAR, map_name: str = "standard"
    ) -> DiplomacyGame:
        """Build a game at an arbitrary position (tests, replays, curricula)."""
        engine = Game(map_name=map_name)
        engine.set_state(dict(state))
        return cls(max_year=max_year, _engine=engine)
