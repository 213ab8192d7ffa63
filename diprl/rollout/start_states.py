"""A store of mid-game start states, so training also sees the years where games are won.

Forks from spring 1901 are scored a year later, while an evaluation plays to 1935 and solos come
late: a policy trained only on openings never learns the endgame. The store holds the engine states
of seeded rule-bot games (DumbBot, Territorial, Defensive and Random mixes: strong and weak play,
balanced and lopsided boards) at every movement and adjustment phase they reached, bucketed by year
and phase kind (a retreat cannot be a start: see `StartStates.add`). A match drawn from it
(`rollout.start_states`, a share of matches) starts at a year chosen uniformly among the years the store covers,
then a phase kind uniformly among those seen that year, then a state.

Built once per recipe and cached under the diprl cache (`start_states/<fingerprint>.json`, written
atomically); a changed recipe has another fingerprint and is built afresh. A corrupt cache file is
rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_file_atomic
from diprl.bots import make_agent
from diprl.cache import cache_root
from diprl.game import DiplomacyGame

log = logging.getLogger(__name__)

RECIPE_VERSION = 1  # bump when the way a store is built changes (the fingerprint then changes)
BOT_MIXES: tuple[tuple[str, ...], ...] = (
    ("dumbbot",) * 7,
    ("dumbbot", "dumbbot", "territorial", "territorial", "defensive", "random", "random"),
    ("territorial",) * 4 + ("defensive",) * 3,
    ("dumbbot",) + ("random",) * 6,
)


@dataclass(frozen=True)
class StartStateRecipe:
    """How a store is built: `games` seeded bot games per mix, played to `max_year` (or a solo)."""

    games: int = 8
    max_year: int = 1935
    seed: int = 0
    mixes: tuple[tuple[str, ...], ...] = BOT_MIXES

    def fingerprint(self) -> str:
        data = json.dumps({"version": RECIPE_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass
class StartStates:
    """States bucketed by year, then by phase type ('M' movement, 'A' adjustment)."""

    recipe: StartStateRecipe
    by_year: dict[int, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)

    @property
    def years(self) -> list[int]:
        return sorted(self.by_year)

    def __len__(self) -> int:
        return sum(len(states) for kinds in self.by_year.values() for states in kinds.values())

    def sample(self, rng: random.Random) -> dict[str, Any]:
        """A state: year uniform over the covered years, then phase kind, then state, all from `rng`."""
        if not self.by_year:
            raise ValueError("the start-state store is empty")
        kinds = self.by_year[rng.choice(self.years)]
        states = kinds[rng.choice(sorted(kinds))]
        return dict(rng.choice(states))

    def add(self, state: Mapping[str, Any]) -> None:
        """Keep a movement or adjustment state; retreat states are left out (a dislodged unit's
        retreat options are not part of the engine's state, so a game cannot start there)."""
        name = str(state["name"])
        year, kind = int(name[1:5]), name[-1]
        if kind not in ("M", "A"):
            return
        self.by_year.setdefault(year, {}).setdefault(kind, []).append(dict(state))

    def to_json(self) -> bytes:
        return json.dumps({"recipe": asdict(self.recipe), "by_year": self.by_year}).encode()


def build(recipe: StartStateRecipe) -> StartStates:
    """Play the recipe's games and keep every phase's state (a game that ends early keeps what it saw)."""
    store = StartStates(recipe)
    rng = random.Random(recipe.seed)
    for mix in recipe.mixes:
        for _ in range(recipe.games):
            game = DiplomacyGame(max_year=recipe.max_year)
            seats = list(mix)
            rng.shuffle(seats)
            agents = {
                p: make_agent(name, seed=rng.randrange(2**31)) for p, name in zip(game.powers, seats, strict=True)
            }
            while not game.is_done:
                store.add(game.state())
                game.step({p: agents[p].orders(game, p) for p in game.orderable_powers()})
    return store


def load_or_build(recipe: StartStateRecipe | None = None, root: Path | None = None) -> StartStates:
    """The cached store for `recipe`, built (and cached atomically) when missing or unreadable."""
    recipe = recipe or StartStateRecipe()
    path = (root or cache_root() / "start_states") / f"{recipe.fingerprint()}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            store = StartStates(recipe)
            for year, kinds in data["by_year"].items():
                store.by_year[int(year)] = {str(k): list(v) for k, v in kinds.items()}
            if store.by_year:
                return store
            log.warning("start-state cache %s is empty: rebuilding", path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("start-state cache %s is unreadable (%s): rebuilding", path, exc)
    store = build(recipe)
    write_file_atomic(path, store.to_json())
    return store
