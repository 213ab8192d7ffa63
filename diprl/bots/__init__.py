"""Rule bots behind one `Agent` protocol. Pure Python: no torch, ray or vllm here."""

from __future__ import annotations

from collections.abc import Callable

from diprl.bots.base import Agent, SeededAgent
from diprl.bots.dumbbot import DumbBot
from diprl.bots.simple import ChaosBot, DefensiveBot, HoldBot, RandomBot, TerritorialBot

_REGISTRY: dict[str, Callable[[int], Agent]] = {
    "random": RandomBot,
    "hold": HoldBot,
    "chaos": ChaosBot,
    "territorial": TerritorialBot,
    "defensive": DefensiveBot,
    "dumbbot": DumbBot,
}
BOT_NAMES: tuple[str, ...] = tuple(_REGISTRY)


class UnknownBotError(ValueError):
    """Raised for a bot name that is not registered."""


def make_agent(name: str, seed: int = 0) -> Agent:
    """A fresh bot by name, with its own seeded random stream."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownBotError(f"unknown bot {name!r}; known bots: {', '.join(BOT_NAMES)}") from None
    return factory(seed)


__all__ = [
    "BOT_NAMES",
    "Agent",
    "ChaosBot",
    "DefensiveBot",
    "DumbBot",
    "HoldBot",
    "RandomBot",
    "SeededAgent",
    "TerritorialBot",
    "UnknownBotError",
    "make_agent",
]
