"""What an evaluation plays (`GamesConfig`) and the typed configuration of `python -m diprl.evaluate`.

`GamesConfig` is the one description of a suite's games: how many, to which year, from which seed,
and how LLM seats sample. Every evaluation config is built on it: a suite holds one (`SuiteConfig.play`),
so does the training run's evaluator (`EvaluatorConfig.play`), and the two configs read from the command
line extend it (`EvaluateConfig` here, `diprl.run.config.EvalScheduleConfig` for training) so that its
keys stay top-level overrides (`games=140`, `evaluation.games=14`); `games_config()` hands the games
part on, and nothing copies its fields one by one.

The evaluate command reads its config through Hydra's compose API rather than `@hydra.main`: it gets
Hydra's override grammar and the schema's checks (a typo'd key or a wrong type fails before anything
starts) but no working-directory change, output folders or logging takeover; `out=` decides where files go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from diprl.game import DEFAULT_MAX_YEAR
from diprl.rollout.search import SearchConfig
from diprl.structured_config import compose_structured, option_lines, overrides

SCHEMA_NAME = "evaluate_schema"

FIRST_YEAR = 1901
"""The standard game starts in spring 1901: a cap before that year would play nothing."""


def check_max_year(max_year: object) -> int:
    """`max_year` if a game capped there plays at least one phase, else a `ValueError` saying why."""
    if isinstance(max_year, bool) or not isinstance(max_year, int) or max_year < FIRST_YEAR:
        raise ValueError(
            f"max_year must be a year >= {FIRST_YEAR} (the game starts in spring {FIRST_YEAR}), got {max_year!r}"
        )
    return max_year


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class GamesConfig:
    """The games of a suite: game `i` has seed `seed * 100003 + i` and ends at a solo or after `max_year`.

    `temperature` and `max_tokens` apply to LLM seats only; `temperature` 0 is greedy decoding.
    `sampling_seed` (0 by default) gives every LLM seat's request its own sampling seed, from this
    stream, the game's seed, the power and the phase: the same policy plays the same games whatever
    else shares the engine's batch, so two evaluations differ only by their policies; another stream
    re-draws the LLM's samples on the same games (the noise floor of a paired comparison). None leaves
    sampling to the engine (not reproducible). The first `replays` games are written as replay JSON,
    SVG frames and an HTML viewer. `critical_supports` re-adjudicates each successful hero support (a
    few ms each) to tell critical from redundant ones. `search` (off by default: `search.candidates=0`) has
    an LLM hero decide its movement phases by one-ply search over its own samples, the others' orders
    modelled by its own policy (`diprl.rollout.search`); opponents and rule bots never search.
    """

    games: int = 140  # a multiple of 7 rotates the hero over every power equally
    max_year: int = DEFAULT_MAX_YEAR
    seed: int = 0
    temperature: float = 1.0  # LLM seats only; 0: greedy
    max_tokens: int = 384  # LLM seats only
    sampling_seed: int | None = 0  # LLM seats' sample stream (same games, other samples); null: the engine's
    replays: int = 0  # write replay JSON, SVG frames and an HTML viewer for the first N games
    critical_supports: bool = True  # re-adjudicate hero supports to find critical ones
    search: SearchConfig = field(default_factory=SearchConfig)  # the LLM hero's one-ply search; candidates=0: off

    def __post_init__(self) -> None:
        check_max_year(self.max_year)
        _positive("games", self.games)
        _positive("max_tokens", self.max_tokens)
        if isinstance(self.replays, bool) or not isinstance(self.replays, int) or not 0 <= self.replays <= self.games:
            raise ValueError(f"replays must be between 0 and games ({self.games}), got {self.replays!r}")
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not 0 <= self.temperature < math.inf
        ):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if not isinstance(self.search, SearchConfig):
            raise TypeError(f"search must be a SearchConfig, got {type(self.search).__name__}")
        if self.sampling_seed is not None and (
            isinstance(self.sampling_seed, bool) or not isinstance(self.sampling_seed, int) or self.sampling_seed < 0
        ):
            raise ValueError(f"sampling_seed must be an integer >= 0 or None, got {self.sampling_seed!r}")

    def overrides(self) -> list[str]:
        """These games as command-line overrides (`games=112`, `search.candidates=8`, `sampling_seed=null`):
        what hands them to `python -m diprl.evaluate` or `load_evaluate_config`."""
        return overrides(self.games_config())

    def games_config(self) -> GamesConfig:
        """The games part alone, from a config that extends this one (what a suite or the evaluator holds)."""
        return GamesConfig(**{f.name: getattr(self, f.name) for f in fields(GamesConfig)})


@dataclass
class EvaluateConfig(GamesConfig):
    """`python -m diprl.evaluate` options; every one is `key=value` on the command line (the games'
    keys, `games=140` and the rest, come from `GamesConfig`)."""

    policy: str = ""  # the hero PolicyRef: bot:<name>, base, or <policy>@v<N> (required)
    opponents: Any = "bot:dumbbot"  # one PolicyRef or a list [a,b]: the six other seats, round-robin
    workers: int = 1  # processes for bots-only suites
    crossplay: list[str] = field(default_factory=list)  # [refA,refB,...]: each as hero vs 6 of each other
    crossplay_games: int = 0  # games per ordered pair; 0: `games`
    # each pair's first N crossplay games as replays, under `out/crossplay_replays/<hero>_vs_<opponent>/`
    crossplay_replays: int = 0
    out: str = "runs/eval/latest"
    adapters: str = "runs/adapters"  # the AdapterStore holding <policy>@v<N> (standalone runs)
    server: str = "local"  # conf/inference/<name>.yaml: the PolicyServer started for LLM seats
    # conf/model/<name>.yaml the PolicyServer serves instead of the server file's (the preset the adapters were
    # trained on: served_model=tiny_wide for a rank-32 warm start); empty: the server file's own
    served_model: str = ""
    ray_cpus: int = 0  # CPUs for the local Ray started for LLM seats; 0: Ray's default
    progress: bool = True  # progress bar on stderr, drawn when stderr is a terminal
    verbose: bool = False  # library logs (Ray, vLLM) at INFO instead of WARNING


def option_help() -> list[str]:
    """`key=default` for every option, the command's own first, for `--help` (meanings: this module)."""
    games = [f.name for f in fields(GamesConfig)]
    return option_lines(EvaluateConfig(), [f.name for f in fields(EvaluateConfig) if f.name not in games] + games)


def load_evaluate_config(overrides: Sequence[str], conf_dir: Path | None = None) -> EvaluateConfig:
    """`conf/evaluate/default.yaml` with `overrides` (Hydra syntax) applied, as an `EvaluateConfig`.

    Errors come back as `ValueError` (`ConfigError`, but for `opponents`): Hydra's message for an unknown
    key, a wrong type or bad override syntax (it names the key), `GamesConfig`'s for a bad value
    (`games=0`, `max_year=1800`, ...).
    """
    config = compose_structured(EvaluateConfig, SCHEMA_NAME, "evaluate", overrides, conf_dir)
    if isinstance(config.opponents, list | tuple):
        config.opponents = [str(o) for o in config.opponents]
    elif not isinstance(config.opponents, str):
        raise ValueError(f"opponents must be a PolicyRef or a list of them, got {config.opponents!r}")
    return config
