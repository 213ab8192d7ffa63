"""Evaluation: playing benchmark games and reporting them with honest uncertainty.

- `stats`: interval math (Wilson, normal, bootstrap); `arena_games`: one game between agents and
  DipNet's outcome categories; `arena`: bot-vs-bot games in worker processes (`python -m diprl.arena`).
- `suite`: the fixed benchmark, any PolicyRef in any seat, LLM seats of all games batched per phase
  (`run_suite`, `SuiteConfig`; `python -m diprl.evaluate`); `behaviour`: how a seat plays;
  `crossplay`: a payoff matrix between policies with Nash weights and ratings; `plots`, `report`,
  `replays`: what is written; `evaluator`: the training run's `Evaluator` actor.
"""

from diprl.bots.base import seat_seed
from diprl.eval.arena_games import CATEGORIES, Category, GameRecord, categorize, play_game
from diprl.eval.stats import Z95, bootstrap_ci, mean_ci, wilson_interval
from diprl.eval.suite import SuiteConfig, run_suite, run_suites

__all__ = [
    "CATEGORIES",
    "Z95",
    "Category",
    "GameRecord",
    "SuiteConfig",
    "bootstrap_ci",
    "categorize",
    "mean_ci",
    "play_game",
    "run_suite",
    "run_suites",
    "seat_seed",
    "wilson_interval",
]
