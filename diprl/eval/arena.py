"""Bot arena: one hero agent against six copies of an opponent, the hero's power rotated.

The command line is `python -m diprl.arena` (a thin wrapper over this module); the fixed
benchmark suite with LLM seats is `diprl.eval.suite`.

Game `i` seats the hero on the `i % 7`-th power (sorted names), so every 7 games cover every
power once and a power's own strength (Russia's four centres, England's island) does not bias the
result. Games run in parallel worker processes; each game's seed, and each seat's seed derived
from it, depend only on `--seed` and the game index, so results are identical for any `--workers`.

The report uses DipNet's categories (solo, top without a solo, survived, eliminated), mean centres
and mean sum-of-squares, each with a 95% interval (Wilson for rates, seeded bootstrap for means),
a per-power breakdown and the number of orders the game layer had to replace. The last line,
`hero_solo_rate=<x> hero_mean_sc=<y>`, is meant for scripts and CI.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diprl.bots.base import Agent, seat_seed
from diprl.eval.arena_games import CATEGORIES, Category, HeroGame, hero_fields, play_game
from diprl.eval.stats import mean_summary, rate_summary
from diprl.game import DEFAULT_MAX_YEAR
from diprl.game.seating import game_seed, rotated_seats, standard_powers

AgentFactory = Callable[[str, int], Agent]
"""`(name, seed) -> Agent`, the signature of `diprl.bots.make_agent`."""


_CATEGORY_LABELS = {
    Category.SOLO: "solo",
    Category.TOP: "top (no solo)",
    Category.SURVIVED: "survived",
    Category.ELIMINATED: "eliminated",
}


FIRST_YEAR = 1901
"""The standard game starts in spring 1901: a cap before that year would play nothing."""


def check_max_year(max_year: int) -> int:
    """`max_year` if a game capped there plays at least one phase, else a `ValueError` saying why."""
    if isinstance(max_year, bool) or not isinstance(max_year, int) or max_year < FIRST_YEAR:
        raise ValueError(
            f"max_year must be a year >= {FIRST_YEAR} (the game starts in spring {FIRST_YEAR}), got {max_year!r}"
        )
    return max_year


@dataclass(frozen=True)
class ArenaConfig:
    hero: str
    opponents: str
    games: int = 70
    max_year: int = DEFAULT_MAX_YEAR
    seed: int = 0
    workers: int = 1

    def __post_init__(self) -> None:
        check_max_year(self.max_year)
        if self.games < 1 or self.workers < 1:
            raise ValueError(f"games and workers must be at least 1, got games={self.games}, workers={self.workers}")


@dataclass(frozen=True)
class ArenaGame(HeroGame):
    """One arena game seen from the hero's seat, with the order issues and the time it took."""

    issues: int
    hero_issues: int
    seconds: float


@dataclass(frozen=True)
class _Task:
    """Everything a worker needs to play one game; picklable (the factory by reference)."""

    index: int
    seed: int
    hero: str
    opponents: str
    max_year: int
    factory: AgentFactory


def _play_task(task: _Task) -> ArenaGame:
    """Play one arena game; module-level so that worker processes can unpickle it."""
    hero_power, seats = rotated_seats(task.index, task.hero, [task.opponents])
    agents = {power: task.factory(name, seat_seed(task.seed, seat)) for seat, (power, name) in enumerate(seats.items())}
    try:
        record = play_game(agents, max_year=task.max_year)
    except Exception as exc:
        # The worker's traceback does not survive pickling; name the game so it can be replayed.
        raise RuntimeError(f"arena game {task.index} (seed {task.seed}, hero {hero_power}) failed: {exc!r}") from exc
    return ArenaGame(
        index=task.index,
        seed=task.seed,
        **hero_fields(record, hero_power),
        issues=record.total_issues,
        hero_issues=record.issues[hero_power],
        seconds=record.seconds,
    )


def run_arena(
    config: ArenaConfig, factory: AgentFactory, progress: Callable[[int, int], None] | None = None
) -> list[ArenaGame]:
    """Play all games of `config`, in worker processes when `workers > 1`, sorted by game index.

    Games differ a lot in length (an early solo against a run to 1935), so tasks go out in small
    chunks and come back unordered; sorting afterwards keeps the output independent of scheduling.
    'fork' is preferred where available: workers inherit the loaded engine and any agent factory.
    """
    tasks = [
        _Task(i, game_seed(config.seed, i), config.hero, config.opponents, config.max_year, factory)
        for i in range(config.games)
    ]
    workers = max(1, min(config.workers, len(tasks)))
    results: list[ArenaGame] = []
    if workers == 1:
        for task in tasks:
            results.append(_play_task(task))
            if progress is not None:
                progress(len(results), len(tasks))
    else:
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        chunksize = max(1, len(tasks) // (workers * 8))
        with mp.get_context(method).Pool(workers) as pool:
            for game in pool.imap_unordered(_play_task, tasks, chunksize=chunksize):
                results.append(game)
                if progress is not None:
                    progress(len(results), len(tasks))
    return sorted(results, key=lambda g: g.index)


def summarize(config: ArenaConfig, games: Sequence[ArenaGame], wall_seconds: float) -> dict[str, Any]:
    """Aggregate the games into the report: everything but `timing` is deterministic."""
    if not games:
        raise ValueError("no games to summarize")
    n = len(games)
    categories = {c.value: rate_summary(sum(g.category == c.value for g in games), n) for c in CATEGORIES}
    per_power: dict[str, Any] = {}
    for power in standard_powers():
        mine = [g for g in games if g.hero_power == power]
        solos = sum(g.category == Category.SOLO.value for g in mine)
        per_power[power] = {
            "games": len(mine),
            "solo": rate_summary(solos, len(mine)),
            "mean_centres": sum(g.hero_centres for g in mine) / len(mine) if mine else None,
            "mean_sum_of_squares": sum(g.hero_sum_of_squares for g in mine) / len(mine) if mine else None,
            "categories": {c.value: sum(g.category == c.value for g in mine) for c in CATEGORIES},
        }
    centres = mean_summary([float(g.hero_centres) for g in games])
    return {
        "config": asdict(config),
        "games": n,
        "categories": categories,
        "hero_centres": centres,
        "hero_sum_of_squares": mean_summary([g.hero_sum_of_squares for g in games]),
        "interval_methods": {"rates": "wilson", "means": "percentile bootstrap, 2000 resamples, seed 0"},
        "per_power": per_power,
        "mean_phases": sum(g.phases for g in games) / n,
        "mean_final_year": sum(g.final_year for g in games) / n,
        "order_issues": {"total": sum(g.issues for g in games), "hero": sum(g.hero_issues for g in games)},
        "hero_solo_rate": categories[Category.SOLO.value]["rate"],
        "hero_mean_sc": centres["mean"],
        "timing": {
            "wall_seconds": wall_seconds,
            "games_per_second": n / wall_seconds if wall_seconds > 0 else None,
            "game_seconds_total": sum(g.seconds for g in games),
        },
    }


def summary_line(summary: dict[str, Any]) -> str:
    return f"hero_solo_rate={summary['hero_solo_rate']:.3f} hero_mean_sc={summary['hero_mean_sc']:.2f}"


def format_report(summary: dict[str, Any]) -> list[str]:
    """The human-readable table; the machine-readable summary line is printed separately, last."""
    cfg = summary["config"]
    n = summary["games"]
    lines = [
        f"arena: {cfg['hero']} vs 6 x {cfg['opponents']}, {n} games, max year {cfg['max_year']}, "
        f"seed {cfg['seed']}, {cfg['workers']} worker(s)",
        "",
        f"{'hero outcome':<22}{'games':>6}{'rate':>8}   95% CI (Wilson)",
    ]
    for c in CATEGORIES:
        r = summary["categories"][c.value]
        lines.append(
            f"{_CATEGORY_LABELS[c]:<22}{r['count']:>6}{r['rate']:>8.3f}   [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        )
    lines += ["", f"{'hero mean':<22}{'':>6}{'mean':>8}   95% CI (bootstrap)"]
    for key, label in (("hero_centres", "supply centres"), ("hero_sum_of_squares", "sum-of-squares")):
        m = summary[key]
        lines.append(f"{label:<22}{'':>6}{m['mean']:>8.2f}   [{m['ci95'][0]:.2f}, {m['ci95'][1]:.2f}]")
    lines += ["", f"{'hero power':<22}{'games':>6}{'solo':>8}{'mean SC':>9}{'mean SoS':>10}"]
    for power, p in summary["per_power"].items():
        if p["games"]:
            lines.append(
                f"{power:<22}{p['games']:>6}{p['solo']['rate']:>8.3f}{p['mean_centres']:>9.2f}{p['mean_sum_of_squares']:>10.2f}"
            )
        else:
            lines.append(f"{power:<22}{0:>6}{'-':>8}{'-':>9}{'-':>10}")
    issues = summary["order_issues"]
    timing = summary["timing"]
    gps = timing["games_per_second"]
    lines += [
        "",
        f"phases per game: {summary['mean_phases']:.1f}, last year played: {summary['mean_final_year']:.1f} on average",
        f"order issues: {issues['total']} (hero {issues['hero']}); rule bots must have 0",
        f"time: {timing['wall_seconds']:.1f} s wall, {gps:.2f} games/s"
        if gps
        else f"time: {timing['wall_seconds']:.1f} s",
    ]
    return lines


def check_writable(path: Path) -> Path:
    """Fail now, with the reason, if a report cannot be written to `path` later.

    Called before any game is played: finding out after an hour of games that the directory is
    read-only (or the path is a directory) would throw the games away.
    """
    if path.is_dir():
        raise OSError(f"{path} is a directory, not a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path


def write_json(path: Path, summary: dict[str, Any], games: Sequence[ArenaGame]) -> None:
    """Write atomically (temp file, then rename): a crashed run never leaves a half report behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"summary": summary, "games": [asdict(g) for g in games]}, indent=2) + "\n")
    os.replace(tmp, path)
