"""Replay export: the engine's saved-game JSON (from this wrapper's own history, so forks export
completely) and an SVG of any phase through the engine's renderer."""

from __future__ import annotations

from typing import Any

from diplomacy import Game
from diplomacy.engine.renderer import Renderer

from diprl.game.game import DiplomacyGame


def _phase_dict(
    name: str, state: Any, orders: Any, results: Any, map_name: str, rules: list[str], game_id: str
) -> dict[str, Any]:
    state = dict(state)
    state.update({"game_id": game_id, "map": map_name, "rules": rules})
    return {
        "name": name,
        "state": state,
        "orders": {p: list(o) for p, o in orders.items()},
        "results": {u: list(r) for u, r in results.items()},
        "messages": {},
    }


def to_saved_game(game: DiplomacyGame, game_id: str = "diprl") -> dict[str, Any]:
    """The engine's saved-game format; `diplomacy.utils.export.from_saved_game_format` loads it."""
    engine = game.engine
    rules = [
        r for r in engine.rules if r not in ("SOLITAIRE", "NO_DEADLINE", "CD_DUMMIES", "ALWAYS_WAIT", "IGNORE_ERRORS")
    ]
    phases = [_phase_dict(r.name, r.state, r.orders, r.results, engine.map_name, rules, game_id) for r in game.history]
    phases.append(_phase_dict(game.phase, engine.get_state(), {}, {}, engine.map_name, rules, game_id))
    return {"id": game_id, "map": engine.map_name, "rules": rules, "phases": phases}


def render_svg(game: DiplomacyGame, phase: str | None = None, incl_orders: bool = True) -> str:
    """SVG of `phase` (a processed phase of the history, or the current one) with its orders."""
    if phase is None or phase == game.phase:
        return str(Renderer(game.engine).render(incl_orders=incl_orders))
    record = next((r for r in game.history if r.name == phase), None)
    if record is None:
        raise KeyError(f"phase {phase!r} is not in this game's history ({len(game.history)} phases)")
    engine = Game(map_name=game.engine.map_name)
    engine.set_state(dict(record.state))
    if incl_orders:
        for power, orders in record.orders.items():
            engine.set_orders(power, list(orders), expand=False)
    return str(Renderer(engine).render(incl_orders=incl_orders))
