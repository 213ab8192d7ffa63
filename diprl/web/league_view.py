"""The league of a run as the league page shows it: members, payoff, Nash weights, health, snapshots over time.

A running league is read from `league/state.json` (the manager saves it after every change, atomically,
with a checksum and the previous good copy beside it), so the page follows the run; the view is built
with the league's own pieces (`Payoff`, `Ratings`, and the Nash over the measured members,
`diprl.league.health.nash_over_measured`, as the league's health records solve it) the way
`LeagueManager.summary` builds `league_summary.json`, which is used when no state is readable. A member
with an unplayed pair is left out of the Nash and shown as such, never as weight 0. The league's health
over time (exploitability, Nash, relative population performance, ratings, the frozen evaluation pool,
crossplay, rollbacks, refused versions) comes from `metrics.jsonl` (`diprl.web.league_health`), as do
snapshots over time (one `league` record per published version: snapshot or not, reset or not, the win
rate the snapshot rule saw). Each figure links to the games behind it that the run kept (training
traces, evaluation replays, scheduled crossplay's replays: `games_between`); each scheduled crossplay round
links to the replays it kept of each pair. Crossplay evaluations of the run (`python -m
diprl.evaluate crossplay=[...] out=<run>/eval/<tag>`: every policy as hero against six of every other)
are read from `eval/<tag>/report.json`: their measured payoff and Nash weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diprl.messages import PolicyRef, UnknownPolicyRef
from diprl.web import games as games_mod
from diprl.web.league_health import health_view
from diprl.web.runs import config_value, read_metrics

log = logging.getLogger(__name__)


class NoLeague(LookupError):
    """A run without a readable league (not started yet, or both state files corrupt)."""


def summary_from_state(state: Mapping[str, Any], nash_min_games: float | None = None) -> dict[str, Any]:
    """`LeagueManager.summary()`'s members, payoff, ratings and Nash parts, from a saved state.

    The Nash is the health record's: over the members whose every pair has `nash_min_games` games (the
    run's `league.health.nash_min_games`; the default when None), the others in `nash_left_out` and their
    weight None."""
    from diprl.league.health import HealthConfig, nash_over_measured
    from diprl.league.manager import stand_in
    from diprl.league.payoff import Payoff
    from diprl.league.ratings import Ratings
    from diprl.messages import UnknownPolicyRef

    try:
        members = [dict(m) for m in state["members"]]
        roles = {str(p): dict(r) for p, r in state["roles"].items()}
        payoff = Payoff.from_dict(state["payoff"])
        ratings = Ratings.from_dict(state["ratings"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise NoLeague(f"the league state is not in the expected format ({exc!r})") from None
    keys = [str(m["key"]) for m in members]
    learners_without_version = {str(p) for p, r in roles.items() if r.get("current") is None}
    solved = [k for k in keys if k not in learners_without_version]  # as `LeagueManager.health` solves it
    need = max(HealthConfig().nash_min_games if nash_min_games is None else nash_min_games, payoff.min_games)
    report = nash_over_measured(solved, payoff.win_rate, payoff.games, need)
    nash: dict[str, float | None] = dict.fromkeys(keys, None) | report.weights
    pool = []
    for member in members:
        key = str(member["key"])
        current = roles.get(key, {}).get("current") if member.get("kind") == "learner" else member.get("ref")
        rating = ratings.get(key)
        pool.append(
            {"member": key, "kind": member.get("kind"), "role": member.get("role"), "ref": current}
            | {"rating": rating.ordinal, "mu": rating.mu, "sigma": rating.sigma, "nash": nash[key]}
            | {"games": sum(payoff.games(key, o) for o in keys if o != key)}
        )
    found = state.get("canary")
    canary: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    try:
        refused = {str(k): str(v) for k, v in dict(canary.get("refused") or {}).items()}
        registered = {str(p): [str(v) for v in vs] for p, vs in dict(canary.get("registered") or {}).items()}
        proven = [str(v) for v in canary.get("proven") or []]
        first = {p: vs[0] for p, vs in registered.items() if vs} | dict(canary.get("first") or {})
        current = {p: str(r["current"]) for p, r in roles.items() if r.get("current")}
        serving = {
            p: stand_in(v, refused, [x for x in proven if x.startswith(f"{p}@v")], first.get(p))
            for p, v in current.items()
        }
    except (TypeError, ValueError, AttributeError, UnknownPolicyRef) as exc:
        raise NoLeague(f"the league state is not in the expected format ({exc!r})") from None
    return {
        "roles": list(roles),
        "current": {p: r.get("current") for p, r in roles.items()},
        "serving": serving,
        "canary_refused": refused,
        "pool": pool,
        "payoff": {
            "members": keys,
            "win_rate": payoff.matrix(keys),
            "games": [[payoff.games(a, b) for b in keys] for a in keys],
        },
        "nash": report.weights,
        "nash_left_out": [k for k in keys if k not in report.weights],
        "measured": list(report.weights),
        "snapshots": {p: r.get("snapshots", 0) for p, r in roles.items()},
        "resets": {p: r.get("resets", 0) for p, r in roles.items()},
        "reported": dict(state.get("reported") or {}),
    }


def _read_summary(path: Path) -> dict[str, Any] | None:
    """`league_summary.json`, its Nash read from `health.nash` (the solve over measured members) where it
    has one: the top-level `nash` gives left-out members weight 0, which the page must not show."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("pool"), list):
        return None
    health = data.get("health")
    solved = health.get("nash") if isinstance(health, dict) else None
    if isinstance(solved, dict) and isinstance(solved.get("weights"), dict):
        weights = {str(k): float(v) for k, v in solved["weights"].items() if isinstance(v, int | float)}
        data["nash"] = weights
        data["nash_left_out"] = [str(m) for m in solved.get("left_out") or [] if str(m) not in weights]
        for member in data["pool"]:
            if isinstance(member, dict):
                member["nash"] = weights.get(str(member.get("member")))
    else:
        data.setdefault("nash_left_out", [])
    return data


def _nash_min_games(run_dir: Path) -> float | None:
    """The run's `league.health.nash_min_games` from its config.yaml (read with the run files' limits)."""
    value = config_value(run_dir, "league", "health", "nash_min_games")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def league_view(run_dir: Path) -> dict[str, Any]:
    """The league page's data; `NoLeague` (with the reason) when the run has none to show."""
    from diprl.league.persist import CorruptLeagueState, load_state

    league_dir = run_dir / "league"
    problem = ""
    summary: dict[str, Any] | None = None
    source = ""
    try:
        state = load_state(league_dir) if league_dir.is_dir() else None
    except CorruptLeagueState as exc:
        state, problem = None, str(exc)
    if state is not None:
        summary, source = summary_from_state(state, _nash_min_games(run_dir)), "league/state.json"
    else:
        summary = _read_summary(run_dir / "league_summary.json")
        source = "league_summary.json"
    if summary is None:
        raise NoLeague(problem or f"{run_dir.name} has no league yet (no league/state.json or league_summary.json)")
    records = read_metrics(run_dir / "metrics.jsonl")
    summary["source"] = source
    summary["timeline"] = league_timeline(records)
    summary["health"] = health_view(records)
    summary["games"] = game_links(run_dir, summary)
    return summary


def game_links(run_dir: Path, summary: Mapping[str, Any]) -> dict[str, Any]:
    """The kept games behind each figure, as links the page writes `/games?member=<m>&vs=<v>` (see
    `games_between`): `{"all": n, "pairs": {"a|b": link}, "exploits": {target: link}, "pins": {version:
    link}, "charts": {chart key: [link]}, "rounds": {crossplay tag: {"hero|opponent": [game]}}}`, a link
    being `{"text", "member", "vs", "count"}` and a game `{"id", "title"}` (the page opens it at
    `/games/view?id=`); only links with games are given."""
    listing = games_mod.run_games(run_dir.name, run_dir)

    def link(text: str, member: str | None = None, vs: str | None = None) -> dict[str, Any] | None:
        count = len(listing if member is None else games_mod.games_between(listing, member, vs))
        return {"text": text, "member": member, "vs": vs, "count": count} if count else None

    payoff = summary.get("payoff") or {}
    members = [str(m) for m in payoff.get("members") or []]
    games = payoff.get("games") or []
    pairs = {}
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            played = i != j and i < len(games) and j < len(games[i]) and games[i][j]
            if played and (found := link(f"{a} vs {b}", a, b)):
                pairs[f"{a}|{b}"] = found
    health = summary.get("health") or {}
    rows = health.get("exploitability") or []
    exploits = {r["target"]: link(f"{r['exploiter']} vs main", r["exploiter"], _policy_of(r["target"])) for r in rows}
    pins = {pin: link(f"main vs {pin}", "main", pin) for pin in health.get("pinned") or []}
    exploiters = sorted({r["exploiter"].split("#", 1)[0] for r in rows})
    every = link("every kept game of the run")
    charts: dict[str, list[dict[str, Any] | None]] = {
        "exploitability": [link(f"{e} vs main", e, "main") for e in exploiters],
        "pinned": list(pins.values()),
        "best": [link("main's games", "main")],
    }
    charts["exploiters"] = charts["exploitability"]
    for key in ("nash", "nash_main", "rpp", "ratings"):
        charts[key] = [every]
    return {
        "all": len(listing),
        "pairs": pairs,
        "exploits": {k: v for k, v in exploits.items() if v},
        "pins": {k: v for k, v in pins.items() if v},
        "charts": {k: [x for x in v if x] for k, v in charts.items()},
        "rounds": round_games(listing, health.get("crossplay") or []),
    }


def round_games(
    listing: list[games_mod.GameEntry], rounds: list[dict[str, Any]]
) -> dict[str, dict[str, list[dict[str, str]]]]:
    """The replays each scheduled crossplay round kept of each of its pairs (older rounds' are pruned: none)."""
    out: dict[str, dict[str, list[dict[str, str]]]] = {}
    for r in rounds:
        tag = str(r.get("tag"))
        kept = [g for g in listing if g.id.startswith(f"crossplay/{tag}/")]
        for pair in r.get("pairs") or []:
            found = games_mod.games_between(kept, pair["hero"], pair["opponent"]) if kept else []
            if found:
                out.setdefault(tag, {})[f"{pair['hero']}|{pair['opponent']}"] = [
                    {"id": g.id, "title": g.title} for g in found
                ]
    return out


def _policy_of(ref: str) -> str:
    """`main` of `main@v12`: an exploiter's games against a frozen main version are against main's versions
    up to it, so the games behind its figure are those against any of main's versions."""
    try:
        return PolicyRef.parse_adapter(ref).policy
    except UnknownPolicyRef:
        return ref


def crossplay_reports(run_dir: Path) -> list[dict[str, Any]]:
    """The crossplay summaries (`diprl.eval.crossplay.summarize_crossplay`) under `eval/*/report.json`."""
    out = []
    for path in sorted((run_dir / "eval").glob("*/report.json")):
        try:
            crossplay = json.loads(path.read_text()).get("crossplay")
        except (OSError, ValueError, AttributeError):
            continue
        if not isinstance(crossplay, dict):
            continue
        policies, payoff, nash = crossplay.get("policies"), crossplay.get("payoff"), crossplay.get("nash")
        if not (isinstance(policies, list) and isinstance(payoff, list) and isinstance(nash, dict)):
            continue
        square = len(payoff) == len(policies) and all(isinstance(r, list) and len(r) == len(policies) for r in payoff)
        if not square:
            continue
        games = crossplay.get("games")
        out.append(
            {
                "tag": path.parent.name,
                "policies": [str(p) for p in policies],
                "payoff": payoff,
                "games": games if isinstance(games, list) else [[0] * len(policies) for _ in policies],
                "nash": {str(k): float(v) for k, v in nash.items() if isinstance(v, int | float)},
                "definition": str(crossplay.get("payoff_definition", "")),
            }
        )
    return out


def league_timeline(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every published version the league heard of, in order, with the learner step and its decision."""
    out = []
    step: dict[str, float] = {}
    for record in records:
        policy = str(record.get("policy", "main"))
        if record.get("kind") == "learner" and isinstance(record.get("step"), int | float):
            step[policy] = record["step"]
        if record.get("kind") != "league" or "version" not in record:
            continue
        out.append(
            {
                "time": record.get("time"),
                "policy": policy,
                "step": step.get(policy),
                "version": record.get("version"),
                "snapshot": bool(record.get("snapshot")),
                "member": record.get("member"),
                "reset": bool(record.get("reset")),
                "win_rate": record.get("win_rate"),
            }
        )
    return out
