"""`python -m diprl.bench fork-points [--matches 56] [--points 1 2 3]`: what a group costs at each setting of
`rollout.episode.fork_points`.

The same seeded matches are played at each setting, in this process, by the episode `+experiment=league`
plays (its warmup, forks, horizon and rewards), with a uniformly random legal policy in every LLM seat
(`UniformConstrainedClient`: no model, no engine), so the figures count work, not seconds, and do not depend
on the machine. Two kinds of match, as in a league:

- `exploiter`: an exploiter's match, its seat against six seats of main's current version, all seven LLM
  seats and all trained (`rollout.train_seats=learners`): one group for the exploiter, up to six for main.
- `bots`: main as the hero against six Random bots, one LLM seat.

For each: matches, phases stepped (over all forks), LLM completions, groups, and completions per group, the
engine's work per group of training data. The last line is

    exploiter_saving_<p>=<completions per exploiter group at 1 / at p> ... bots_saving_<p>=<...> ...

one figure per setting `p` > 1 (one line). A match goes on from one of its forks right after the forked phase,
so the groups after the first cost their forks alone: no start, no warmup.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from diprl.console import add_console_flags, quiet_libraries
from diprl.league.members import POWERS
from diprl.messages import Match, parse_seats

KINDS = ("exploiter", "bots")
SEED = 4242


@dataclass(frozen=True)
class Cost:
    """What one setting's matches took."""

    matches: int
    phases: int
    completions: int
    groups: int
    hero_groups: int

    @property
    def per_hero_group(self) -> float:
        """LLM completions per hero group (inf when no group came: every fork tied)."""
        return self.completions / self.hero_groups if self.hero_groups else math.inf


def league_matches(kind: str, n: int, seed: int = SEED) -> list[Match]:
    """`n` matches of one kind, the hero's power turning through the seven."""
    if kind not in KINDS:
        raise ValueError(f"unknown match kind {kind!r}; known: {', '.join(KINDS)}")
    out = []
    for i in range(n):
        hero = POWERS[i % 7]
        if kind == "exploiter":
            seats = {p: "main@v2" for p in POWERS} | {hero: "main_exploiter@v1"}
            train: tuple[str, ...] = POWERS
        else:
            seats = {p: "bot:random" for p in POWERS} | {hero: "main@v2"}
            train = (hero,)
        out.append(Match(f"{kind}{i}", parse_seats(seats), hero=hero, seed=seed + i, train=train))
    return out


@dataclass(frozen=True)
class LeagueEpisode:
    """What the league experiment plays, built once: its episode, the model's tokenizer, its matches in flight."""

    episode: Any  # diprl.rollout.episode.Episode
    tokenizer: Any  # the uniform client returns prompt ids with it, as the server does: records are trainable
    matches_in_flight: int


def league_episode() -> LeagueEpisode:
    """`+experiment=league`'s episode (warmup, forks, horizon, rewards) and a uniform policy for every LLM seat."""
    from diprl.policy.models import load_preset, preset_tokenizer_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.rollout.worker import WorkerConfig, make_episode
    from diprl.run.config import compose_config

    config, _ = compose_config(["+experiment=league"])
    rollout = config.rollout
    episode_config = replace(rollout.episode, trace_fraction=0.0)
    episode = make_episode(WorkerConfig(episode=episode_config, reward=rollout.reward, model=config.model.name))
    tokenizer = load_tokenizer(preset_tokenizer_path(load_preset(config.model.name)))
    return LeagueEpisode(episode, tokenizer, rollout.matches_in_flight)


def measure(league: LeagueEpisode, matches: Sequence[Match], fork_points: int, client_seed: int = 7) -> Cost:
    """Play `matches` with the league's episode at `fork_points`, a uniform policy in every LLM seat."""
    from diprl.rollout.clients import UniformConstrainedClient
    from diprl.rollout.episode import EpisodeOutput
    from diprl.rollout.lockstep import IterSource, drive

    episode = replace(league.episode, config=replace(league.episode.config, fork_points=fork_points))
    client = UniformConstrainedClient(episode.table, seed=client_seed, tokenizer=league.tokenizer)
    outputs: list[EpisodeOutput] = []
    drive(
        IterSource(episode.play(m) for m in matches), client, league.matches_in_flight, lambda _, o: outputs.append(o)
    )
    return Cost(
        matches=len(outputs),
        phases=sum(o.counts.phases for o in outputs),
        completions=sum(o.counts.completions for o in outputs),
        groups=sum(len(o.groups) for o in outputs),
        hero_groups=sum(g.hero for o in outputs for g in o.groups),
    )


def savings(costs: dict[str, dict[int, Cost]]) -> dict[str, float]:
    """`<kind>_saving_<p>`: completions per hero group at one fork point over those at `p`."""
    return {
        f"{kind}_saving_{p}": by_points[1].per_hero_group / cost.per_hero_group
        for kind, by_points in costs.items()
        for p, cost in by_points.items()
        if p != 1
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench fork-points", description=__doc__.split("\n")[0])
    parser.add_argument("--matches", type=int, default=56, help="matches of each kind at each setting")
    parser.add_argument("--points", type=int, nargs="+", default=[1, 2, 3], help="fork_points settings (1 included)")
    add_console_flags(parser, quiet=False)
    args = parser.parse_args(argv)
    if args.matches < 1 or any(p < 1 for p in args.points):
        parser.error("--matches and every --points must be >= 1")
    quiet_libraries(args.verbose)
    points = sorted({1, *args.points})
    league = league_episode()
    costs: dict[str, dict[int, Cost]] = {}
    for kind in KINDS:
        matches = league_matches(kind, args.matches)
        costs[kind] = {}
        for p in points:
            cost = costs[kind][p] = measure(league, matches, p)
            per_group = cost.completions / max(cost.groups, 1)
            print(
                f"{kind:9s} fork_points={p}: {cost.matches} matches, {cost.phases} phases, {cost.completions} "
                f"completions, {cost.groups} groups ({cost.hero_groups} the hero's): "
                f"{cost.per_hero_group:.1f} completions a hero group, {per_group:.1f} a group",
                flush=True,
            )
    print(" ".join(f"{name}={value:.3f}" for name, value in savings(costs).items()))
    return 0
