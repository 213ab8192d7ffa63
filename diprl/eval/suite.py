"""The fixed benchmark suite: one hero against six opponents, the seven powers rotated, seeded games.

    report = run_suite(SuiteConfig(policy="main@v12", opponents=["bot:dumbbot"], games=140), client)

Game `i` seats the hero on the `i % 7`-th power and fills the other six seats round-robin from
`opponents`; its seed (and every rule bot's seed, derived from it) depends only on `seed` and `i`,
so two policies evaluated with the same config face the same games, and the learning benchmark can
bootstrap paired differences of the per-game hero centres in the report.

All games are played in lockstep (`diprl.rollout.lockstep`, the runner training episodes use too):
each step asks every rule bot locally and sends the LLM seats of ALL unfinished games to the policy in
ONE batched `client.generate` call, then steps every game.
That keeps the PolicyServer's batches full (an LLM seat waits for one batch per phase, not one per
game) and makes a suite with LLM seats cost about as many calls as its longest game has phases.
Several suites (crossplay, the evaluator's opponent pool, the bot ladder) share one run through
`run_suites`. A run with rule bots only has nothing to batch: it needs no client and plays its games
one at a time, in `workers` processes when asked (the arena and the ladder are such runs).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diprl.bots import make_agent
from diprl.bots.base import Agent, seat_seed
from diprl.console import progress_bar
from diprl.eval.behaviour import BehaviourCounts, BehaviourTracker, merge
from diprl.eval.config import GamesConfig
from diprl.eval.records import CATEGORIES, Category, HeroGame, game_record, hero_fields
from diprl.eval.refs import check_policy_ref, is_llm
from diprl.eval.stats import mean_summary, rate_summary
from diprl.game import DiplomacyGame
from diprl.game.seating import SEED_STRIDE, game_seed, rotated_seats, standard_powers
from diprl.messages import PolicyRef
from diprl.rollout.lockstep import (
    IterSource,
    Job,
    LockstepStats,
    PhaseOutcome,
    PolicyClient,
    Table,
    drive,
    request_seed,
)

__all__ = [
    "SEED_STRIDE",
    "GameSpec",
    "GamesConfig",
    "PlayedGame",
    "SuiteConfig",
    "bot_suite",
    "game_specs",
    "play_lockstep",
    "run_suite",
    "run_suites",
    "summarize_suite",
]


@dataclass
class SuiteConfig:
    """One benchmark: `policy` (the hero) against `opponents` in the other six seats, playing `play`.

    `opponents` is one PolicyRef or several (seats filled round-robin, shifted each game). `play` may
    be any config that extends `GamesConfig` (the evaluate command's, the training schedule's): only
    its games part is kept. Replays (`play.replays`) are written under `replay_dir`. `workers` > 1
    plays a bots-only run in that many processes (LLM suites run in one, lockstep); `label` names the
    suite in reports, plots and the progress bar.
    """

    policy: str = "bot:dumbbot"
    opponents: list[str] = field(default_factory=lambda: ["bot:dumbbot"])
    play: GamesConfig = field(default_factory=GamesConfig)
    workers: int = 1
    label: str = ""
    replay_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.opponents, str):
            self.opponents = [self.opponents]
        self.opponents = list(self.opponents)
        if not self.opponents:
            raise ValueError("opponents must name at least one PolicyRef")
        for ref in (self.policy, *self.opponents):
            check_policy_ref(ref)
        if not isinstance(self.play, GamesConfig):
            raise TypeError(f"play must be a GamesConfig, got {type(self.play).__name__}")
        self.play = self.play.games_config()
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
        if self.play.replays and not self.replay_dir:
            raise ValueError("replays > 0 needs replay_dir (where to write them)")
        if not self.label:
            self.label = f"{self.policy} vs {'+'.join(self.opponents)}"

    @property
    def refs(self) -> list[str]:
        return [self.policy, *self.opponents]

    @property
    def needs_client(self) -> bool:
        return any(is_llm(r) for r in self.refs)


def bot_suite(hero: str, opponents: str, play: GamesConfig, workers: int = 1, label: str = "") -> SuiteConfig:
    """Rule bot `hero` against six of rule bot `opponents` (bot names): the arena's and the ladder's suite.

    `ValueError` names an unknown bot. The label defaults to "<hero> vs 6 x <opponents>".
    """
    return SuiteConfig(
        policy=str(PolicyRef.bot_ref(hero)),
        opponents=[str(PolicyRef.bot_ref(opponents))],
        play=play,
        workers=workers,
        label=label or f"{hero} vs 6 x {opponents}",
    )


@dataclass(frozen=True)
class GameSpec:
    """One game to play: who sits where, the hero, its seed; picklable (crosses to worker processes)."""

    suite: int
    index: int
    seed: int
    seats: dict[str, str]
    hero: str
    play: GamesConfig
    replay_dir: str | None = None


@dataclass(frozen=True)
class PlayedGame(HeroGame):
    """One finished suite game from the hero's seat, with its seats, every seat's rank and what was
    measured along the way."""

    suite: int
    seats: dict[str, str]
    ranks: dict[str, int]
    hero_centres_by_year: list[int]  # at the start of each year played, then the final count
    issues: dict[str, int]
    behaviour: dict[str, Any]
    llm: dict[str, int]  # requests, errors, incomplete: over the hero's seat ("hero_*") and all seats
    hero_first_error: str | None = None  # the PolicyServer's error for the hero's first failed request


FIRST_ERROR_CHARS = 500
"""How much of a failed request's error a game keeps (the first of the hero's; the server's log has all)."""

LLM_COUNTS = ("requests", "errors", "incomplete", "hero_requests", "hero_errors", "hero_incomplete")
"""What a game (and a suite, summed) counts of its LLM answers: all seats, and the hero's seat alone."""


def game_specs(config: SuiteConfig, suite: int = 0) -> list[GameSpec]:
    """The suite's games: hero on power `i % 7`, opponents round-robin, seeds from `seed` and `i`."""
    specs = []
    for i in range(config.play.games):
        hero, seats = rotated_seats(i, config.policy, config.opponents)
        replay_dir = config.replay_dir if i < config.play.replays else None
        specs.append(GameSpec(suite, i, game_seed(config.play.seed, i), seats, hero, config.play, replay_dir))
    return specs


class _Measure:
    """What one suite game measures along the way: behaviour, order issues, LLM answers, centres by year."""

    def __init__(self, spec: GameSpec, game: DiplomacyGame) -> None:
        self.spec = spec
        play = spec.play
        self.tracker = BehaviourTracker(spec.hero, len(game.centres(spec.hero)), play.critical_supports, play.max_year)
        self.issues: Counter[str] = Counter()
        self.llm: Counter[str] = Counter()
        self.by_year: list[int] = []
        self.phases = 0
        self.hero_first_error: str | None = None

    def observe(self, outcome: PhaseOutcome) -> None:
        for power, turn in outcome.turns.items():
            keys = ("requests", "hero_requests") if power == self.spec.hero else ("requests",)
            bad = turn.answer.error is not None
            incomplete = not bad and not turn.answer.complete
            if bad and power == self.spec.hero and self.hero_first_error is None:
                self.hero_first_error = str(turn.answer.error)[:FIRST_ERROR_CHARS]
            for key in keys:
                prefix = key[: -len("requests")]
                self.llm[key] += 1
                self.llm[prefix + "errors"] += bad
                self.llm[prefix + "incomplete"] += incomplete
        record = outcome.record
        self.phases += 1
        for issue in record.issues:
            self.issues[issue.power] += 1
        if record.name.startswith("S") and record.name.endswith("M"):
            self.by_year.append(len(record.state.get("centers", {}).get(self.spec.hero, ())))
        self.tracker.observe(record)

    def result(self, game: DiplomacyGame) -> PlayedGame:
        spec = self.spec
        record = game_record(game, self.phases, self.issues)
        behaviour: BehaviourCounts = self.tracker.finish(game)
        return PlayedGame(
            index=spec.index,
            seed=spec.seed,
            **hero_fields(record, spec.hero),
            suite=spec.suite,
            seats=dict(spec.seats),
            ranks=dict(record.score.ranks),
            hero_centres_by_year=[*self.by_year, record.score.centres[spec.hero]],
            issues=dict(record.issues),
            behaviour=behaviour.to_dict(),
            llm={k: self.llm[k] for k in LLM_COUNTS},
            hero_first_error=self.hero_first_error,
        )


def play_game(
    spec: GameSpec, before_phase: Callable[[DiplomacyGame], None] | None = None
) -> Generator[Sequence[Table], Sequence[PhaseOutcome], PlayedGame]:
    """One suite game as a lockstep job: every seat played by its PolicyRef, measured, replay written.

    `before_phase`, if given, sees the game before each phase is played (DAgger labels the hero's states).
    """
    play = spec.play
    game = DiplomacyGame(max_year=play.max_year)
    bots: dict[str, Agent] = {
        power: make_agent(PolicyRef.parse(ref).name, seat_seed(spec.seed, seat))
        for seat, (power, ref) in enumerate(sorted(spec.seats.items()))
        if not is_llm(ref)
    }
    stream = play.sampling_seed
    seeds = None if stream is None else functools.partial(_seat_seed, spec.seed, stream)
    searched = {spec.hero: play.search} if play.search.enabled and is_llm(spec.seats[spec.hero]) else {}
    table = Table(game, spec.seats, bots, float(play.temperature), play.max_tokens, seeds, search=searched)
    measure = _Measure(spec, game)
    while not game.is_done:
        if before_phase is not None:
            before_phase(game)
        (outcome,) = yield [table]
        measure.observe(outcome)
    if spec.replay_dir is not None:
        from diprl.eval.replays import write_replay

        write_replay(game, Path(spec.replay_dir), f"game{spec.index:04d}", spec.seats, spec.hero)
    return measure.result(game)


def _seat_seed(game_seed: int, stream: int, power: str, phase: str) -> int:
    return request_seed(game_seed, power, phase, stream)


def play_lockstep(
    specs: Sequence[GameSpec],
    client: PolicyClient | None,
    on_done: Callable[[PlayedGame], None] | None = None,
    stats: LockstepStats | None = None,
) -> list[PlayedGame]:
    """Play every game of `specs` to its end, all in lockstep (`diprl.rollout.lockstep`).

    Each step makes at most ONE `client.generate` call holding the LLM seats of all games, so a
    client sees batches as large as the suite allows. A failed request (its `error` set) costs only
    that seat's orders: the game layer replaces them with defaults and counts the issue. `stats`
    (when given) receives the calls and requests.
    """
    played: dict[tuple[int, int], PlayedGame] = {}

    def done(_: Job, game: PlayedGame) -> None:
        played[(game.suite, game.index)] = game
        if on_done is not None:
            on_done(game)

    drive(IterSource(play_game(spec) for spec in specs), client, max(1, len(specs)), done, stats=stats)
    return [played[(spec.suite, spec.index)] for spec in specs]


def _play_alone(spec: GameSpec) -> PlayedGame:
    """One game of a bots-only run (module level, so that worker processes can unpickle it).

    A worker's traceback does not survive pickling: the error names the game, whose seeds replay it.
    """
    try:
        return play_lockstep([spec], None)[0]
    except Exception as exc:
        raise RuntimeError(
            f"game {spec.index} of suite {spec.suite} (seed {spec.seed}, hero {spec.hero}) failed: {exc!r}"
        ) from exc


def _play_bots(specs: Sequence[GameSpec], workers: int, on_done: Callable[[PlayedGame], None]) -> list[PlayedGame]:
    """A bots-only run: nothing to batch, so one game at a time, in `workers` processes when > 1.

    Games differ a lot in length (an early solo against a run to 1935), so they go out in small chunks
    and come back unordered; callers sort by index, which keeps results independent of scheduling.
    'fork' is preferred where available: workers inherit the loaded engine.
    """
    played: list[PlayedGame] = []
    with contextlib.ExitStack() as stack:
        games: Iterable[PlayedGame]
        if workers > 1 and len(specs) > 1:
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            pool = stack.enter_context(mp.get_context(method).Pool(min(workers, len(specs))))
            games = pool.imap_unordered(_play_alone, specs, chunksize=max(1, len(specs) // (workers * 8)))
        else:
            games = map(_play_alone, specs)
        for game in games:
            played.append(game)
            on_done(game)
    return played


def run_suites(
    configs: Sequence[SuiteConfig], client: PolicyClient | None = None, progress: bool = False
) -> list[dict[str, Any]]:
    """Play several suites in ONE run (with LLM seats: one batched call per phase across all of them).

    Returns one report per config, in order (see `summarize_suite`). A bots-only run plays its games
    one at a time, in worker processes when `workers` > 1 (the largest asked for); results are
    identical to one process because every game's seeds depend only on its config and index.
    `progress` draws a bar over all games on stderr when stderr is a terminal, named after the suite
    whose game finished last.
    """
    if not configs:
        raise ValueError("no suites to run")
    llm = sorted({r for c in configs for r in c.refs if is_llm(r)})
    if client is None and llm:
        raise ValueError(
            f"LLM seats ({', '.join(llm)}) need a PolicyClient: pass ServeClient() inside a Ray cluster, "
            "or run `python -m diprl.evaluate`, which starts a local PolicyServer"
        )
    specs = [spec for k, config in enumerate(configs) for spec in game_specs(config, k)]
    for config in configs:
        if config.play.replays and config.replay_dir:
            Path(config.replay_dir).mkdir(parents=True, exist_ok=True)
    stats = LockstepStats()
    start = time.perf_counter()
    bar = progress_bar(len(specs), configs[0].label, enabled=None if progress else False, unit="game")
    shown = [0]  # the suite the bar names

    def done(game: PlayedGame) -> None:
        if game.suite != shown[0]:
            shown[0] = game.suite
            bar.set_description(configs[game.suite].label)
        if stats.calls:
            bar.set_postfix(llm_calls=stats.calls, refresh=False)
        bar.update(1)

    try:
        if llm:
            results = play_lockstep(specs, client, on_done=done, stats=stats)
        else:
            results = _play_bots(specs, max(c.workers for c in configs), done)
    finally:
        bar.close()
    wall = time.perf_counter() - start
    reports = []
    for k, config in enumerate(configs):
        mine = sorted((g for g in results if g.suite == k), key=lambda g: g.index)
        report = summarize_suite(config, mine, wall)
        report["timing"]["llm_calls"] = stats.calls
        report["timing"]["llm_requests_all_suites"] = stats.requests
        report["timing"]["suites_in_one_run"] = len(configs)
        report["timing"]["searches_all_suites"] = stats.searches
        report["timing"]["search_changed_all_suites"] = stats.search_changed
        reports.append(report)
    return reports


def run_suite(config: SuiteConfig, client: PolicyClient | None = None, progress: bool = False) -> dict[str, Any]:
    """Play the suite `config` and return its report (see `summarize_suite` for the keys)."""
    return run_suites([config], client, progress)[0]


# ------------------------------------------------------------------------------------ report


def _behaviour_summary(games: Sequence[PlayedGame], critical: bool) -> dict[str, Any]:
    counts = [BehaviourCounts.from_dict(g.behaviour) for g in games]
    total = merge(counts)
    verdicts, supports = total.verdicts, total.kinds["support"]
    return {
        "movement_phases": total.movement_phases,
        "orders": total.orders,
        "hold_rate": rate_summary(total.kinds["hold"], total.orders),
        "order_kinds": total.kind_shares(),
        "support_rate": rate_summary(supports, total.orders),
        "void_support_rate": rate_summary(verdicts["void"], supports),
        "critical_support_rate": rate_summary(verdicts["critical"], supports) if critical else None,
        "support_verdicts": dict(verdicts),
        "centres_gained_per_year": mean_summary([c.centres_gained_per_year for c in counts]),
        "attacks_on_recent_supporter": rate_summary(total.supporter_attacks, total.supporter_opportunities)
        | {"attack_orders": total.supporter_attack_orders},
        "waived_build_rate": rate_summary(total.waived_builds, total.builds + total.waived_builds),
        "definitions": "see diprl/eval/behaviour.py; rates pooled over orders/phases with Wilson intervals",
    }


def centres_at_year(counts: Sequence[int], i: int) -> int:
    """A game's hero centres at the start of its `i`-th year (`hero_centres_by_year`); a game that ended
    earlier carries its final count forward."""
    return counts[min(i, len(counts) - 1)]


def _centres_by_year(games: Sequence[PlayedGame]) -> dict[str, Any]:
    """Mean hero centres at the start of each year; a finished game carries its final count forward."""
    first = 1901
    last = max(g.final_year for g in games) + 1
    years = list(range(first, last + 1))
    rows = [[centres_at_year(g.hero_centres_by_year, i) for i in range(len(years))] for g in games]
    return {"years": years, "mean": [sum(r[i] for r in rows) / len(rows) for i in range(len(years))]}


def summarize_suite(config: SuiteConfig, games: Sequence[PlayedGame], wall_seconds: float) -> dict[str, Any]:
    """The report of one suite; everything but `timing` is a pure function of the config and client.

    Keys: config, label, policy, opponents, games, categories (solo/top/survived/eliminated with
    Wilson intervals), hero_centres and hero_sum_of_squares (means with bootstrap intervals),
    hero_centres_per_game (game index order: what paired comparisons bootstrap over), per_power,
    behaviour, centres_by_year, order_issues, llm, any_solo (games that any power soloed: a rate with
    its Wilson interval), mean_phases, mean_final_year, per_game,
    hero_solo_rate, hero_mean_sc, interval_methods, timing.
    """
    if not games:
        raise ValueError("no games to summarize")
    n = len(games)
    categories = {c.value: rate_summary(sum(g.category == c.value for g in games), n) for c in CATEGORIES}
    per_power: dict[str, Any] = {}
    for power in standard_powers():
        mine = [g for g in games if g.hero_power == power]
        per_power[power] = {
            "games": len(mine),
            "solo": rate_summary(sum(g.category == Category.SOLO.value for g in mine), len(mine)),
            "mean_centres": sum(g.hero_centres for g in mine) / len(mine) if mine else None,
            "mean_sum_of_squares": sum(g.hero_sum_of_squares for g in mine) / len(mine) if mine else None,
            "categories": {c.value: sum(g.category == c.value for g in mine) for c in CATEGORIES},
        }
    centres = mean_summary([float(g.hero_centres) for g in games])
    return {
        "config": asdict(config),
        "label": config.label,
        "policy": config.policy,
        "opponents": list(config.opponents),
        "games": n,
        "categories": categories,
        "hero_centres": centres,
        "hero_sum_of_squares": mean_summary([g.hero_sum_of_squares for g in games]),
        "hero_centres_per_game": [g.hero_centres for g in games],
        "per_power": per_power,
        "behaviour": _behaviour_summary(games, config.play.critical_supports),
        "centres_by_year": _centres_by_year(games),
        "order_issues": {
            "total": sum(sum(g.issues.values()) for g in games),
            "hero": sum(g.issues[g.hero_power] for g in games),
        },
        "llm": {k: sum(g.llm[k] for g in games) for k in LLM_COUNTS},
        "hero_first_error": next((g.hero_first_error for g in games if g.hero_first_error), None),
        "any_solo": rate_summary(sum(g.solo_winner is not None for g in games), n),
        "mean_phases": sum(g.phases for g in games) / n,
        "mean_final_year": sum(g.final_year for g in games) / n,
        "per_game": [asdict(g) for g in games],
        "hero_solo_rate": categories[Category.SOLO.value]["rate"],
        "hero_mean_sc": centres["mean"],
        "interval_methods": {"rates": "wilson", "means": "percentile bootstrap, 2000 resamples, seed 0"},
        "timing": {"wall_seconds": wall_seconds, "games_per_second": n / wall_seconds if wall_seconds > 0 else None},
    }
