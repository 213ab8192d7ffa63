"""Bot arena command: one hero bot against six copies of an opponent bot, the hero's power rotated.

    python -m diprl.arena --hero dumbbot --opponents random --games 70 --max-year 1935 [--json report.json]

A thin command over the fixed suite (`diprl.eval.suite`): `--hero dumbbot --opponents random` is the
suite `bot:dumbbot` against `bot:random`, so the games, seeds, report and JSON are exactly those of
`python -m diprl.evaluate policy=bot:dumbbot opponents=bot:random` (a bots-only run: game after game,
in `--workers` processes). Bad arguments (an unknown bot, a year before the game starts, a report path
that cannot be written) are usage errors before any game is played. A progress bar goes to stderr when
it is a terminal (`--quiet`: none). The last line, `hero_solo_rate=<x> hero_mean_sc=<y>`, is meant for
scripts and CI. For LLM policies, crossplay and plots use `python -m diprl.evaluate`.

Critical supports (a re-adjudication of every successful hero support) are left out: they double the
cost of a bot game, and the arena is the quick check; the evaluate command measures them.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from diprl.console import add_console_flags, quiet_libraries
from diprl.eval.config import GamesConfig, check_max_year
from diprl.eval.report import check_writable, format_suite, summary_line
from diprl.eval.suite import bot_suite, run_suite
from diprl.game import DEFAULT_MAX_YEAR


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _year(text: str) -> int:
    try:
        return check_max_year(int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m diprl.arena", description="One hero bot vs 6 opponent bots, the hero's power rotated."
    )
    parser.add_argument("--hero", required=True, help="bot name for the hero seat (see diprl.bots.BOT_NAMES)")
    parser.add_argument("--opponents", required=True, help="bot name for the six other seats")
    parser.add_argument("--games", type=_positive, default=70, help="number of games (default 70: 10 per power)")
    parser.add_argument("--max-year", type=_year, default=DEFAULT_MAX_YEAR, help="stop after this year's winter")
    parser.add_argument("--seed", type=int, default=0, help="base seed; game i uses seed*100003+i")
    parser.add_argument("--workers", type=_positive, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the final summary line (no progress bar)")
    add_console_flags(parser, quiet=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        play = GamesConfig(games=args.games, max_year=args.max_year, seed=args.seed, critical_supports=False)
        config = bot_suite(args.hero, args.opponents, play, args.workers)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json is not None:
        try:
            check_writable(args.json)
        except OSError as exc:
            parser.error(f"--json: {exc}")
    quiet_libraries(args.verbose)
    report = run_suite(config, progress=not args.quiet)
    if args.json is not None:
        from diprl.atomic_io import write_json_atomic

        try:
            write_json_atomic(args.json, report, indent=1)
        except OSError as exc:
            print(f"python -m diprl.arena: error: could not write {args.json}: {exc}", file=sys.stderr)
            print(summary_line(report))
            return 1
    if not args.quiet:
        print("\n".join(format_suite(report)))
        if args.json is not None:
            print(f"report written to {args.json}")
    print(summary_line(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
