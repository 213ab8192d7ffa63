"""Reading orders out of free (unconstrained) model text, for baselines and for diagnosing bad output.

Constrained decoding can only produce legal orders; an unconstrained model can write anything. This
parser keeps every legal order it can recover and gives every other line a reason code, so an
evaluation can tell a model that does not know the syntax (`not_an_order`) from one that does not
know the rules (`illegal`) or the protocol (`duplicate`, `excess`, `after_close`). Lenience is
limited to rewrites with exactly one reading (spacing, case, `->`, `HOLD`, a list bullet, an
omitted coast when only one coast is legal); everything else is rejected, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from diprl.game.legal import PhaseKind, PowerOrders
from diprl.game.orders import (
    BUILD,
    CONVOY,
    DISBAND,
    HOLD,
    MOVE,
    RETREAT,
    SUPPORT,
    WAIVE,
    Order,
    OrderSyntaxError,
    parse_order,
)


class RejectReason(StrEnum):
    NOT_AN_ORDER = "not_an_order"
    ILLEGAL = "illegal"
    AMBIGUOUS_COAST = "ambiguous_coast"
    DUPLICATE = "duplicate"
    EXCESS = "excess"
    AFTER_CLOSE = "after_close"


@dataclass(frozen=True)
class RejectedLine:
    """A line of the completion that was not accepted; `reason` is a `RejectReason` code."""

    line: str
    reason: RejectReason
    message: str


@dataclass
class ParsedOrders:
    """What a completion amounts to.

    `orders` are canonical legal orders in the order written. `missing` lists the orderable
    provinces left without an order; in adjustment phases, where only `n_required` of the sites
    or units need an order, it lists the unordered ones only while fewer than `n_required` orders
    were given (`n_missing` is then the shortfall). `closed` says whether `</orders>` was written.
    """

    orders: list[str] = field(default_factory=list)
    rejected: list[RejectedLine] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    closed: bool = False
    n_missing: int = 0


_OPEN_RE = re.compile(r"<orders>", re.IGNORECASE)
_CLOSE_RE = re.compile(r"</orders>", re.IGNORECASE)
_THINK_END = "</think>"
# Chat markers a decoder may leave in the text when special tokens are not skipped: not model content.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_BULLET_RE = re.compile(r"^(?:[-*•]|\d+[.)])\s*")
_ARROW_RE = re.compile(r"\s*(?:->|=>|→|–|—|-)\s*")
_WORDS = {
    "HOLD": HOLD,
    "HOLDS": HOLD,
    "SUPPORT": SUPPORT,
    "SUPPORTS": SUPPORT,
    "CONVOY": CONVOY,
    "CONVOYS": CONVOY,
    "RETREAT": RETREAT,
    "RETREATS": RETREAT,
    "DISBAND": DISBAND,
    "DISBANDS": DISBAND,
    "BUILD": BUILD,
    "BUILDS": BUILD,
}
_KINDS_BY_PHASE = {
    PhaseKind.MOVEMENT: {HOLD, MOVE, SUPPORT, CONVOY},
    PhaseKind.RETREAT: {RETREAT, DISBAND},
    PhaseKind.BUILD: {BUILD},
    PhaseKind.DISBAND: {DISBAND},
    PhaseKind.NONE: set(),
}
_KIND_NAMES = {
    HOLD: "hold",
    MOVE: "move",
    SUPPORT: "support",
    CONVOY: "convoy",
    RETREAT: "retreat",
    DISBAND: "disband",
    BUILD: "build",
}


def normalise_line(line: str) -> str:
    """Canonical spelling of one line: list bullet dropped, upper case, single spaces, ' - ' moves,
    words such as HOLD shortened to the engine's letters, a trailing full stop dropped."""
    text = _BULLET_RE.sub("", line.strip()).upper().rstrip(".,;")
    text = _ARROW_RE.sub(" - ", text)
    return " ".join(_WORDS.get(word, word) for word in text.split())


def _words_match(written: str, legal: str) -> bool:
    """Whether a legal order reads as `written` once the coasts `written` omits are filled in."""
    a, b = written.split(), legal.split()
    return len(a) == len(b) and all(
        x == y or ("/" not in x and y.split("/")[0] == x) for x, y in zip(a, b, strict=True)
    )


def _extract(text: str) -> tuple[str, str, bool]:
    """Split a completion into the order region, the text after the close tag, and whether it closed."""
    if _THINK_END in text:
        text = text.rsplit(_THINK_END, 1)[1]
    opened = _OPEN_RE.search(text)
    if opened is not None:
        text = text[opened.end() :]
    closed = _CLOSE_RE.search(text)
    if closed is None:
        return text, "", False
    after = text[closed.end() :]
    for marker in _END_MARKERS:
        after = after.replace(marker, "")
    return text[: closed.start()], after, True


def _why_illegal(order: Order, legal: PowerOrders) -> str:
    """The most specific reason we can give without the board: wrong phase, not our unit, bad move."""
    power, phase = legal.power, legal.phase
    if order.kind not in _KINDS_BY_PHASE[legal.kind]:
        return f"a {_KIND_NAMES[order.kind]} order is not allowed in a {legal.kind.value} phase ({phase})"
    options = legal.by_loc.get(order.loc)
    if options is None:
        if legal.kind is PhaseKind.BUILD:
            return f"{order.loc} is not a build site of {power} in {phase}"
        if legal.kind is PhaseKind.RETREAT:
            return f"no dislodged unit of {power} at {order.loc}"
        return f"no unit of {power} at {order.loc}"
    unit = " ".join(options[0].split()[:2])
    if legal.kind is not PhaseKind.BUILD and not _words_match(order.unit, unit):
        return f"{power}'s unit at {order.loc} is {unit}, not {order.unit}"
    if order.kind in (MOVE, RETREAT):
        targets = {parse_order(o).target_province for o in options if parse_order(o).kind == order.kind}
        if order.target_province not in targets:
            verb = "retreat" if order.kind == RETREAT else "move"
            return f"{unit} cannot {verb} to {order.target_province}"
    return f"not a legal order for {unit} in {phase}"


def _resolve(text: str, legal: PowerOrders) -> str | tuple[RejectReason, str]:
    """Map a normalised line to a legal order, or give the reason code and message why it is not one."""
    if text in legal.loc_of or (text == WAIVE and legal.allows_waive):
        return text
    try:
        order = parse_order(text)
    except OrderSyntaxError:
        return RejectReason.NOT_AN_ORDER, f"cannot read {text!r} as an order"
    if legal.kind is PhaseKind.NONE:
        return RejectReason.ILLEGAL, f"{legal.power} has nothing to order in {legal.phase}"
    if order.kind == WAIVE:
        return RejectReason.ILLEGAL, f"WAIVE is only for builds, and {legal.phase} is a {legal.kind.value} phase"
    matches = [o for o in legal.by_loc.get(order.loc, ()) if _words_match(text, o)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        return RejectReason.AMBIGUOUS_COAST, f"{text!r} could be {' or '.join(matches)}: name the coast"
    return RejectReason.ILLEGAL, _why_illegal(order, legal)


def parse_orders(text: str, legal: PowerOrders) -> ParsedOrders:
    """Parse a completion against one power's legal orders.

    Only the region between `<orders>` and `</orders>` is read when the tags are there (text before
    `<orders>`, such as reasoning, is ignored); without an opening tag every line is read. At most
    one order per unit or site is kept, at most `n_required` in adjustment phases, and WAIVE only
    in build phases.
    """
    body, after, closed = _extract(text)
    parsed = ParsedOrders(closed=closed)
    used: dict[str, str] = {}
    n_waive = 0
    is_adjustment = legal.kind in (PhaseKind.BUILD, PhaseKind.DISBAND)
    for raw in body.splitlines():
        line = normalise_line(raw)
        if not line:
            continue
        order = _resolve(line, legal)
        if isinstance(order, tuple):
            parsed.rejected.append(RejectedLine(raw.strip(), *order))
            continue
        loc = None if order == WAIVE else legal.loc_of[order]
        if loc is not None and loc in used:
            message = f"{loc} already ordered: {used[loc]!r}"
            parsed.rejected.append(RejectedLine(raw.strip(), RejectReason.DUPLICATE, message))
            continue
        if is_adjustment and len(parsed.orders) >= legal.n_required:
            message = f"{legal.phase} takes {legal.n_required} {legal.kind.value} order(s)"
            parsed.rejected.append(RejectedLine(raw.strip(), RejectReason.EXCESS, message))
            continue
        if loc is None:
            n_waive += 1
        else:
            used[loc] = order
        parsed.orders.append(order)
    for raw in after.splitlines():
        if raw.strip():
            parsed.rejected.append(
                RejectedLine(raw.strip(), RejectReason.AFTER_CLOSE, f"text after {_CLOSE_RE.pattern} is not read")
            )
    unordered = [loc for loc in legal.locs if loc not in used]
    parsed.n_missing = max(0, legal.n_required - len(parsed.orders))
    parsed.missing = unordered if parsed.n_missing else []
    return parsed


def legal_complete(parsed: ParsedOrders, legal: PowerOrders) -> bool:
    """A completion that needs no repair: closed, nothing rejected, every required order given."""
    return parsed.closed and not parsed.rejected and len(parsed.orders) == legal.n_required and not parsed.missing
