"""`python -m diprl.bench strength [--policy REF]`: does a policy outplay DumbBot in DumbBot's own seats?

Every suite is greedy and seeded, and all of them are played in one run behind one PolicyServer:

1. the policy as hero against six DumbBots, 112 games to the end of 1906 (every power 16 times);
2. DumbBot as hero in the same seats of the same games (same seeds, same powers, the same six DumbBots);
3. the policy against six Random bots, the same 112 games;
4. full games to 1935 against six DumbBots (70 games, every power 10 times): solo, top, survived and
   eliminated with Wilson intervals, and the sum-of-squares score (centres squared over the board's).

The teacher gap is the mean over the 112 paired games of (policy's centres - DumbBot's centres), with a
paired-bootstrap 95% interval: both heroes meet the same opponents from the same state and power, so the
difference is the seat's player, not the draw. The last line is
`policy_vs_dumbbot=<x> dumbbot_vs_dumbbot=<y> teacher_gap=<x-y> teacher_gap_lo=<lo> policy_vs_random=<z>`.
An evaluation only: nothing trains here (a zoo entry's manifest names the command that trains it).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from diprl.eval.config import EvaluateConfig
from diprl.eval.stats import interval_text, paired_gain, summary_text
from diprl.eval.suite import SuiteConfig, centres_at_year
from diprl.rollout.search import IMPROVE_POOLS, SearchConfig

SEED = 12345
"""The training runs' evaluation seed (`evaluation.seed`): the first 112 games are the learning bench's."""
GAMES = 112
MAX_YEAR = 1906
FULL_GAMES = 70
FULL_MAX_YEAR = 1935
DUMBBOT = "bot:dumbbot"
RANDOM = "bot:random"
SUITES = ("policy_vs_dumbbot", "dumbbot_vs_dumbbot", "policy_vs_random", "full_games")
LAST_LINE = ("policy_vs_dumbbot", "dumbbot_vs_dumbbot", "teacher_gap", "teacher_gap_lo", "policy_vs_random")
"""The figures of the bench's last line, `key=value` each (what a results table is read from)."""


def suites(
    policy: str,
    games: int = GAMES,
    full_games: int = FULL_GAMES,
    temperature: float = 0.0,
    search: SearchConfig | None = None,
) -> list[SuiteConfig]:
    """The suites in `SUITES` order (the full games left out when `full_games` is 0); `search` (enabled) has
    the policy search its movement phases wherever it is the hero (DumbBot's suite is DumbBot's alone)."""
    play = EvaluateConfig(
        policy=policy, games=games, max_year=MAX_YEAR, seed=SEED, temperature=temperature,
        search=search or SearchConfig(),
    ).games_config()  # fmt: skip
    out = [
        SuiteConfig(policy=policy, opponents=[DUMBBOT], play=play, label="policy vs 6 DumbBot"),
        SuiteConfig(policy=DUMBBOT, opponents=[DUMBBOT], play=play, label="DumbBot vs 6 DumbBot"),
        SuiteConfig(policy=policy, opponents=[RANDOM], play=play, label="policy vs 6 Random"),
    ]
    if full_games:
        full = replace(play, games=full_games, max_year=FULL_MAX_YEAR)
        out.append(SuiteConfig(policy=policy, opponents=[DUMBBOT], play=full, label="policy vs 6 DumbBot to 1935"))
    return out


def gap_by_year(hero: dict[str, Any], teacher: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The teacher gap at the start of each year after the first (the last: the final count), paired game by
    game as the gap itself: where in the game a policy gains on DumbBot in its seats, and where it loses."""
    years = hero["centres_by_year"]["years"]
    pairs = list(zip(hero["per_game"], teacher["per_game"], strict=True))
    for mine, theirs in pairs:
        if (mine["seed"], mine["hero_power"]) != (theirs["seed"], theirs["hero_power"]):
            raise ValueError(f"the suites' games are not paired: {mine['index']} and {theirs['index']} differ")

    def at(game: dict[str, Any], i: int) -> int:
        return centres_at_year(game["hero_centres_by_year"], i)

    return {
        str(year): paired_gain([at(t, i) for _, t in pairs], [at(m, i) for m, _ in pairs])
        for i, year in enumerate(years)
        if i > 0
    }


def summarize(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The bench's figures from the suites' reports (in `suites` order)."""
    hero, teacher, random_ = reports[0], reports[1], reports[2]
    gap = paired_gain(teacher["hero_centres_per_game"], hero["hero_centres_per_game"])
    per_game = zip(hero["hero_centres_per_game"], teacher["hero_centres_per_game"], strict=True)
    better = sum(a > b for a, b in per_game)
    worse = sum(a < b for a, b in zip(hero["hero_centres_per_game"], teacher["hero_centres_per_game"], strict=True))
    summary: dict[str, Any] = {
        "policy_vs_dumbbot": hero["hero_mean_sc"],
        "policy_vs_dumbbot_ci95": hero["hero_centres"]["ci95"],
        "dumbbot_vs_dumbbot": teacher["hero_mean_sc"],
        "dumbbot_vs_dumbbot_ci95": teacher["hero_centres"]["ci95"],
        "teacher_gap": gap["gain"],
        "teacher_gap_lo": gap["lo"],
        "teacher_gap_hi": gap["hi"],
        "games_better": better,
        "games_worse": worse,
        "policy_vs_random": random_["hero_mean_sc"],
        "policy_vs_random_ci95": random_["hero_centres"]["ci95"],
        "support_rate_vs_dumbbot": hero["behaviour"]["support_rate"],
        "dumbbot_support_rate": teacher["behaviour"]["support_rate"],
        "teacher_gap_by_year": gap_by_year(hero, teacher),
    }
    if len(reports) > 3:
        full = reports[3]
        summary["full_games"] = {
            "games": full["games"],
            "categories": full["categories"],
            "sum_of_squares": full["hero_sum_of_squares"],
            "centres": full["hero_centres"],
        }
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """What the bench prints; the last line is the one the issue names."""

    def ci(key: str) -> str:
        return interval_text(summary[key], *summary[f"{key}_ci95"])

    lines = [
        f"policy vs 6 DumbBot: {ci('policy_vs_dumbbot')} centres; "
        f"DumbBot in the same seats: {ci('dumbbot_vs_dumbbot')}",
        f"teacher gap {summary['teacher_gap']:+.2f} "
        f"[{summary['teacher_gap_lo']:+.2f}, {summary['teacher_gap_hi']:+.2f}]"
        f" (better in {summary['games_better']} games, worse in {summary['games_worse']})",
        "teacher gap at the start of each year: "
        + ", ".join(f"{year} {gap['gain']:+.2f}" for year, gap in summary["teacher_gap_by_year"].items()),
        f"policy vs 6 Random: {ci('policy_vs_random')} centres",
    ]
    full = summary.get("full_games")
    if full:
        cats = ", ".join(f"{name} {summary_text(cell, digits=3)}" for name, cell in full["categories"].items())
        lines.append(
            f"full games to {FULL_MAX_YEAR} vs 6 DumbBot ({full['games']}): {cats}; sum-of-squares "
            f"{summary_text(full['sum_of_squares'])}"
        )
    lines.append(" ".join(f"{key}={summary[key]:.3f}" for key in LAST_LINE))
    return lines


def add_search_options(parser: argparse.ArgumentParser, candidates: int) -> None:
    """`--search K`, `--opponent-samples M`, `--reach-weight W`, `--improve-rounds R` and `--improve-pool`: a
    bench's `SearchConfig` (`search_from_options`)."""
    parser.add_argument(
        "--search",
        type=int,
        default=candidates,
        metavar="K",
        help="the policy searches its movement phases over K sampled candidates besides its greedy one (0: off)",
    )
    parser.add_argument(
        "--opponent-samples",
        type=int,
        default=SearchConfig.opponent_samples,
        metavar="M",
        help="with --search: joint samples of the other powers' orders, drawn from the policy itself",
    )
    parser.add_argument(
        "--reach-weight",
        type=float,
        default=SearchConfig.reach_weight,
        metavar="W",
        help="with --search: a centre one move from a free unit, in centres, in a position's value (0: unseen)",
    )
    parser.add_argument(
        "--improve-rounds",
        type=int,
        default=SearchConfig.improve_rounds,
        metavar="R",
        help="with --search: rounds of unit-by-unit improvement of the chosen order set (0: none)",
    )
    parser.add_argument(
        "--improve-pool",
        choices=IMPROVE_POOLS,
        default=SearchConfig.improve_pool,
        help="with --improve-rounds: a unit's alternatives, the candidates' orders or also every move onto a centre",
    )


def search_from_options(args: argparse.Namespace) -> SearchConfig:
    """The `SearchConfig` of `add_search_options`' flags (ValueError on a bad one)."""
    return SearchConfig(
        candidates=args.search,
        opponent_samples=args.opponent_samples,
        reach_weight=args.reach_weight,
        improve_rounds=args.improve_rounds,
        improve_pool=args.improve_pool,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench strength", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="zoo:best", help="the hero PolicyRef (default: zoo:best)")
    parser.add_argument(
        "--served-model", default="", help="the model preset served (conf/model); a zoo entry's own by default"
    )
    parser.add_argument("--adapters", default="runs/adapters", help="the AdapterStore of <policy>@v<N>")
    parser.add_argument("--games", type=int, default=GAMES, help="games to 1906 per suite (a multiple of 7)")
    parser.add_argument("--full-games", type=int, default=FULL_GAMES, help="games to 1935; 0 skips them")
    parser.add_argument("--out", default="runs/bench/strength")
    add_search_options(parser, candidates=0)
    args = parser.parse_args(argv)

    from diprl.atomic_io import write_json_atomic
    from diprl.eval.suite import run_suites
    from diprl.evaluate import local_policy_client, make_plan

    config = EvaluateConfig(
        policy=args.policy, served_model=args.served_model, adapters=args.adapters, out=args.out, temperature=0.0
    )
    try:
        plan = make_plan(config)  # the policy, the served model and the adapters checked before anything starts
    except (ValueError, OSError) as err:
        parser.error(str(err))
    try:
        search = search_from_options(args)
    except ValueError as err:
        parser.error(str(err))
    configs = suites(args.policy, args.games, args.full_games, search=search)
    context = local_policy_client(plan.config) if plan.llm_refs else contextlib.nullcontext(None)
    with context as client:
        reports = run_suites(configs, client, progress=True)
    summary = summarize(reports)
    out = Path(args.out)
    write_json_atomic(
        out / "strength.json",
        {"policy": args.policy, "served_model": plan.config.served_model, "search": asdict(search), "summary": summary,
         "suites": dict(zip(SUITES, reports, strict=False))},
        indent=1,
    )  # fmt: skip
    if search.enabled:
        timing = reports[0]["timing"]
        print(
            f"search: {search.candidates} candidates besides the greedy one, {search.opponent_samples} samples of the "
            f"others from the policy itself, reach weight {search.reach_weight}, {search.improve_rounds} rounds of "
            f"improvement from the {search.improve_pool} pool; "
            f"{timing['search_changed_all_suites']} of {timing['searches_all_suites']} "
            "searched decisions played another answer than the greedy one"
        )
    print("\n".join(summary_lines(summary)))
    return 0
