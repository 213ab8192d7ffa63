"""`python -m diprl.bench search-cost [--policy REF] [--search K]`: what one-ply search costs, beside greedy.

The same seeded games (the policy as hero against six DumbBots, to the end of `--max-year`) are played
greedily and searched, one side after the other `--rounds` times (greedy, search, greedy, search, ...)
behind one PolicyServer, so both sides meet the same warm server on the same machine. Per side: wall
seconds, policy requests and calls, and the hero's movement decisions (what search replaces); the ratios
are of the sides' totals. The last line is

    greedy_seconds_per_decision=<s> search_seconds_per_decision=<s> search_cost_ratio=<search / greedy>
    search_requests_per_decision=<n> greedy_requests_per_decision=<n>

(one line): seconds and requests per hero movement decision of the whole run, so the seconds include the
bots' decisions and the engine's steps, which both sides share. Searched games diverge from the greedy ones
once search plays another answer, so the sides play the same seats and seeds, not the same positions.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from diprl.bench.strength import add_search_options, search_from_options
from diprl.eval.config import EvaluateConfig
from diprl.eval.suite import SuiteConfig, run_suites
from diprl.rollout.lockstep import PolicyClient
from diprl.rollout.search import SearchConfig

SEED = 777
"""Seeds of their own: the strength bench's (12345) are for its figures, not for timing."""
DUMBBOT = "bot:dumbbot"
SIDES = ("greedy", "search")


@dataclass
class SideTotals:
    """What one side played over all its rounds."""

    seconds: float = 0.0
    requests: int = 0
    calls: int = 0
    games: int = 0
    decisions: int = 0  # the hero's movement phases

    def add(self, report: dict[str, Any], seconds: float) -> None:
        self.seconds += seconds
        self.requests += report["timing"]["llm_requests_all_suites"]
        self.calls += report["timing"]["llm_calls"]
        self.games += report["games"]
        self.decisions += report["behaviour"]["movement_phases"]

    def per_decision(self, value: float) -> float:
        return value / self.decisions if self.decisions else float("nan")


def side_suite(side: str, policy: str, games: int, max_year: int, search: SearchConfig) -> SuiteConfig:
    play = EvaluateConfig(
        policy=policy, games=games, max_year=max_year, seed=SEED, temperature=0.0, search=search
    ).games_config()
    return SuiteConfig(policy=policy, opponents=[DUMBBOT], play=play, label=f"{side}: policy vs 6 DumbBot")


def check_sides(search: SearchConfig, rounds: int) -> None:
    if not search.enabled:
        raise ValueError("search-cost needs search.candidates >= 1: the searched side must search")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")


def measure(
    policy: str, client: PolicyClient, games: int, max_year: int, search: SearchConfig, rounds: int
) -> dict[str, SideTotals]:
    """Greedy and searched, alternately `rounds` times each, on the same games; each side's totals."""
    check_sides(search, rounds)
    configs = {
        "greedy": side_suite("greedy", policy, games, max_year, SearchConfig()),
        "search": side_suite("search", policy, games, max_year, search),
    }
    totals = {side: SideTotals() for side in SIDES}
    for _ in range(rounds):
        for side in SIDES:
            start = time.perf_counter()
            (report,) = run_suites([configs[side]], client)
            totals[side].add(report, time.perf_counter() - start)
    return totals


def summary(totals: dict[str, SideTotals]) -> dict[str, float]:
    greedy, search = totals["greedy"], totals["search"]
    out = {
        "greedy_seconds_per_decision": greedy.per_decision(greedy.seconds),
        "search_seconds_per_decision": search.per_decision(search.seconds),
        "search_requests_per_decision": search.per_decision(search.requests),
        "greedy_requests_per_decision": greedy.per_decision(greedy.requests),
    }
    out["search_cost_ratio"] = out["search_seconds_per_decision"] / out["greedy_seconds_per_decision"]
    return out


LAST_LINE = (
    "greedy_seconds_per_decision",
    "search_seconds_per_decision",
    "search_cost_ratio",
    "search_requests_per_decision",
    "greedy_requests_per_decision",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench search-cost", description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="zoo:best", help="an LLM PolicyRef (zoo:<name>, base, main@v3)")
    parser.add_argument("--served-model", default=None, help="the model preset the policy is served on")
    parser.add_argument("--adapters", default="runs/adapters", help="the AdapterStore of <policy>@v<N>")
    parser.add_argument("--games", type=int, default=7, help="games per round and side (every power once: 7)")
    parser.add_argument("--max-year", type=int, default=1902, help="the games end after this year")
    parser.add_argument("--rounds", type=int, default=2, help="greedy then searched, this many times")
    add_search_options(parser, candidates=8)
    args = parser.parse_args(argv)

    from diprl.evaluate import local_policy_client, make_plan

    config = EvaluateConfig(policy=args.policy, served_model=args.served_model, adapters=args.adapters)
    try:
        search = search_from_options(args)
        check_sides(search, args.rounds)
        plan = make_plan(config)
        if not plan.llm_refs:
            raise ValueError(f"{args.policy} is a rule bot: only an LLM policy searches")
    except (ValueError, OSError) as err:
        parser.error(str(err))
    with local_policy_client(plan.config) as client:
        totals = measure(args.policy, client, args.games, args.max_year, search, args.rounds)
    for side in SIDES:
        t = totals[side]
        print(
            f"{side}: {t.games} games, {t.decisions} hero movement decisions, {t.seconds:.1f} s, "
            f"{t.requests} requests in {t.calls} calls"
        )
    figures = summary(totals)
    print(" ".join(f"{key}={figures[key]:.4g}" for key in LAST_LINE))
    return 0
