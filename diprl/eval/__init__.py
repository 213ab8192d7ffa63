"""Evaluation: playing benchmark games and reporting them with honest uncertainty.

`stats` holds the pure interval math (Wilson, normal, bootstrap); `arena_games` the reusable
game loop and DipNet's outcome categories; `arena` bot-vs-bot games in worker processes (CLI:
`python -m diprl.arena`).
"""

from diprl.eval.arena_games import CATEGORIES, Category, GameRecord, categorize, play_game, seat_seed
from diprl.eval.stats import Z95, bootstrap_ci, mean_ci, wilson_interval

__all__ = [
    "CATEGORIES",
    "Z95",
    "Category",
    "GameRecord",
    "bootstrap_ci",
    "categorize",
    "mean_ci",
    "play_game",
    "seat_seed",
    "wilson_interval",
]
