"""The text the compact tokenizer is trained on: our own prompts, completions and legal orders.

A vocabulary fitted to what the policy actually reads and writes spells a prompt and an order in
far fewer ids than a general one, and a small vocabulary makes every sampled token cheap on a CPU
(vLLM draws sampling noise over the whole vocabulary per token). The corpus is every prompt of a
few seeded random-play games (every power, every phase kind: movement, retreats, builds,
disbands), the completion a policy would write for each (its orders, one a line, and the closing
tag), and every legal order seen, one a line.

Deterministic by construction: seeded `random.Random` streams, the engine's legal orders as
`diprl.game` sorts them, sorted sets, so the same recipe gives the same text whatever
`PYTHONHASHSEED` is, and the trained vocabulary is identical on every machine.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

from diprl.game.game import DiplomacyGame
from diprl.game.legal import PhaseKind
from diprl.game.randomplay import random_orders
from diprl.policy.prompt import CLOSE_TAG, build_prompt


@dataclass(frozen=True)
class CorpusRecipe:
    """Which games make the corpus. Six games to 1906 take about two seconds and already show
    every phase kind for every power's prompts; more games add little that BPE does not already see
    (board lines and orders repeat)."""

    games: int = 6
    max_year: int = 1906
    seed: int = 0

    def __post_init__(self) -> None:
        if self.games <= 0:
            raise ValueError(f"corpus games must be positive, got {self.games}")
        if self.max_year < 1901:
            raise ValueError(f"corpus max_year must be 1901 or later, got {self.max_year}")


REQUIRED_KINDS = frozenset({PhaseKind.MOVEMENT, PhaseKind.RETREAT, PhaseKind.BUILD, PhaseKind.DISBAND})


def _strip_special(text: str, special: Iterable[str]) -> list[str]:
    """The pieces of `text` between special tokens: those are matched whole by the tokenizer and
    must not feed BPE merges (a merge such as `<|im_end|>\\n` could never be produced anyway)."""
    pattern = re.compile("|".join(re.escape(s) for s in sorted(special, key=len, reverse=True)))
    return [piece for piece in pattern.split(text) if piece]


def corpus_texts(recipe: CorpusRecipe, special_tokens: Iterable[str]) -> list[str]:
    """The training texts, in a fixed order; `special_tokens` are cut out of the prompts.

    Raises `RuntimeError` when the games miss a phase kind: a recipe that cannot show the model a
    retreat or a disband prompt is a recipe error, not something to train on silently.
    """
    special = tuple(special_tokens)
    texts: list[str] = []
    orders: set[str] = set()
    kinds: set[PhaseKind] = set()
    for game_index in range(recipe.games):
        game = DiplomacyGame(max_year=recipe.max_year)
        rng = random.Random(recipe.seed * 1_000_003 + game_index)
        while not game.is_done:
            legal = game.all_legal_orders()
            chosen = random_orders(legal, rng)
            for power in game.orderable_powers():
                kinds.add(legal[power].kind)
                texts.extend(_strip_special(build_prompt(game, power).text, special))
                texts.append("".join(f"{order}\n" for order in chosen.get(power, ())) + CLOSE_TAG)
                for loc_orders in legal[power].by_loc.values():
                    orders.update(loc_orders)
            game.step(chosen)
    missing = REQUIRED_KINDS - kinds
    if missing:
        raise RuntimeError(
            f"corpus recipe {recipe} shows no {', '.join(sorted(k.value for k in missing))} phase: "
            "play more games or later years"
        )
    texts.extend(f"{order}\n" for order in sorted(orders))
    return texts
