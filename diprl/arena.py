"""Bot arena command: one hero bot against six copies of an opponent bot, the hero's power rotated.

    python -m diprl.arena --hero dumbbot --opponents random --games 70 --max-year 1935 [--json report.json]

A thin command over `diprl.eval.arena` (where the games, seeding and report live). Bad arguments
(an unknown bot, a year before the game starts, a report path that cannot be written) are usage
errors before any game is played. A progress bar goes to stderr when it is a terminal (`--quiet`:
none). The last line, `hero_solo_rate=<x> hero_mean_sc=<y>`, is meant for scripts and CI. For LLM
policies and the full benchmark report use `python -m diprl.evaluate`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from diprl.console import add_console_flags, bar_enabled, progress_bar, quiet_libraries
from diprl.eval.arena import (
    AgentFactory,
    ArenaConfig,
    check_max_year,
    check_writable,
    format_report,
    run_arena,
    summarize,
    summary_line,
    write_json,
)
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
        prog="python -m diprl.arena", description="One hero agent vs 6 opponents, the hero's power rotated."
    )
    parser.add_argument("--hero", required=True, help="agent name for the hero seat (see diprl.bots.BOT_NAMES)")
    parser.add_argument("--opponents", required=True, help="agent name for the six other seats")
    parser.add_argument("--games", type=_positive, default=70, help="number of games (default 70: 10 per power)")
    parser.add_argument("--max-year", type=_year, default=DEFAULT_MAX_YEAR, help="stop after this year's winter")
    parser.add_argument("--seed", type=int, default=0, help="base seed; game i uses seed*100003+i")
    parser.add_argument("--workers", type=_positive, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the final summary line (no progress bar)")
    add_console_flags(parser, quiet=False)
    return parser


def main(argv: Sequence[str] | None = None, *, agent_factory: AgentFactory | None = None) -> int:
    """CLI entry point. `agent_factory` replaces the bot registry (tests, policies not in it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if agent_factory is None:
        from diprl.bots import make_agent

        agent_factory = make_agent
    factory = agent_factory
    for name in (args.hero, args.opponents):
        try:
            factory(name, 0)
        except (KeyError, ValueError) as exc:
            parser.error(f"unknown agent {name!r}: {exc}")
    if args.json is not None:
        try:
            check_writable(args.json)
        except OSError as exc:
            parser.error(f"--json: {exc}")
    quiet_libraries(args.verbose)
    config = ArenaConfig(args.hero, args.opponents, args.games, args.max_year, args.seed, args.workers)

    start = time.perf_counter()
    with progress_bar(config.games, f"{config.hero} vs {config.opponents}", bar_enabled(args.quiet), "game") as bar:

        def progress(done: int, total: int) -> None:
            bar.update(done - bar.n)

        games = run_arena(config, factory, progress=progress)
    summary = summarize(config, games, time.perf_counter() - start)
    if args.json is not None:
        try:
            write_json(args.json, summary, games)
        except OSError as exc:
            print(f"python -m diprl.arena: error: could not write {args.json}: {exc}", file=sys.stderr)
            print(summary_line(summary))
            return 1
    if not args.quiet:
        print("\n".join(format_report(summary)))
        if args.json is not None:
            print(f"report written to {args.json}")
    print(summary_line(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
