"""Per-unit order outcomes and the counterfactual support check.

The engine reports a decisive and a redundant support both as success. To learn which supports
mattered, the phase is re-adjudicated on a fork with the supporter holding instead: if the
supported order then fails, the support was critical. This is what lets rewards push void
supports down and critical supports up.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

from diprl.game.game import DiplomacyGame, PhaseRecord
from diprl.game.orders import MOVE, SUPPORT, parse_order

SUCCESS = "success"


class SupportVerdict(StrEnum):
    CRITICAL = "critical"  # succeeded, and the supported order fails without it
    REDUNDANT = "redundant"  # succeeded, and the supported order succeeds without it too
    FUTILE = "futile"  # given, but the supported order failed anyway
    VOID = "void"  # the supported unit did not do what was supported
    CUT = "cut"  # cut by an attack (or the supporter was dislodged)


def outcome(results: Mapping[str, Sequence[str]], unit: str) -> str:
    """A unit's outcome as one label: 'success' or the engine's first result code."""
    codes = results.get(unit, ())
    return codes[0] if codes else SUCCESS


def _unit_at(orders_by_unit: Mapping[str, str], unit: str) -> str:
    """Resolve a supported unit written without its coast ("F SPA") to the unit on the board."""
    if unit in orders_by_unit:
        return unit
    for candidate in orders_by_unit:
        if candidate[:5] == unit[:5]:
            return candidate
    return unit


def _supported_succeeded(results: Mapping[str, Sequence[str]], supported_unit: str, is_move: bool) -> bool:
    codes = results.get(supported_unit, ())
    if is_move:
        return not codes
    return "dislodged" not in codes


def classify_supports(
    before: DiplomacyGame, record: PhaseRecord, powers: Collection[str] | None = None
) -> dict[str, SupportVerdict]:
    """Classify the support orders of a processed movement phase (of `powers` only, when given).

    `before` is a fork taken before `record`'s phase was stepped; it is not modified. Each
    successful support costs one re-adjudication of a fork (a few ms), so callers that reward one
    power should name it.
    """
    if before.phase != record.name or before.phase_type != "M":
        raise ValueError(
            f"`before` is at {before.phase} but the record is of {record.name}: "
            "classify_supports needs a fork taken before that movement phase was stepped"
        )
    orders_by_unit: dict[str, str] = {}
    classify: set[str] = set()
    for power, orders in record.orders.items():
        for text in orders:
            order = parse_order(text)
            orders_by_unit[order.unit] = text
            if order.kind == SUPPORT and (powers is None or power in powers):
                classify.add(order.unit)
    verdicts: dict[str, SupportVerdict] = {}
    for unit, text in orders_by_unit.items():
        if unit not in classify:
            continue
        order = parse_order(text)
        codes = record.results.get(unit, ())
        if "void" in codes:
            verdicts[unit] = SupportVerdict.VOID
            continue
        if "cut" in codes or "dislodged" in codes:
            verdicts[unit] = SupportVerdict.CUT
            continue
        supported = _unit_at(orders_by_unit, order.supported_unit)
        is_move = order.supports_move
        if not _supported_succeeded(record.results, supported, is_move):
            verdicts[unit] = SupportVerdict.FUTILE
            continue
        without = {p: [o if o != text else f"{unit} H" for o in orders] for p, orders in record.orders.items()}
        counterfactual = before.fork().step(without)
        succeeded = _supported_succeeded(counterfactual.results, supported, is_move)
        verdicts[unit] = SupportVerdict.REDUNDANT if succeeded else SupportVerdict.CRITICAL
    return verdicts


def moved(record: PhaseRecord, unit: str) -> bool:
    """True when `unit` was ordered to move and the move succeeded."""
    for orders in record.orders.values():
        for text in orders:
            order = parse_order(text)
            if order.unit == unit:
                return order.kind == MOVE and not record.results.get(unit)
    return False
