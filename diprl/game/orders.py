"""Parsing of orders written in the engine's canonical form.

The engine's legal-order lists are the source of truth for what may be played; this parser only
turns one of those strings into fields so that bots, rewards and the support check can reason
about an order without re-deriving it from text each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

HOLD = "H"
MOVE = "-"
SUPPORT = "S"
CONVOY = "C"
RETREAT = "R"
DISBAND = "D"
BUILD = "B"
WAIVE = "WAIVE"


class OrderSyntaxError(ValueError):
    """Raised for text that is not an order in the engine's canonical form."""


@dataclass(frozen=True)
class Order:
    """One order. `unit` is "A PAR" / "F STP/SC"; `loc` is its province (no coast)."""

    text: str
    kind: str
    unit: str = ""
    target: str = ""
    via: bool = False
    supported_unit: str = ""
    supported_target: str = ""

    @property
    def loc(self) -> str:
        return self.unit[2:5] if self.unit else ""

    @property
    def target_province(self) -> str:
        return self.target[:3]

    @property
    def supports_move(self) -> bool:
        return self.kind == SUPPORT and bool(self.supported_target)

    @property
    def supports_hold(self) -> bool:
        return self.kind == SUPPORT and not self.supported_target


def _unit(words: list[str], i: int, text: str) -> str:
    if len(words) < i + 2 or words[i] not in ("A", "F"):
        raise OrderSyntaxError(f"expected a unit ('A LOC' or 'F LOC') in {text!r}")
    return f"{words[i]} {words[i + 1]}"


@lru_cache(maxsize=65536)
def parse_order(text: str) -> Order:
    """Parse a canonical order string ("A PAR - BUR", "F NTH C A LON - NWY", "WAIVE", ...)."""
    words = text.split()
    if words == [WAIVE]:
        return Order(text=text, kind=WAIVE)
    unit = _unit(words, 0, text)
    rest = words[2:]
    if not rest:
        raise OrderSyntaxError(f"order {text!r} has no action")
    head = rest[0]
    if head in (HOLD, DISBAND, BUILD) and len(rest) == 1:
        return Order(text=text, kind=head, unit=unit)
    if head in (MOVE, RETREAT) and len(rest) in (2, 3):
        via = len(rest) == 3
        if via and rest[2] != "VIA":
            raise OrderSyntaxError(f"unexpected word {rest[2]!r} in {text!r}")
        return Order(text=text, kind=head, unit=unit, target=rest[1], via=via)
    if head in (SUPPORT, CONVOY):
        other = _unit(rest, 1, text)
        tail = rest[3:]
        if not tail and head == SUPPORT:
            return Order(text=text, kind=SUPPORT, unit=unit, supported_unit=other)
        if len(tail) == 2 and tail[0] == MOVE:
            return Order(text=text, kind=head, unit=unit, supported_unit=other, supported_target=tail[1])
    raise OrderSyntaxError(f"cannot parse order {text!r}")
