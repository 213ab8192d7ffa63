"""Hand-made positions shared by the game-layer tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diplomacy import Game

from diprl.game import DEFAULT_MAX_YEAR, DiplomacyGame

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")

HOMES = {
    "AUSTRIA": ("BUD", "TRI", "VIE"),
    "ENGLAND": ("EDI", "LON", "LVP"),
    "FRANCE": ("BRE", "MAR", "PAR"),
    "GERMANY": ("BER", "KIE", "MUN"),
    "ITALY": ("NAP", "ROM", "VEN"),
    "RUSSIA": ("MOS", "SEV", "STP", "WAR"),
    "TURKEY": ("ANK", "CON", "SMY"),
}


def position(
    units: Mapping[str, Sequence[str]],
    centres: Mapping[str, Sequence[str]] | None = None,
    phase: str = "S1901M",
    max_year: int = DEFAULT_MAX_YEAR,
) -> DiplomacyGame:
    """A standard-map game with exactly these units (powers not named have none).

    `centres=None` gives every power its home centres; otherwise powers not named own none.
    A unit the engine does not accept (a typo) is a `ValueError`, not a silently missing unit.
    """
    probe = Game()
    owned = {p: probe.map.homes[p] for p in probe.powers} if centres is None else centres
    state = {
        "name": phase,
        "units": {p: list(units.get(p, ())) for p in probe.powers},
        "centers": {p: list(owned.get(p, ())) for p in probe.powers},
    }
    game = DiplomacyGame.from_state(state, max_year=max_year)
    wrong = [p for p in game.powers if game.units(p) != tuple(sorted(units.get(p, ())))]
    if game.engine.error or wrong or game.phase != phase:
        raise ValueError(f"position not accepted by the engine: {game.engine.error or wrong or game.phase}")
    return game


def without_timestamp(state: Mapping[str, Any]) -> dict[str, Any]:
    """An engine state dict minus its wall-clock timestamp, for equality checks."""
    return {k: v for k, v in state.items() if k != "timestamp"}


# S1901M: Germany's A MUN - BUR, supported by A RUH, dislodges France's holding A BUR; A HOL and
# England's F ENG bounce in BEL; France's A PAR holds. A BUR's neighbours are PAR, PIC, BEL, RUH, MUN,
# MAR and GAS: MUN is where the attack came from, RUH and PAR are occupied and BEL is a standoff, so
# A BUR may retreat to GAS, MAR or PIC only.
BURGUNDY_UNITS = {"FRANCE": ["A BUR", "A PAR"], "GERMANY": ["A MUN", "A RUH", "A HOL"], "ENGLAND": ["F ENG"]}
BURGUNDY_ORDERS = {
    "GERMANY": ["A MUN - BUR", "A RUH S A MUN - BUR", "A HOL - BEL"],
    "ENGLAND": ["F ENG - BEL"],
    "FRANCE": ["A BUR H", "A PAR H"],
}


def burgundy_retreat() -> DiplomacyGame:
    """The game at S1901R after the Burgundy attack above (stepped, so its history has S1901M)."""
    game = position(BURGUNDY_UNITS)
    record = game.step(BURGUNDY_ORDERS)
    assert record.issues == ()
    assert game.phase == "S1901R"
    return game
