"""The bot ladder: every rule bot as hero against six DumbBots and against six Random bots.

    python -m diprl.eval.ladder --games 70 [--json ladder.json] [--quiet] [--verbose]

Prints the markdown table the README carries, so the published numbers can be regenerated with
one command. For each self-play row it also counts games that any power soloed, the figure
the DumbBot specification (docs/dumbbot.md) gives for calibrating it (about one game in five).
While the games run, a progress bar over all rows goes to stderr when it is a terminal (`--quiet`:
none); the table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from diprl.bots import BOT_NAMES, make_agent
from diprl.console import add_console_flags, bar_enabled, progress_bar, quiet_libraries
from diprl.eval.arena import ArenaConfig, run_arena, summarize
from diprl.eval.stats import wilson_interval
from diprl.game import DEFAULT_MAX_YEAR

OPPONENTS = ("dumbbot", "random")


def _rate(cell: dict[str, Any]) -> str:
    low, high = cell["ci95"]
    return f"{100 * cell['rate']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def _row_progress(bar: Any, row_start: int) -> Callable[[int, int], None]:
    """`run_arena`'s callback (games done in this row, row total) moving the ladder-wide bar."""

    def advance(done: int, total: int) -> None:
        bar.update(row_start + done - bar.n)

    return advance


def ladder_rows(games: int, max_year: int, workers: int, seed: int, bar: Any = None) -> list[dict[str, Any]]:
    """One arena summary per (opponents, hero) row. `bar` (from `diprl.console.progress_bar`, total
    `games * len(BOT_NAMES) * len(OPPONENTS)`), if given, names the row being played and advances per game."""
    rows = []
    for opponents in OPPONENTS:
        for hero in BOT_NAMES:
            config = ArenaConfig(
                hero=hero, opponents=opponents, games=games, max_year=max_year, seed=seed, workers=workers
            )
            progress = None
            if bar is not None:
                bar.set_description(f"{hero} vs {opponents}")
                progress = _row_progress(bar, bar.n)
            start = time.perf_counter()
            played = run_arena(config, make_agent, progress)
            summary = summarize(config, played, time.perf_counter() - start)
            any_solo = sum(g.solo_winner is not None for g in played)
            summary["any_solo"] = {
                "count": any_solo,
                "rate": any_solo / games,
                "ci95": list(wilson_interval(any_solo, games)),
            }
            rows.append(summary)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| hero | vs 6 | solo | top | survived | eliminated | mean centres | mean SoS | games ending in any solo |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, cfg = r["categories"], r["config"]
        centres = r["hero_centres"]
        lines.append(
            f"| {cfg['hero']} | {cfg['opponents']} | {_rate(c['solo'])} | {_rate(c['top'])} | {_rate(c['survived'])} "
            f"| {_rate(c['eliminated'])} | {centres['mean']:.2f} [{centres['ci95'][0]:.2f}, {centres['ci95'][1]:.2f}] "
            f"| {r['hero_sum_of_squares']['mean']:.1f} | {_rate(r['any_solo'])} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.eval.ladder", description=__doc__.split("\n")[0])
    parser.add_argument("--games", type=int, default=70)
    parser.add_argument("--max-year", type=int, default=DEFAULT_MAX_YEAR)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    add_console_flags(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)
    start = time.perf_counter()
    total = args.games * len(BOT_NAMES) * len(OPPONENTS)
    with progress_bar(total, "ladder", bar_enabled(args.quiet), "game") as bar:
        rows = ladder_rows(args.games, args.max_year, args.workers, args.seed, bar)
    print(
        f"bot ladder: {args.games} games per row, powers rotated, stop at a solo or after winter {args.max_year}; "
        "95% Wilson intervals for rates, bootstrap for mean centres"
    )
    print("\n".join(markdown_table(rows)))
    issues = sum(r["order_issues"]["total"] for r in rows)
    print(f"order issues over all games: {issues}; wall {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if issues == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
