"""Evaluation: playing benchmark games and reporting them with honest uncertainty.

- `config`: `GamesConfig`, what a suite plays (every evaluation config holds or extends it), and the
  evaluate command's config; `stats`: interval math (Wilson, normal, bootstrap); `records`: a finished
  game's record and DipNet's outcome categories.
- `suite`: the one evaluation engine, any PolicyRef in any seat, LLM seats of all games batched per
  phase, bots-only runs in worker processes (`run_suite`, `SuiteConfig`; `python -m diprl.evaluate`,
  `python -m diprl.arena` and `ladder` are thin callers); `behaviour`: how a seat plays;
  `crossplay`: a payoff matrix between policies with Nash weights and ratings; `plots`, `report`,
  `replays`: what is written; `evaluator`: the training run's `Evaluator` actor.
"""

from diprl.bots.base import seat_seed
from diprl.eval.config import GamesConfig
from diprl.eval.records import CATEGORIES, Category, GameRecord, categorize
from diprl.eval.stats import Z95, bootstrap_ci, mean_ci, wilson_interval
from diprl.eval.suite import SuiteConfig, bot_suite, run_suite, run_suites

__all__ = [
    "CATEGORIES",
    "Z95",
    "Category",
    "GameRecord",
    "GamesConfig",
    "SuiteConfig",
    "bootstrap_ci",
    "bot_suite",
    "categorize",
    "mean_ci",
    "run_suite",
    "run_suites",
    "seat_seed",
    "wilson_interval",
]
