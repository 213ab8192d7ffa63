"""The bot ladder: every rule bot as hero against six DumbBots and against six Random bots.

    python -m diprl.eval.ladder --games 70 [--json ladder.json] [--quiet] [--verbose]

Prints the markdown table docs/ladder.md carries, so the published numbers can be regenerated with
one command. For each self-play row it also counts games that any power soloed, the figure
the DumbBot specification (docs/dumbbot.md) gives for calibrating it (about one game in five).
While the games run, a progress bar over all rows goes to stderr when it is a terminal (`--quiet`:
none); the table goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_json_atomic
from diprl.bots import BOT_NAMES
from diprl.console import add_console_flags, quiet_libraries
from diprl.eval.config import GamesConfig
from diprl.eval.report import check_writable
from diprl.eval.stats import summary_text
from diprl.eval.suite import SuiteConfig, bot_suite, run_suites
from diprl.game import DEFAULT_MAX_YEAR
from diprl.messages import PolicyRef

OPPONENTS = ("dumbbot", "random")


def _rate(cell: dict[str, Any]) -> str:
    return summary_text(cell, digits=1, scale=100, unit="%")


def ladder_suites(games: int, max_year: int, workers: int, seed: int) -> list[SuiteConfig]:
    """One arena suite per (opponents, hero) row, each labelled as its row ("dumbbot vs random")."""
    play = GamesConfig(games=games, max_year=max_year, seed=seed, critical_supports=False)
    return [
        bot_suite(hero, opponents, play, workers, label=f"{hero} vs {opponents}")
        for opponents in OPPONENTS
        for hero in BOT_NAMES
    ]


def markdown_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table of docs/ladder.md, one line per suite report."""
    lines = [
        "| hero | vs 6 | solo | top | survived | eliminated | mean centres | mean SoS | games ending in any solo |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c, centres = r["categories"], r["hero_centres"]
        hero, opponents = PolicyRef.parse(r["policy"]).name, PolicyRef.parse(r["opponents"][0]).name
        lines.append(
            f"| {hero} | {opponents} | {_rate(c['solo'])} | {_rate(c['top'])} | {_rate(c['survived'])} "
            f"| {_rate(c['eliminated'])} | {summary_text(centres)} "
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
    try:
        suites = ladder_suites(args.games, args.max_year, args.workers, args.seed)
        if args.json is not None:
            check_writable(args.json)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    quiet_libraries(args.verbose)
    start = time.perf_counter()
    rows = run_suites(suites, progress=not args.quiet)
    print(
        f"bot ladder: {args.games} games per row, powers rotated, stop at a solo or after winter {args.max_year}; "
        "95% Wilson intervals for rates, bootstrap for mean centres"
    )
    print("\n".join(markdown_table(rows)))
    issues = sum(r["order_issues"]["total"] for r in rows)
    print(f"order issues over all games: {issues}; wall {time.perf_counter() - start:.0f} s")
    if args.json is not None:
        write_json_atomic(args.json, rows, indent=1)
    return 0 if issues == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
