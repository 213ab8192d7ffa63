"""Game layer: the `diplomacy` engine behind legal-order lists, validated steps, cheap forks,
outcomes, scoring, text and replays. Pure Python: no torch, ray or vllm here."""

from diprl.game.game import DEFAULT_MAX_YEAR, SOLO_CENTRES, DiplomacyGame, GameOverError, PhaseRecord, UnknownPowerError
from diprl.game.legal import PhaseKind, PowerOrders, compute_legal_orders
from diprl.game.randomplay import random_orders, random_power_orders
from diprl.game.validate import IssueKind, OrderIssue, validate_orders

__all__ = [
    "DEFAULT_MAX_YEAR",
    "SOLO_CENTRES",
    "DiplomacyGame",
    "GameOverError",
    "IssueKind",
    "OrderIssue",
    "PhaseKind",
    "PhaseRecord",
    "PowerOrders",
    "UnknownPowerError",
    "compute_legal_orders",
    "random_orders",
    "random_power_orders",
    "validate_orders",
]
