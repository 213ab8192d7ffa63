"""Checking submitted orders against the legal lists before the engine sees them.

The engine drops bad orders silently (the unit holds, a note goes to `game.error`). Here every
rejected or missing order is replaced by its default and reported with a reason, so a policy's
mistakes are visible in traces and never confused with a deliberate hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from diprl.game.legal import PhaseKind, PowerOrders
from diprl.game.orders import WAIVE


class IssueKind(StrEnum):
    MALFORMED = "malformed"
    ILLEGAL = "illegal"
    DUPLICATE = "duplicate"
    EXCESS = "excess"
    MISSING = "missing"
    UNORDERABLE = "unorderable"


@dataclass(frozen=True)
class OrderIssue:
    """A submitted order that was not played as written, or an order that was never submitted."""

    power: str
    kind: IssueKind
    order: str
    detail: str
    replacement: str = ""


def _normalise(order: object) -> str | None:
    if not isinstance(order, str):
        return None
    text = " ".join(order.split()).upper()
    return text or None


def validate_orders(legal: PowerOrders, submitted: Sequence[object]) -> tuple[list[str], list[OrderIssue]]:
    """Return the orders to play (defaults filled in) and an issue for each deviation."""
    power, issues, accepted = legal.power, [], []
    if isinstance(submitted, str):
        submitted = [submitted]
    if legal.kind is PhaseKind.NONE:
        for order in submitted:
            issues.append(
                OrderIssue(power, IssueKind.UNORDERABLE, str(order), f"{power} has nothing to order in {legal.phase}")
            )
        return [], issues

    used: dict[str, str] = {}
    n_waive = 0
    is_adjustment = legal.kind in (PhaseKind.BUILD, PhaseKind.DISBAND)
    for raw in submitted:
        order = _normalise(raw)
        if order is None:
            issues.append(OrderIssue(power, IssueKind.MALFORMED, repr(raw), "not a non-empty string"))
            continue
        is_waive = order == WAIVE and legal.allows_waive
        loc = None if is_waive else legal.loc_of.get(order)
        if loc is None and not is_waive:
            issues.append(
                OrderIssue(power, IssueKind.ILLEGAL, order, f"not a legal order for {power} in {legal.phase}")
            )
            continue
        if loc in used:
            issues.append(OrderIssue(power, IssueKind.DUPLICATE, order, f"{loc} already ordered: {used[loc]!r}"))
            continue
        if is_adjustment and len(used) + n_waive >= legal.n_required:
            issues.append(
                OrderIssue(
                    power,
                    IssueKind.EXCESS,
                    order,
                    f"{legal.phase} takes {legal.n_required} {legal.kind.value} order(s)",
                )
            )
            continue
        if loc is None:  # a WAIVE
            n_waive += 1
            accepted.append(order)
            continue
        used[loc] = order
        accepted.append(order)

    if legal.kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        for loc in legal.locs:
            if loc not in used:
                default = legal.default_order(loc)
                accepted.append(default)
                issues.append(OrderIssue(power, IssueKind.MISSING, "", f"no order for {loc}", default))
    else:
        missing = legal.n_required - len(used) - n_waive
        for _ in range(missing):
            if legal.kind is PhaseKind.BUILD:
                accepted.append(WAIVE)
                issues.append(OrderIssue(power, IssueKind.MISSING, "", "build not ordered", WAIVE))
            else:
                issues.append(
                    OrderIssue(
                        power,
                        IssueKind.MISSING,
                        "",
                        "disband not ordered: the engine's civil-disorder rule picks the unit",
                    )
                )
    return accepted, issues
