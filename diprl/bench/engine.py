"""`python -m diprl.bench engine`: what `DiplomacyGame` buys over the raw `diplomacy` engine.

Two measurements, both on seeded random-order games so that any run can be reproduced:

* Throughput. The same games are played through (a) the engine used naively, as a user who asks it for
  the legal orders of each power separately (every query recomputes all possible orders) and submits
  with the default `set_orders` (which re-parses and re-expands each order), and (b) `DiplomacyGame`, which
  computes the legal orders once per phase and submits validated orders on the engine's fast path. Both
  paths draw their orders through one function (`diprl.game.random_power_orders`, the one RandomBot
  plays by) from one seeded stream, so they must end in identical engine states; a mismatch means one
  of them changes the game and fails the run.
* Fork cost. `copy.deepcopy(engine)` against `DiplomacyGame.fork()` at several depths of one game, plus a
  check that an order given to each copy is actually played (the deepcopy'd engine keeps a unit-owner
  cache pointing at the original's powers, so its move orders are silently rejected and every unit holds).

The last line is `engine_speedup=<(b) phases/s divided by (a) phases/s>`; the target is >= 2.
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from diplomacy import Game

from diprl.console import add_console_flags, bar_enabled, progress_bar
from diprl.game import (
    SOLO_CENTRES,
    DiplomacyGame,
    PhaseKind,
    compute_legal_orders,
    random_orders,
    random_power_orders,
)

DEFAULT_GAMES = 20
DEFAULT_MAX_YEAR = 1910
DEFAULT_FORK_AT = (0, 10, 40, 90)
# Long enough that a random-order game is still running after the deepest fork checkpoint.
FORK_GAME_MAX_YEAR = 1960
TARGET_SPEEDUP = 2.0


# ---------------------------------------------------------------------------------------------- games
@dataclass(frozen=True)
class GameResult:
    """How one benchmark game ended: phases adjudicated and the final engine state (timestamp removed)."""

    seed: int
    phases: int
    state: dict[str, Any]
    seconds: float


def comparable_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """The engine state without its wall-clock timestamp, which is the only field two equal games differ in."""
    return {key: value for key, value in state.items() if key != "timestamp"}


def naive_is_done(engine: Game, max_year: int) -> bool:
    """`DiplomacyGame.is_done` restated on a raw engine: engine finished, past `max_year`, or a solo."""
    if engine.is_game_done:
        return True
    if int(engine.get_current_phase()[1:5]) > max_year:
        return True
    return any(len(power.centers) >= SOLO_CENTRES for power in engine.powers.values())


def play_naive(seed: int, max_year: int) -> GameResult:
    """Path (a): the raw engine, legal orders recomputed for every power's query, default `set_orders`.

    This is how the engine's API invites use: ask for the possible orders when a power needs them, then
    submit strings and let the engine parse and expand them.
    """
    rng = random.Random(seed)
    start = time.perf_counter()
    engine = Game()
    phases = 0
    while not naive_is_done(engine, max_year):
        for power in sorted(engine.powers):
            if not engine.get_orderable_locations(power):
                continue
            legal = compute_legal_orders(engine)[power]
            orders = random_power_orders(legal, rng)
            if orders:
                engine.set_orders(power, orders)
        engine.process()
        phases += 1
    seconds = time.perf_counter() - start
    return GameResult(seed=seed, phases=phases, state=comparable_state(engine.get_state()), seconds=seconds)


def play_wrapper(seed: int, max_year: int) -> GameResult:
    """Path (b): `DiplomacyGame`, legal orders once per phase, validated orders on the fast path."""
    rng = random.Random(seed)
    start = time.perf_counter()
    game = DiplomacyGame(max_year=max_year)
    while not game.is_done:
        game.step(random_orders(game.all_legal_orders(), rng))
    seconds = time.perf_counter() - start
    return GameResult(
        seed=seed, phases=len(game.history), state=comparable_state(game.engine.get_state()), seconds=seconds
    )


def describe_mismatch(a: GameResult, b: GameResult) -> str:
    """A short account of where two final states differ, for the failure message."""
    lines = [
        f"seed {a.seed}: (a) {a.phases} phases ending {a.state.get('name')}, "
        f"(b) {b.phases} phases ending {b.state.get('name')}"
    ]
    for key in sorted(set(a.state) | set(b.state)):
        if a.state.get(key) != b.state.get(key):
            lines.append(f"  {key}: (a) {str(a.state.get(key))[:160]}")
            lines.append(f"  {' ' * len(key)}  (b) {str(b.state.get(key))[:160]}")
    return "\n".join(lines)


@dataclass
class PathTotals:
    """Phases and seconds summed over all games of one path."""

    label: str
    phases: int = 0
    seconds: float = 0.0

    @property
    def phases_per_second(self) -> float:
        return self.phases / self.seconds if self.seconds > 0 else float("nan")

    def add(self, result: GameResult) -> None:
        self.phases += result.phases
        self.seconds += result.seconds


def timed_call(play: Callable[[int, int], GameResult], seed: int, max_year: int) -> GameResult:
    """Run one game with a clean heap so garbage left by the other path is not collected on this one's clock."""
    gc.collect()
    return play(seed, max_year)


def run_throughput(
    seeds: Sequence[int], max_year: int, on_game: Callable[[], object] | None = None
) -> tuple[PathTotals, PathTotals, list[str]]:
    """Play every seed through both paths, alternating which goes first so drift and noise hit both alike.

    `on_game` is called after each seed (both paths played): the progress bar's tick.
    """
    naive, ours = PathTotals("(a) engine, naive"), PathTotals("(b) DiplomacyGame")
    mismatches: list[str] = []
    for i, seed in enumerate(seeds):
        if i % 2 == 0:
            a = timed_call(play_naive, seed, max_year)
            b = timed_call(play_wrapper, seed, max_year)
        else:
            b = timed_call(play_wrapper, seed, max_year)
            a = timed_call(play_naive, seed, max_year)
        naive.add(a)
        ours.add(b)
        if a.phases != b.phases or a.state != b.state:
            mismatches.append(describe_mismatch(a, b))
        if on_game is not None:
            on_game()
    return naive, ours, mismatches


def warm_up() -> None:
    """Build the map (about 250 ms, once per process) and touch both code paths before any clock runs."""
    play_naive(0, 1901)
    play_wrapper(0, 1901)


# ---------------------------------------------------------------------------------------------- forks
@dataclass(frozen=True)
class OrderCheck:
    """One order that must succeed, played on a deepcopy and on a fork of the same position."""

    kind: str  # "move", "retreat" or "build"
    power: str
    order: str
    deepcopy_plays: bool
    fork_plays: bool
    original_untouched: bool


@dataclass(frozen=True)
class ForkRow:
    """Fork timings at one depth, and the order check there (None in a disband-only phase)."""

    phases_played: int
    phase: str
    deepcopy_ms: float
    fork_ms: float
    check: OrderCheck | None

    @property
    def ratio(self) -> float:
        return self.deepcopy_ms / self.fork_ms if self.fork_ms > 0 else float("nan")


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn` in milliseconds; the median ignores the odd collection or scheduler hiccup."""
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def sure_order(game: DiplomacyGame) -> tuple[str, str, str, str] | None:
    """An order that must succeed when every other power plays its default: (kind, power, order, province).

    `province` is where the power must have a unit afterwards. Movement: a plain move (no convoy) into a
    province no unit occupies, which cannot bounce when everything else holds. Retreat: any retreat, since
    every other dislodged unit disbands. Build: any build. Disband-only phases give None (the engine's
    civil-disorder rule could remove the same unit on its own). A copy on which the order fails is a copy
    that drops orders.
    """
    phase_type = game.phase_type
    occupied = {unit.split()[1][:3] for power in game.powers for unit in game.units(power)}
    for power in game.powers:
        legal = game.legal_orders(power)
        for orders in legal.by_loc.values():
            for order in orders:
                words = order.split()
                if phase_type == "M" and len(words) == 4 and words[2] == "-" and words[3][:3] not in occupied:
                    return "move", power, order, words[3][:3]
                if phase_type == "R" and len(words) == 4 and words[2] == "R":
                    return "retreat", power, order, words[3][:3]
                if legal.kind is PhaseKind.BUILD and words[-1] == "B":
                    return "build", power, order, words[1][:3]
    return None


def has_unit_at(units: Sequence[str], province: str) -> bool:
    return any(unit.split()[1][:3] == province for unit in units)


def check_sure_order(game: DiplomacyGame) -> OrderCheck | None:
    """Play one sure order on a deepcopy of the engine and on `game.fork()`, and confirm `game` is unchanged."""
    found = sure_order(game)
    if found is None:
        return None
    kind, power, order, province = found
    before = comparable_state(game.state())

    engine = copy.deepcopy(game.engine)
    engine.set_orders(power, [order])
    engine.process()
    deepcopy_plays = has_unit_at(engine.get_power(power).units, province)

    child = game.fork()
    child.step({power: [order]})
    fork_plays = has_unit_at(child.units(power), province)

    untouched = comparable_state(game.state()) == before
    return OrderCheck(kind, power, order, deepcopy_plays, fork_plays, untouched)


def run_fork_costs(
    seed: int, depths: Sequence[int], deepcopy_repeats: int, fork_repeats: int
) -> tuple[list[ForkRow], str]:
    """Time both kinds of copy at each depth of one seeded game; the note says if the game ended early."""
    rng = random.Random(seed)
    game = DiplomacyGame(max_year=FORK_GAME_MAX_YEAR)
    rows: list[ForkRow] = []
    note = ""
    for depth in sorted(depths):
        while len(game.history) < depth and not game.is_done:
            game.step(random_orders(game.all_legal_orders(), rng))
        if len(game.history) < depth:
            note = f"the fork game ended after {len(game.history)} phases, before depth {depth}"
            break
        game.all_legal_orders()  # as in real use: a fork is taken once the phase's legal orders are known
        gc.collect()
        deepcopy_ms = median_ms(lambda: copy.deepcopy(game.engine), deepcopy_repeats)
        fork_ms = median_ms(game.fork, fork_repeats)
        rows.append(ForkRow(depth, game.phase, deepcopy_ms, fork_ms, check_sure_order(game)))
    return rows, note


def _yes_no(value: bool) -> str:
    return "yes" if value else "NO"


def print_fork_table(rows: Sequence[ForkRow], note: str) -> bool:
    """Print the fork table and verdicts; return True if our fork played every check and left the original alone."""
    print(
        f"{'played':>6} {'phase':<7} {'deepcopy ms':>11} {'fork ms':>8} {'ratio':>6}  "
        f"{'check':<8} {'deepcopy plays it':<17} {'fork plays it':<13} {'original intact':<15}"
    )
    for row in rows:
        c = row.check
        cells = (
            [c.kind, _yes_no(c.deepcopy_plays), _yes_no(c.fork_plays), _yes_no(c.original_untouched)]
            if c is not None
            else ["-"] * 4
        )
        print(
            f"{row.phases_played:>6} {row.phase:<7} {row.deepcopy_ms:>11.2f} {row.fork_ms:>8.2f} {row.ratio:>6.1f}  "
            f"{cells[0]:<8} {cells[1]:<17} {cells[2]:<13} {cells[3]:<15}".rstrip()
        )
    if note:
        print(f"note: {note}")
    checks = [row.check for row in rows if row.check is not None]
    for kind in ("move", "retreat", "build"):
        of_kind = [c for c in checks if c.kind == kind]
        if of_kind:
            played = sum(c.deepcopy_plays for c in of_kind)
            verdict = "BROKEN, silently rejected" if played < len(of_kind) else "played"
            print(f"deepcopy fork, {kind} orders: {verdict} ({played}/{len(of_kind)} played)")
    ours_ok = all(c.fork_plays and c.original_untouched for c in checks)
    print(
        f"DiplomacyGame.fork: {'every order played, original untouched' if ours_ok else 'FAILED'} "
        f"({sum(c.fork_plays for c in checks)}/{len(checks)} played)"
    )
    print(
        "(check: one move into an empty province, retreat or build, every other power on defaults: it must be "
        "played; '-' = disband-only phase)"
    )
    return ours_ok


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m diprl.bench engine",
        description="Raw `diplomacy` engine used naively vs DiplomacyGame: phases per second and fork cost.",
    )
    parser.add_argument("--games", type=int, default=None, help=f"games per path (default {DEFAULT_GAMES}, quick 2)")
    parser.add_argument(
        "--max-year", type=int, default=None, help=f"last year played (default {DEFAULT_MAX_YEAR}, quick 1902)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first seed; games use seed, seed+1, ... (default 0)")
    parser.add_argument(
        "--fork-at",
        type=int,
        nargs="+",
        default=None,
        help=f"depths (phases played) to time forks at (default {' '.join(map(str, DEFAULT_FORK_AT))}; quick 0 10)",
    )
    parser.add_argument(
        "--deepcopy-repeats", type=int, default=None, help="timed deepcopies per depth (default 5, quick 1)"
    )
    parser.add_argument("--fork-repeats", type=int, default=None, help="timed forks per depth (default 50, quick 5)")
    parser.add_argument("--quick", action="store_true", help="a few seconds in all: for tests and smoke checks")
    add_console_flags(parser)
    ns = parser.parse_args(argv)
    quick = bool(ns.quick)
    ns.games = ns.games if ns.games is not None else (2 if quick else DEFAULT_GAMES)
    ns.max_year = ns.max_year if ns.max_year is not None else (1902 if quick else DEFAULT_MAX_YEAR)
    ns.fork_at = ns.fork_at if ns.fork_at is not None else ([0, 10] if quick else list(DEFAULT_FORK_AT))
    ns.deepcopy_repeats = ns.deepcopy_repeats if ns.deepcopy_repeats is not None else (1 if quick else 5)
    ns.fork_repeats = ns.fork_repeats if ns.fork_repeats is not None else (5 if quick else 50)
    if ns.games < 1:
        parser.error("--games must be at least 1")
    if min(ns.fork_at) < 0:
        parser.error("--fork-at depths must be >= 0")
    return ns


def main(argv: Sequence[str] | None = None) -> int:
    """Run both measurements, print the tables, and return 1 if the two paths disagree on any game."""
    ns = parse_args(argv)
    seeds = list(range(ns.seed, ns.seed + ns.games))
    print(
        f"engine benchmark: {ns.games} seeded random-order games per path (seeds {seeds[0]}-{seeds[-1]}), "
        f"stop after winter {ns.max_year} or at a solo; diplomacy {metadata.version('diplomacy')}, "
        f"Python {platform.python_version()}"
    )
    warm_up()
    with progress_bar(ns.games, "seeded games, both paths", bar_enabled(ns.quiet), "game") as bar:
        naive, ours, mismatches = run_throughput(seeds, ns.max_year, bar.update)
    if mismatches:
        print(f"FINAL STATES DIFFER in {len(mismatches)} of {ns.games} games:")
        for text in mismatches:
            print(text)
        return 1
    print(f"identical final states and phase counts: {ns.games}/{ns.games} games")
    print()
    print(f"{'path':<22} {'phases':>7} {'seconds':>8} {'phases/s':>9}")
    for totals in (naive, ours):
        print(f"{totals.label:<22} {totals.phases:>7} {totals.seconds:>8.2f} {totals.phases_per_second:>9.1f}")
    print()

    rows, note = run_fork_costs(ns.seed, ns.fork_at, ns.deepcopy_repeats, ns.fork_repeats)
    print(
        f"fork cost: seed {ns.seed}, game capped at {FORK_GAME_MAX_YEAR}; median of {ns.deepcopy_repeats} deepcopies "
        f"and {ns.fork_repeats} forks per depth"
    )
    fork_ok = print_fork_table(rows, note)
    speedup = ours.phases_per_second / naive.phases_per_second
    print()
    print(f"target engine_speedup >= {TARGET_SPEEDUP:g}: {'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}")
    print(f"engine_speedup={speedup:.2f}")
    return 0 if fork_ok else 1


if __name__ == "__main__":
    sys.exit(main())
