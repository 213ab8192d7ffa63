"""A compact, deterministic text view of the board for prompts and traces.

Everything is sorted, so the text of one phase is identical for every power and every fork of
that phase: the board part of a prompt can then be shared by the prefix cache.
"""

from __future__ import annotations

from diprl.game.game import DiplomacyGame

_SEASONS = {"S": "spring", "F": "fall", "W": "winter"}
_TYPES = {"M": "movement", "R": "retreats", "A": "adjustments"}


def phase_title(game: DiplomacyGame) -> str:
    if not game.phase_type:
        return f"{game.phase} (game over)"
    return f"{game.phase} ({_SEASONS[game.season]} {game.year} {_TYPES[game.phase_type]})"


def board_text(game: DiplomacyGame) -> str:
    """Phase, then per power: centres, units, dislodged units; then unowned centres."""
    lines = [f"Phase: {phase_title(game)}"]
    owned: set[str] = set()
    for power in game.powers:
        centres = game.centres(power)
        owned.update(centres)
        units = ", ".join(game.units(power)) or "none"
        line = f"{power} ({len(centres)} centres: {' '.join(centres) or 'none'}) units: {units}"
        dislodged = game.dislodged(power)
        if dislodged:
            line += "; dislodged: " + ", ".join(
                f"{u} (may retreat to {' '.join(d) or 'nowhere'})" for u, d in dislodged.items()
            )
        lines.append(line)
    neutral = sorted(c.upper() for c in game.engine.map.scs if c.upper() not in owned)
    lines.append(f"Unowned centres: {' '.join(neutral) or 'none'}")
    return "\n".join(lines)


def last_phase_text(game: DiplomacyGame) -> str:
    """What happened last phase: each power's orders with their outcome when not a plain success."""
    if not game.history:
        return "Previous phase: none"
    record = game.history[-1]
    lines = [f"Previous phase: {record.name}"]
    for power, orders in record.orders.items():
        if not orders:
            continue
        parts = []
        for order in orders:
            unit = " ".join(order.split()[:2])
            codes = record.results.get(unit, ())
            parts.append(f"{order} [{', '.join(codes)}]" if codes else order)
        lines.append(f"{power}: " + "; ".join(parts))
    return "\n".join(lines)
