"""Rollout benchmark: throughput of the rollout path with bots only and with the tiny model.

    python -m diprl.bench rollout [--matches 42] [--workers 2] [--skip-model] [--quiet] [--verbose]

1. Bots only: matches whose seven seats are all rule bots (DumbBot and Random), played by one Ray
   rollout worker through the whole episode path (warmup, fork into a group, play to the horizon, rewards
   with counterfactual support checks, queue). Then the bare game layer plays the same matches (same
   seeds, the bots created the same way) in a plain `DiplomacyGame.step` loop for the same number of
   phases each, in the same run. The ratio is what the rollout machinery costs on top of the engine.
2. Tiny model: matches with LLM seats (the hero and two others, `base`) answered by the PolicyServer
   deployment (vLLM CPU), the rest bots.

For each: fork-phases per second, LLM completions per second, and a latency waterfall per phase
(engine, inference, rewards, queue). Last line:
`rollout_efficiency=<bots-only rollout phases/s / bare game-layer phases/s>`.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from diprl.bots import make_agent
from diprl.console import add_console_flags, bar_enabled, progress_bar, quiet_libraries, ray_init_options
from diprl.game import DiplomacyGame
from diprl.messages import Match, MatchReport, PolicyRef


def bot_matches(n: int, seed: int) -> list[Match]:
    powers = DiplomacyGame().powers
    mix = ["bot:dumbbot", "bot:random", "bot:dumbbot", "bot:random", "bot:dumbbot", "bot:random", "bot:dumbbot"]
    return [
        Match(
            f"bots{seed}-{i}",
            {p: PolicyRef.parse(mix[(i + j) % 7]) for j, p in enumerate(powers)},
            powers[i % 7],
            seed * 1_000_003 + i,
        )
        for i in range(n)
    ]


def bare_game_layer(matches: Sequence[Match], phases: dict[str, int], max_year: int) -> float:
    """The same matches (same seeds, bots created as the episode creates them), plain step loop."""
    total, start = 0, time.perf_counter()
    for match in matches:
        rng = random.Random(match.seed)
        agents = {p: make_agent(ref.name, seed=rng.randrange(2**31)) for p, ref in sorted(match.seats.items())}
        game = DiplomacyGame(max_year=max_year)
        for _ in range(phases[match.match_id]):
            if game.is_done:
                game = DiplomacyGame(max_year=max_year)
            game.step({p: agents[p].orders(game, p) for p in game.orderable_powers()})
            total += 1
    return total / (time.perf_counter() - start)


def summarise(label: str, reports: Sequence[MatchReport], wall: float) -> float:
    phases = sum(r.counts.phases for r in reports)
    completions = sum(r.counts.completions for r in reports)
    print(f"\n{label}: {len(reports)} matches, {phases} fork-phases, {completions} LLM completions, {wall:.1f} s wall")
    print(f"  {phases / wall:.1f} phases/s, {completions / wall:.1f} completions/s")
    return phases / wall


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench rollout", description=__doc__.split("\n")[0])
    parser.add_argument("--matches", type=int, default=42)
    parser.add_argument("--model-matches", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-model", action="store_true")
    add_console_flags(parser)
    args = parser.parse_args(argv)
    quiet_libraries(args.verbose)

    from diprl.raysession import ray_session
    from diprl.rollout.episode import EpisodeConfig
    from diprl.rollout.worker import RolloutRunner, WorkerConfig, stratified_matches

    run_dir = Path(tempfile.mkdtemp(prefix="diprl-bench-rollout-"))
    episode = EpisodeConfig(group_size=args.group_size, warmup_max_phases=8, horizon_years=1, trace_fraction=0.0)
    matches = bot_matches(args.matches, args.seed)
    assert not any(m.trains for m in matches) and all(m.ref(p).is_bot for m in matches for p in m.seats)
    print(f"rollout benchmark: group size {args.group_size}, horizon 1 year, {args.workers} workers")
    enabled = bar_enabled(args.quiet)
    with ray_session(address="local", num_cpus=args.workers + 2, **ray_init_options(args.verbose)):
        # A bar over the stages (closed before each block of results is printed).
        bar = progress_bar(5, "bots only: warm-up", enabled, "stage")
        with bar:
            # One worker against the one-process bare loop: the same CPU budget on both sides of the ratio.
            runner = RolloutRunner(WorkerConfig(episode=episode, client="uniform"), 1, run_dir / "bots")
            runner.run(matches[:2])  # warm the workers (tokenizer, map) before timing
            bar.update()
            # Two alternating rounds, best of each: a few seconds per run is noisy on a shared 2-core box.
            rollout_rate = bare_rate = 0.0
            for round_index in range(2):
                bar.set_description(f"bots only: round {round_index + 1} of 2, rollout")
                start = time.perf_counter()
                summaries = runner.run(
                    [Match(f"{m.match_id}-r{round_index}", m.seats, m.hero, m.seed) for m in matches]
                )
                wall = time.perf_counter() - start
                if sum(s.counts.phases for s in summaries) / wall > rollout_rate:
                    rollout_rate, best = sum(s.counts.phases for s in summaries) / wall, (summaries, wall)
                phases = {s.match_id.rsplit("-r", 1)[0]: s.counts.phases for s in summaries}
                bar.update()
                bar.set_description(f"bots only: round {round_index + 1} of 2, bare game layer")
                bare_rate = max(bare_rate, bare_game_layer(matches, phases, episode.max_year))
                bar.update()
        summarise("bots only, one Ray rollout worker", *best)
        print(f"\nbare game layer, same matches and phase counts, one process: {bare_rate:.1f} phases/s")
        if not args.skip_model:
            from diprl.inference.config import ServerConfig
            from diprl.inference.deploy import serving
            from diprl.policy.models import build_model

            build_model("tiny")  # once, before serving: the replicas only look it up
            server = ServerConfig(
                model="tiny",
                adapter_root=str(run_dir / "adapters"),
                log_level="INFO" if args.verbose else "WARNING",
            )
            with serving(server), progress_bar(3, "tiny model: starting the PolicyServer", enabled, "stage") as bar:
                quiet_libraries(args.verbose)  # again: importing Ray Serve installs its own INFO-level logger
                bar.update()
                bar.set_description("tiny model: warm-up match")
                model_runner = RolloutRunner(
                    WorkerConfig(episode=episode, client="serve"), args.workers, run_dir / "model"
                )
                opponents = ["base", "bot:dumbbot", "bot:random", "base", "bot:dumbbot", "bot:random"]
                model_matches = list(stratified_matches(args.model_matches, "base", opponents, seed=args.seed + 1))
                model_runner.run(model_matches[:1])
                bar.update()
                bar.set_description(f"tiny model: {len(model_matches)} matches")
                start = time.perf_counter()
                model_summaries = model_runner.run(model_matches)
                wall = time.perf_counter() - start
                bar.update()
            summarise("tiny model through the PolicyServer", model_summaries, wall)
            bad = sum(s.counts.bad_completions for s in model_summaries)
            print(f"  bad completions: {bad}; groups delivered: {sum(len(s.groups) for s in model_summaries)}")
    print(f"rollout_efficiency={rollout_rate / bare_rate:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
