"""Crossplay: a matrix of suites between chosen policies, with its payoff, Nash weights and ratings.

Every ordered pair (A, B), A != B, plays A as hero against six seats of B, the powers rotated as
in any suite; all pairs share one lockstep run. From the games:

- payoff[A][B]: the mean share of the six B seats that hero A outranks by final centres, a tie
  counting half (the league's hero-vs-member outcome). 0.5 is parity. The diagonal is not played.
- Nash: the maximum-entropy Nash equilibrium of the antisymmetrised payoff (Nash averaging,
  Balduzzi et al. 2018; `diprl.league.nash`): the mix of policies no other policy beats, and each
  policy's expected payoff against it. Unlike a mean win rate, it cannot be inflated by adding
  copies of a weak policy to the matrix.
- ratings: openskill Plackett-Luce over the 7 ranks of every game (`diprl.league.ratings`; a
  policy in six seats moves once), reported as mu - 3 sigma.

A training run's scheduled crossplay (`Evaluator.crossplay`, one round after each evaluation) keeps the
first games of each pair as replays, one folder per round so that rounds never share a file, and only the
newest rounds (`prune_replay_rounds`):

    <run_dir>/eval/crossplay/rounds/<round tag>/<hero>_vs_<opponent>/game0000/replay.json (+ frames, index.html)

which the web app lists beside the evaluation replays (`diprl.web.games.crossplay_replays`), so the league
page's payoff cells and crossplay rounds link to them. `rounds/` is a folder of its own (not `replays/`):
`python -m diprl.evaluate out=<run>/eval/crossplay` may put an evaluation's replays beside it, and pruning
must never reach them.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from diprl.eval.suite import SuiteConfig


def crossplay_configs(
    refs: Sequence[str], template: SuiteConfig, replays: int = 0, replay_root: Path | None = None
) -> list[SuiteConfig]:
    """One suite per ordered pair of distinct `refs`, each like `template`; with `replays`, each pair's first
    `replays` games are written under `replay_root/<hero>_vs_<opponent>/` (none otherwise)."""
    refs = list(refs)
    if len(refs) < 2:
        raise ValueError(f"crossplay needs at least two policies, got {refs}")
    if len(set(refs)) != len(refs):
        raise ValueError(f"crossplay policies must be distinct, got {refs}")
    if replays and replay_root is None:
        raise ValueError("crossplay replays need a folder to go to (replay_root)")
    root = replay_root if replays else None
    play = replace(template.play, replays=replays)  # GamesConfig checks 0 <= replays <= games
    return [
        replace(
            template,
            policy=a,
            opponents=[b],
            play=play,
            replay_dir=None if root is None else str(root / pair_folder(a, b)),
            label=f"{a} vs {b}",
        )
        for a in refs
        for b in refs
        if a != b
    ]


def pair_folder(hero: str, opponent: str) -> str:
    """The folder name of one pair's replays: `<hero>_vs_<opponent>`, a bot's colon made an underscore."""
    return f"{hero}_vs_{opponent}".replace(":", "_")


def pair_replay_dir(rounds_dir: Path, tag: str, hero: str, opponent: str) -> Path:
    """Where a round's replays of one pair go (see the module doc); refs and tag are checked by the caller."""
    return rounds_dir / tag / pair_folder(hero, opponent)


def prune_replay_rounds(rounds_dir: Path, keep: int, current: str) -> list[str]:
    """Delete the replays of all but the newest `keep` rounds under `rounds_dir` (by folder time, the
    `current` round always kept); returns the deleted rounds' tags. A long run fills no disk this way."""
    if keep < 1:
        raise ValueError(f"keep at least the current round's replays (keep >= 1), got {keep}")
    if not rounds_dir.is_dir():
        return []
    older = [d for d in rounds_dir.iterdir() if d.is_dir() and d.name != current]
    older.sort(key=lambda d: (d.stat().st_mtime_ns, d.name), reverse=True)
    gone = older[keep - 1 :]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return sorted(d.name for d in gone)


def outrank_share(centres: Mapping[str, int], hero: str, opponents: Sequence[str]) -> float:
    """Share of `opponents` seats that `hero` has more centres than; equal counts score half."""
    mine = centres[hero]
    score = sum(1.0 if mine > centres[p] else 0.5 if mine == centres[p] else 0.0 for p in opponents)
    return score / len(opponents)


def summarize_crossplay(refs: Sequence[str], reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Payoff matrix, Nash weights and ratings from the pair reports of `crossplay_configs(refs)`."""
    import numpy as np

    from diprl.league.nash import max_entropy_nash, nash_ratings
    from diprl.league.ratings import Ratings

    refs = list(refs)
    index = {r: i for i, r in enumerate(refs)}
    payoff: list[list[float | None]] = [[None] * len(refs) for _ in refs]
    games: list[list[int]] = [[0] * len(refs) for _ in refs]
    ratings = Ratings()
    for report in reports:
        a, (b,) = report["policy"], report["opponents"]
        shares = []
        for game in report["per_game"]:
            others = [p for p in game["seats"] if p != game["hero_power"]]
            shares.append(outrank_share(game["centres"], game["hero_power"], others))
            ratings.rate([(game["seats"], game["ranks"])])
        payoff[index[a]][index[b]] = sum(shares) / len(shares)
        games[index[a]][index[b]] = len(shares)
    filled = np.array([[0.5 if v is None else v for v in row] for row in payoff], dtype=float)
    weights = max_entropy_nash(filled)
    values = nash_ratings(filled, weights)
    table = {r: ratings.get(r) for r in refs}
    return {
        "policies": refs,
        "payoff": payoff,
        "games": games,
        "payoff_definition": "mean share of the 6 opponent seats the hero outranks by centres (ties half)",
        "nash": {r: float(w) for r, w in zip(refs, weights, strict=True)},
        "nash_payoff": {r: float(v) for r, v in zip(refs, values, strict=True)},
        "ratings": {r: {"mu": t.mu, "sigma": t.sigma, "ordinal": t.ordinal} for r, t in table.items()},
        "pairs": {
            rep["label"]: {"hero_solo_rate": rep["hero_solo_rate"], "hero_mean_sc": rep["hero_mean_sc"]}
            for rep in reports
        },
    }


def format_crossplay(summary: dict[str, Any]) -> list[str]:
    refs = summary["policies"]
    width = max(12, *(len(r) + 2 for r in refs))
    lines = ["crossplay payoff (row hero vs 6 x column; share of opponent seats outranked, ties half)"]
    lines.append(" " * width + "".join(f"{r:>{width}}" for r in refs))
    for r, row in zip(refs, summary["payoff"], strict=True):
        lines.append(f"{r:<{width}}" + "".join(f"{'-' if v is None else f'{v:.3f}':>{width}}" for v in row))
    lines.append("")
    lines.append(f"{'policy':<{width}}{'nash weight':>14}{'nash payoff':>14}{'rating mu-3s':>14}")
    for r in refs:
        lines.append(
            f"{r:<{width}}{summary['nash'][r]:>14.3f}{summary['nash_payoff'][r]:>14.3f}"
            f"{summary['ratings'][r]['ordinal']:>14.2f}"
        )
    return lines
