"""Teacher data: games played by worker processes, split by game and by state, stratified when capped.

Bot games are cheap but not free (about a second per game to 1906, a third of it building prompts),
so games are played by a pool of worker processes, each holding the tokenizer, and come back
tokenized, in game order: the data do not depend on the number of workers.

Held-out states come from whole held-out games: positions of one game are strongly correlated, and
a split by state alone would leak them into the evaluation. Different games still meet the same
states (every game opens on the same board, and bots play the same openings), so a held-out
decision whose state (power and prompt) also occurs in a training game is dropped too: held out by
game and by state.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diprl.imitation.strata import strata_counts, stratified_sample
from diprl.imitation.teacher import (
    COMPLETION_ORDERS,
    PHASE_CLASSES,
    TeacherError,
    TeacherExample,
    game_opponent,
    play_teacher_game,
    teacher_bot,
    tokenize,
)
from diprl.policy.prompt import PromptOptions
from diprl.policy.vocab import TokenTable

SPLITS = ("train", "heldout")


@dataclass
class TeacherConfig:
    """Which games to play and which decisions to keep.

    `opponents` (rule bots) play the teacher's rivals in turn, game by game; empty: the teacher plays
    all seven seats. `train_examples` / `heldout_examples` cap the kept decisions per split (None
    keeps all); the cap is shared over the 7 x 3 (power, phase class) strata by `class_weights`,
    equally over powers, and what a small stratum cannot use goes to the others. `workers` and
    `shard_size` change how the data are made and stored, never what they are.
    """

    teacher: str = "dumbbot"
    opponents: list[str] = field(default_factory=list)
    games: int = 20
    heldout_games: int | None = None  # default: a fifth of the games, at least 1
    max_year: int = 1905
    seed: int = 0
    train_examples: int | None = None
    heldout_examples: int | None = 200
    class_weights: dict[str, float] = field(
        default_factory=lambda: {"movement": 0.5, "retreat": 0.2, "adjustment": 0.3}
    )
    max_prompt_tokens: int = 1536
    # The fixed order the teacher's lines are written in (`diprl.imitation.teacher.COMPLETION_ORDERS`).
    completion_order: str = "province"
    # Prompts with the centres in reach (`diprl.policy.prompt.PromptOptions.reach_hints`): an experiment's
    # option. A body trained on them must be served with them, and no runtime writes them yet.
    reach_hints: bool = False
    shard_size: int = 4096  # examples per shard file
    workers: int = 0  # processes playing the games; 0: one per CPU core

    def __post_init__(self) -> None:
        teacher_bot(self.teacher)
        for opponent in self.opponents:
            teacher_bot(opponent)
        problems = []
        if self.games < 2:
            problems.append(f"games must be >= 2 (one to train on, one held out), got {self.games}")
        if self.heldout_games is not None and not 1 <= self.heldout_games < self.games:
            problems.append(f"heldout_games must be in [1, games), got {self.heldout_games} of {self.games}")
        if self.max_year < 1901:
            problems.append(f"max_year must be >= 1901, got {self.max_year}")
        for name in ("train_examples", "heldout_examples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be positive or null, got {value}")
        unknown = sorted(set(self.class_weights) - set(PHASE_CLASSES))
        if unknown or any(w < 0 for w in self.class_weights.values()) or not any(self.class_weights.values()):
            problems.append(f"class_weights needs non-negative weights over {PHASE_CLASSES}, got {self.class_weights}")
        if self.max_prompt_tokens < 1:
            problems.append(f"max_prompt_tokens must be positive, got {self.max_prompt_tokens}")
        if self.completion_order not in COMPLETION_ORDERS:
            problems.append(f"completion_order must be one of {COMPLETION_ORDERS}, got {self.completion_order!r}")
        if self.shard_size < 1:
            problems.append(f"shard_size must be positive, got {self.shard_size}")
        if self.workers < 0:
            problems.append(f"workers must be >= 0 (0: one per CPU core), got {self.workers}")
        if problems:
            raise TeacherError("teacher config: " + "; ".join(problems))

    @property
    def n_heldout_games(self) -> int:
        return self.heldout_games if self.heldout_games is not None else max(1, self.games // 5)

    @property
    def n_workers(self) -> int:
        return max(1, min(self.workers or os.cpu_count() or 1, self.games))

    def content(self) -> dict[str, Any]:
        """The settings that decide the data (what a cache is keyed on): all but workers and shard size."""
        out = asdict(self)
        for name in ("workers", "shard_size"):
            out.pop(name)
        if not self.reach_hints:  # data made before the option existed keep their key
            out.pop("reach_hints")
        out["teacher"] = teacher_bot(self.teacher)
        out["opponents"] = [teacher_bot(o) for o in self.opponents]
        return out


@dataclass
class TeacherData:
    """The examples of both splits and what was generated (written to the manifest)."""

    train: list[TeacherExample]
    heldout: list[TeacherExample]
    summary: dict[str, Any]

    def split(self, name: str) -> list[TeacherExample]:
        if name not in SPLITS:
            raise TeacherError(f"unknown split {name!r}; splits are {SPLITS}")
        return self.train if name == "train" else self.heldout


def heldout_game_indices(config: TeacherConfig) -> list[int]:
    """Which games are held out: a seeded choice, so neither split is biased to early or late seeds."""
    rng = random.Random(f"heldout:{config.seed}")
    return sorted(rng.sample(range(config.games), config.n_heldout_games))


@dataclass
class GameExamples:
    """One game's examples with the state key of each, and how many prompts were too long to keep."""

    examples: list[TeacherExample]
    state_keys: list[str]
    too_long: int


def game_examples(index: int, split: str, config: TeacherConfig, tokenizer: Any, table: TokenTable) -> GameExamples:
    """Play game `index` and tokenize every decision (prompts over `max_prompt_tokens` are counted, not kept)."""
    bot = teacher_bot(config.teacher)
    opponent = game_opponent(bot, [teacher_bot(o) for o in config.opponents], index)
    out = GameExamples([], [], 0)
    options = PromptOptions(reach_hints=config.reach_hints)
    for decision in play_teacher_game(bot, opponent, index, config.seed, config.max_year, options):
        example = tokenize(
            decision, split, bot, opponent, tokenizer, table, config.max_prompt_tokens, config.completion_order
        )
        if example is None:
            out.too_long += 1
            continue
        out.examples.append(example)
        out.state_keys.append(decision.state_key)
    return out


_WORKER: dict[str, Any] = {}
"""What a worker process holds for all its games (set once by the pool's initializer)."""


def _init_worker(config: TeacherConfig, tokenizer: Any, table: TokenTable) -> None:
    _WORKER.update(config=config, tokenizer=tokenizer, table=table)


def _worker_game(job: tuple[int, str]) -> GameExamples:
    return game_examples(job[0], job[1], **_WORKER)


def _spawnable() -> bool:
    """Whether spawned workers can start: they re-import the main module from its file, and a main read
    from stdin has none (its workers would die before taking a game)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return path is None or Path(path).is_file()


def play_games(
    config: TeacherConfig, jobs: Sequence[tuple[int, str]], tokenizer: Any, table: TokenTable, progress: Any = None
) -> list[GameExamples]:
    """Every job's `GameExamples`, in job order, from `config.n_workers` processes (in this one for 1).

    Workers are spawned, not forked: the caller may hold torch's thread pools, which do not survive a fork.
    """
    workers = min(config.n_workers, len(jobs)) if _spawnable() else 1
    if workers <= 1:
        results = []
        for index, split in jobs:
            results.append(game_examples(index, split, config, tokenizer, table))
            if progress is not None:
                progress(1)
        return results
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, context, initializer=_init_worker, initargs=(config, tokenizer, table)) as pool:
        results = []
        for result in pool.map(_worker_game, jobs, chunksize=2):
            results.append(result)
            if progress is not None:
                progress(1)
    return results


def generate(
    config: TeacherConfig, tokenizer: Any, table: TokenTable, progress: Callable[[int], Any] | None = None
) -> TeacherData:
    """Play `config.games` teacher games and keep their decisions as examples of the two splits.

    `progress`, if given, is called once per finished game (e.g. a progress bar's `update`).
    """
    start = time.perf_counter()
    heldout = set(heldout_game_indices(config))
    jobs = [(index, "heldout" if index in heldout else "train") for index in range(config.games)]
    results = play_games(config, jobs, tokenizer, table, progress)
    pools: dict[str, list[TeacherExample]] = {split: [] for split in SPLITS}
    train_states: set[str] = set()
    for (_, split), result in zip(jobs, results, strict=True):
        pools[split].extend(result.examples)
        if split == "train":
            train_states.update(result.state_keys)
    unseen = [
        e
        for (_, split), result in zip(jobs, results, strict=True)
        if split == "heldout"
        for e, key in zip(result.examples, result.state_keys, strict=True)
        if key not in train_states
    ]
    seen_in_train = len(pools["heldout"]) - len(unseen)
    pools["heldout"] = unseen
    decisions = {split: len(pools[split]) for split in SPLITS}
    rng = random.Random(f"sample:{config.seed}")
    kept = {
        split: stratified_sample(
            pools[split],
            config.train_examples if split == "train" else config.heldout_examples,
            config.class_weights,
            rng,
        )
        for split in SPLITS
    }
    seconds = time.perf_counter() - start
    content = config.content()
    summary = {
        "teacher": content["teacher"],
        "opponents": content["opponents"],
        "games": config.games,
        "heldout_games": sorted(heldout),
        "decisions": decisions,
        "heldout_seen_in_train": seen_in_train,  # held-out decisions dropped: their state is in a training game
        "examples": {split: len(kept[split]) for split in SPLITS},
        "skipped_too_long": sum(r.too_long for r in results),
        "strata": {split: strata_counts(kept[split]) for split in SPLITS},
        "generate_s": seconds,
        "workers": min(config.n_workers, len(jobs)),
        "decisions_per_s": sum(len(r.examples) + r.too_long for r in results) / max(seconds, 1e-9),
        "config": content,
    }
    return TeacherData(train=kept["train"], heldout=kept["heldout"], summary=summary)
