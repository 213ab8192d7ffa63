"""The league of a run as the league page shows it: members, payoff, Nash weights, snapshots over time.

A running league is read from `league/state.json` (the manager saves it after every change, atomically,
with a checksum and the previous good copy beside it), so the page follows the run; the view is built
with the league's own pieces (`Payoff`, `Ratings`, `max_entropy_nash` over the measured pairs) the way
`LeagueManager.summary` builds `league_summary.json`, which is used when no state is readable. Snapshots
over time come from the `league` records of `metrics.jsonl` (one per published version: snapshot or
not, reset or not, the win rate the snapshot rule saw). Crossplay evaluations of the run
(`python -m diprl.evaluate crossplay=[...] out=<run>/eval/<tag>`: every policy as hero against six of
every other) are read from `eval/<tag>/report.json`: their measured payoff and Nash weights.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diprl.web.runs import read_metrics

log = logging.getLogger(__name__)


class NoLeague(LookupError):
    """A run without a readable league (not started yet, or both state files corrupt)."""


def summary_from_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """`LeagueManager.summary()`'s members, payoff, ratings and Nash parts, from a saved state."""
    from diprl.league.manager import stand_in
    from diprl.league.nash import max_entropy_nash
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
    measured = payoff.measured_subset(keys)
    weights = max_entropy_nash(payoff.matrix(measured)).tolist() if measured else []
    nash = dict.fromkeys(keys, 0.0) | {k: float(w) for k, w in zip(measured, weights, strict=True)}
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
        current = {p: str(r["current"]) for p, r in roles.items() if r.get("current")}
        serving = {p: stand_in(v, registered.get(p, []), refused) for p, v in current.items()}
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
        "nash": nash,
        "measured": measured,
        "snapshots": {p: r.get("snapshots", 0) for p, r in roles.items()},
        "resets": {p: r.get("resets", 0) for p, r in roles.items()},
        "reported": dict(state.get("reported") or {}),
    }


def _read_summary(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("pool"), list) else None


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
        summary, source = summary_from_state(state), "league/state.json"
    else:
        summary = _read_summary(run_dir / "league_summary.json")
        source = "league_summary.json"
    if summary is None:
        raise NoLeague(problem or f"{run_dir.name} has no league yet (no league/state.json or league_summary.json)")
    summary["source"] = source
    summary["timeline"] = league_timeline(read_metrics(run_dir / "metrics.jsonl"))
    return summary


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
