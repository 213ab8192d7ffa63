"""Simulated league: PFSP with reserved anchors against pure skill matching, on a known non-transitive game.

No Diplomacy is played. Every member has a latent (s, theta): a transitive strength s and a style
angle theta; member i beats member j with probability sigmoid(s_i - s_j + c sin(theta_i - theta_j))
(Balduzzi et al.'s "disc game" plus a transitive part), so styles form rock-paper-scissors cycles.
The three anchors sit at three styles 120 degrees apart. The learner's strength s grows on a fixed
curve whatever it plays; its style follows the gradient of its log win probability against the
opponents it is matched with. Self-play pushes the style round in a circle (the gradient against
yourself is c/2, never 0): cyclic forgetting. Training against a spread of opponents balances the
gradient, and the learner keeps beating all of them.

Two matchmakers drive the same learner for the same number of matches:
- league: the real `LeagueManager` (conf/league/pfsp.yaml defaults: 10% anchors reserved, then 35%
  self-play, 50% PFSP-hard over anchors and snapshots, 15% verification), fed 1-vs-6 MatchResults
  sampled from the latent win probabilities, with snapshots by its own rule.
- skill: pure skill matching: the opponent whose estimated win rate is closest to 0.5 (within 0.05 of
  the closest, at random), with self-play a candidate at exactly 0.5, on the same decayed payoff.

Writes a PNG (shares per opponent kind over time, the true worst win rate against the anchors, and
PFSP's pick share against the true win rate) and prints one summary line.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from diprl.console import add_console_flags, bar_enabled, progress_bar
from diprl.game.scoring import ranks
from diprl.league.config import LeagueConfig
from diprl.league.manager import LeagueManager
from diprl.league.payoff import Payoff
from diprl.messages import MatchResult, PolicyRef

CYCLE = 3.0  # c: weight of the style (non-transitive) part
ANCHORS: dict[str, tuple[float, float]] = {  # ref -> (s, theta)
    "bot:random": (-1.0, 0.0),
    "bot:dumbbot": (0.0, 2.0 * math.pi / 3.0),
    "base": (-0.5, -2.0 * math.pi / 3.0),
}


def win_probability(a: tuple[float, float], b: tuple[float, float]) -> float:
    """P(a beats b) in the disc game with a transitive part."""
    return 1.0 / (1.0 + math.exp(-(a[0] - b[0] + CYCLE * math.sin(a[1] - b[1]))))


@dataclass
class Learner:
    """The simulated learning member: fixed strength curve, style moved by policy-gradient steps."""

    s_max: float = 1.5
    tau: float = 800.0
    lr: float = 0.005
    theta: float = 0.0
    steps: int = 0
    s: float = field(init=False, default=0.0)

    def latent(self) -> tuple[float, float]:
        return (self.s, self.theta)

    def step(self, opponents: list[tuple[float, float]]) -> None:
        """One learner step on a match against `opponents` (their latents; self-play: our own)."""
        grad = 0.0
        for opp in opponents:
            p = win_probability(self.latent(), opp)
            grad += CYCLE * math.cos(self.theta - opp[1]) * (1.0 - p)
        self.theta = (self.theta + self.lr * grad / len(opponents) + math.pi) % (2 * math.pi) - math.pi
        self.steps += 1
        self.s = self.s_max * (1.0 - math.exp(-self.steps / self.tau))


def _result(match_id: str, seats: dict[str, PolicyRef], hero: str, hero_won: float) -> MatchResult:
    centres = {p: (6 if hero_won else 1) if p == hero else 3 for p in seats}
    return MatchResult(
        match_id=match_id,
        fork=0,
        seats=seats,
        hero=hero,
        centres=centres,
        ranks=ranks(centres),
        final_phase="W1910A",
        solo=None,
        forks=1,
    )


def worst_anchor_win_rate(learner: Learner) -> float:
    return min(win_probability(learner.latent(), a) for a in ANCHORS.values())


def run_league(
    matches: int, publish_every: int, seed: int, run_dir: Path, lr: float = 0.005, bar: Any = None
) -> dict[str, Any]:
    rng = np.random.default_rng(seed + 1)
    manager = LeagueManager(LeagueConfig(seed=seed, snapshot_steps=10 * publish_every), run_dir)
    learner = Learner(lr=lr)
    latents: dict[str, tuple[float, float]] = dict(ANCHORS)
    manager.register_version("main", "main@v1", 0)
    version = 1
    kinds, worst, picks = [], [], []
    for t in range(matches):
        match = manager.next_match("main")
        opponents = {str(ref) for p, ref in match.seats.items() if p != match.hero}
        me = str(match.seats[match.hero])
        opp_latents = [learner.latent() if ref == me else latents[ref] for ref in opponents]
        kind = "self_play" if opponents == {me} else "anchor" if opponents <= set(ANCHORS) else "snapshot"
        kinds.append(kind)
        if opponents != {me}:
            (ref,) = opponents
            picks.append((ref, manager.payoff.win_rate("main", ref), win_probability(learner.latent(), latents[ref])))
        p = float(np.mean([win_probability(learner.latent(), o) for o in opp_latents]))
        manager.report([_result(match.match_id, dict(match.seats), match.hero, float(rng.random() < p))])
        learner.step(opp_latents)
        worst.append(worst_anchor_win_rate(learner))
        if bar is not None:
            bar.update()
        if (t + 1) % publish_every == 0:
            version += 1
            ref = f"main@v{version}"
            if manager.register_version("main", ref, t + 1).snapshot:
                latents[ref] = learner.latent()
    summary = manager.summary()
    return {"kinds": kinds, "worst": worst, "picks": picks, "summary": summary, "latents": latents}


def run_skill(matches: int, publish_every: int, seed: int, lr: float = 0.005, bar: Any = None) -> dict[str, Any]:
    """Pure skill matching on the same learner model, payoff and snapshot cadence (every 10 publishes)."""
    rng = np.random.default_rng(seed + 2)
    payoff = Payoff()
    learner = Learner(lr=lr)
    latents: dict[str, tuple[float, float]] = dict(ANCHORS)
    kinds, worst = [], []
    for t in range(matches):
        candidates = ["main", *latents]
        closeness = np.array([abs(payoff.win_rate("main", c) - 0.5) for c in candidates])
        near = [c for c, d in zip(candidates, closeness, strict=True) if d <= closeness.min() + 0.05]
        pick = near[int(rng.integers(len(near)))]
        opp = learner.latent() if pick == "main" else latents[pick]
        kinds.append("self_play" if pick == "main" else "anchor" if pick in ANCHORS else "snapshot")
        if pick != "main":
            payoff.update("main", pick, float(rng.random() < win_probability(learner.latent(), opp)))
        learner.step([opp])
        worst.append(worst_anchor_win_rate(learner))
        if bar is not None:
            bar.update()
        if (t + 1) % (10 * publish_every) == 0:
            latents[f"main@v{t + 1}"] = learner.latent()
    return {"kinds": kinds, "worst": worst}


def _windowed_share(kinds: list[str], kind: str, window: int) -> np.ndarray:
    hits = np.array([k == kind for k in kinds], dtype=np.float64)
    return np.convolve(hits, np.ones(window) / window, mode="valid")


def plot(league: dict[str, Any], skill: dict[str, Any], path: Path, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for name, run, style in (("league (PFSP)", league, "-"), ("skill matching", skill, "--")):
        for kind, colour in (("self_play", "tab:red"), ("anchor", "tab:blue"), ("snapshot", "tab:green")):
            ax.plot(_windowed_share(run["kinds"], kind, window), style, color=colour, label=f"{name}: {kind}")
    ax.set(title=f"share of matches by opponent kind ({window}-match window)", xlabel="match", ylabel="share")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(league["worst"], color="tab:blue", label="league (PFSP)")
    ax.plot(skill["worst"], "--", color="tab:red", label="skill matching")
    ax.axhline(0.5, color="grey", lw=0.8)
    ax.set(title="true win rate against the hardest anchor", xlabel="match", ylabel="win probability")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax = axes[2]
    picks = league["picks"][len(league["picks"]) // 2 :]
    members = sorted({r for r, _, _ in picks})
    share = [sum(r == m for r, _, _ in picks) / len(picks) for m in members]
    truth = [np.mean([w for r, _, w in picks if r == m]) for m in members]
    colours = ["tab:orange" if m in ANCHORS else "tab:green" for m in members]
    ax.scatter(truth, share, c=colours)
    for m, x, y in zip(members, truth, share, strict=True):
        if m in ANCHORS:
            ax.annotate(m, (x, y), fontsize=7)
    ax.set(
        title="league: who the non-self-play games go to (2nd half)",
        xlabel="learner's true win rate against the member",
        ylabel="share of non-self-play matches",
    )
    ax.set_xlim(0, 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diprl.bench league", description=__doc__.splitlines()[0])
    parser.add_argument("--matches", type=int, default=3000, help="matches per matchmaker")
    parser.add_argument("--publish-every", type=int, default=10, help="matches per published version")
    parser.add_argument("--window", type=int, default=200, help="moving-average window of the share plot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/figures/league_sim.png"), help="PNG to write")
    add_console_flags(parser)
    args = parser.parse_args(argv)
    if args.matches < 2 * args.window:
        parser.error("--matches must be at least twice --window")
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else None  # the manager fsyncs every change
    # One bar over both matchmakers' matches (`bar`: a `diprl.console.progress_bar`, ticked per match).
    with progress_bar(2 * args.matches, "league, then skill matching", bar_enabled(args.quiet), "match") as bar:
        with tempfile.TemporaryDirectory(dir=scratch) as tmp:
            league = run_league(args.matches, args.publish_every, args.seed, Path(tmp), bar=bar)
        skill = run_skill(args.matches, args.publish_every, args.seed, bar=bar)
    plot(league, skill, args.out, args.window)
    half = args.matches // 2

    def share(run: dict[str, Any], kind: str) -> float:
        return sum(k == kind for k in run["kinds"][half:]) / (args.matches - half)

    picks = league["picks"][len(league["picks"]) // 2 :]
    pool_wr = float(np.mean([w for _, _, w in picks]))
    members = {r for r, _, _ in picks}
    uniform_wr = float(np.mean([np.mean([w for r, _, w in picks if r == m]) for m in members]))
    summary = league["summary"]
    print(f"figure: {args.out}")
    print(
        f"league: {len(summary['pool'])} members ({sum(m['kind'] == 'snapshot' for m in summary['pool'])} snapshots); "
        f"second-half shares: self-play {share(league, 'self_play'):.2f}, anchors {share(league, 'anchor'):.2f}, "
        f"snapshots {share(league, 'snapshot'):.2f}; skill matching: self-play {share(skill, 'self_play'):.2f}, "
        f"anchors {share(skill, 'anchor'):.2f}, snapshots {share(skill, 'snapshot'):.2f}"
    )
    print(
        f"league non-self-play games: mean true win rate of the opponent picked {pool_wr:.2f} "
        f"against {uniform_wr:.2f} for a uniform pick over the same members"
    )
    worst_league = float(np.min(league["worst"][half:]))
    worst_skill = float(np.min(skill["worst"][half:]))
    print(
        f"league_anchor_share={share(league, 'anchor'):.2f} skill_selfplay_share={share(skill, 'self_play'):.2f} "
        f"picked_wr={pool_wr:.2f} uniform_wr={uniform_wr:.2f} "
        f"worst_anchor_wr_league={worst_league:.2f} worst_anchor_wr_skill={worst_skill:.2f}"
    )
    return 0
