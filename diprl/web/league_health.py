"""The league's health as the league page draws it: figures read from the records of `metrics.jsonl`.

The driver writes a health record (`LeagueManager.health`: Nash over the measured members, ratings,
relative population performance, exploitability lower bounds, best version) at main step 1, every
`league.health.every_steps` main steps and at the end; the evaluation schedule writes the frozen pool's
pins, scheduled crossplay rounds, collapse faults and rollbacks as they happen, and the match scheduler
a fault for each version a replica refused by its canary (docs/league.md, "League health"). Everything
here is a pure function of those records, so the page shows what the run wrote and nothing else.

Charts are in the runs page's format (`{"title", "series": [{"label", "points": [[x, y, lo?, hi?]]}]}`,
drawn by `app.js`), each with a `key` the page uses to link it to the games behind it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from diprl.messages import PolicyRef, UnknownPolicyRef

HEALTH_KEY = "league/nash_entropy"
"""A key every health record carries (and no other record): how a health record is told apart."""

RATING_PREFIX = "league/rating/"


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _version_number(ref: str) -> int | None:
    """N of `<policy>@vN`, None for anything else (an anchor, a malformed name)."""
    try:
        return PolicyRef.parse_adapter(ref).version
    except UnknownPolicyRef:
        return None


def health_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The driver's `league` health records, in the order written."""
    return [r for r in records if r.get("kind") == "league" and HEALTH_KEY in r and _number(r.get("step"))]


def _series(
    records: Sequence[Mapping[str, Any]], key: str, label: str, lo: str | None = None, hi: str | None = None
) -> dict[str, Any]:
    points = []
    for r in records:
        if _number(r.get(key)):
            point = [float(r["step"]), float(r[key])]
            if lo and hi and _number(r.get(lo)) and _number(r.get(hi)):
                point += [float(r[lo]), float(r[hi])]
            points.append(point)
    return {"label": label, "points": points}


def _chart(key: str, title: str, series: list[dict[str, Any]], note: str = "") -> dict[str, Any]:
    return {"key": key, "title": title, "note": note, "series": [s for s in series if s["points"]]}


def exploit_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per frozen main version: the exploiter of the highest Wilson lower bound, its payoff and interval."""
    found = record.get("league/exploitability")
    rows = []
    for target, row in found.items() if isinstance(found, Mapping) else []:
        if not isinstance(row, Mapping) or not all(_number(row.get(k)) for k in ("rate", "low", "high", "games")):
            continue
        lower = row.get("lower_bound")
        rows.append(
            {"target": str(target), "number": _version_number(str(target)), "exploiter": str(row.get("exploiter", "?"))}
            | {k: float(row[k]) for k in ("rate", "low", "high", "games")}
            | {"lower_bound": float(lower) if _number(lower) else max(0.0, float(row["low"]) - 0.5)}
        )
    return sorted(rows, key=lambda r: (r["number"] is None, r["number"] or 0, r["target"]))


def health_charts(health: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The league page's figures over main's steps (and the exploiters' payoff per frozen main version)."""
    charts = [
        _chart(
            "exploitability",
            "exploitability lower bound of main (over main steps)",
            [
                _series(health, "league/exploitability_lb", "newest frozen version"),
                _series(health, "league/exploitability_lb_max", "largest so far"),
            ],
            "An exploiter's Wilson lower bound on the share of main's seats it outranks, less 1/2 (at least 0).",
        )
    ]
    rows = [r for r in exploit_rows(health[-1]) if r["number"] is not None] if health else []
    versions = [float(r["number"]) for r in rows]
    charts.append(
        _chart(
            "exploiters",
            "exploiters' payoff against each frozen main version (x: N of main@vN, 95% interval)",
            [
                {
                    "label": "best exploiter's share",
                    "points": [[x, r["rate"], r["low"], r["high"]] for x, r in zip(versions, rows, strict=True)],
                },
                {
                    "label": "even game (1/2)",
                    "points": [[min(versions), 0.5], [max(versions), 0.5]] if versions else [],
                },
            ],
            "Above 1/2 with its whole interval: that version can be exploited.",
        )
    )
    charts.append(
        _chart(
            "nash",
            "Nash over the measured members: entropy (nats), support, left out",
            [
                _series(health, "league/nash_entropy", "entropy"),
                _series(health, "league/nash_support", "support"),
                _series(health, "league/nash_left_out_count", "left out"),
            ],
        )
    )
    charts.append(
        _chart(
            "nash_main",
            "main's Nash weight",
            [_series(health, "league/nash_main", "main")],
            "No point where main was left out of the solve (a pair of its unplayed).",
        )
    )
    charts.append(
        _chart(
            "rpp",
            "relative population performance",
            [_series(health, "league/rpp", "learners and newest snapshots vs the older pool")],
            "The meta-game's value (win rate - 1/2); below 0 the newer population has no mixture that beats the older.",
        )
    )
    members = sorted({k[len(RATING_PREFIX) :] for r in health for k in r if k.startswith(RATING_PREFIX)})
    charts.append(
        _chart(
            "ratings",
            "ratings (openskill mu - 3 sigma) over main steps",
            [_series(health, f"{RATING_PREFIX}{m}", m) for m in members],
        )
    )
    pins = pinned_versions(records)
    evals = [r for r in records if r.get("kind") == "eval" and r.get("opponents") in pins and _number(r.get("step"))]
    charts.append(
        _chart(
            "pinned",
            "main against its pinned past: hero mean centres (95% interval)",
            [
                _series(
                    [r for r in evals if r.get("opponents") == pin],
                    "eval/hero_mean_sc",
                    f"vs {pin}",
                    "eval/hero_mean_sc_lo",
                    "eval/hero_mean_sc_hi",
                )
                for pin in pins
            ],
            "The frozen evaluation pool: the same seeded games every time.",
        )
    )
    charts.append(
        _chart(
            "best",
            "main's best version: its evaluation score (mean centres over the fixed opponents)",
            [_series(health, "league/best_score", "best score")],
        )
    )
    return charts


def pinned_versions(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Main's snapshots pinned into the evaluator's frozen pool, oldest first."""
    pins: list[str] = []
    for r in records:
        if r.get("kind") != "league":
            continue
        found = [r["league/eval_pin"]] if isinstance(r.get("league/eval_pin"), str) else []
        found += [v for v in r.get("league/eval_pinned") or [] if isinstance(v, str)]
        pins += [v for v in found if v not in pins]
    return pins


def pin_events(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each pin's entry into the frozen pool: the step, the version and the pool after it."""
    return [
        {"step": r.get("step"), "version": r["league/eval_pin"], "pool": [str(p) for p in r.get("eval/pool") or []]}
        for r in records
        if r.get("kind") == "league" and isinstance(r.get("league/eval_pin"), str)
    ]


def crossplay_rounds(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Scheduled crossplay rounds between pool members: the pairs, their games and the hero's mean outcome."""
    out = []
    for r in records:
        pairs = r.get("league/crossplay") if r.get("kind") == "league" else None
        if not isinstance(pairs, list):
            continue
        rows = [
            {"hero": str(p.get("hero")), "opponent": str(p.get("opponent")), "games": p.get("games")}
            | {"outcome": p.get("hero_outcome") if _number(p.get("hero_outcome")) else None}
            for p in pairs
            if isinstance(p, Mapping)
        ]
        out.append({"step": r.get("step"), "tag": r.get("league/crossplay_tag"), "pairs": rows})
    return out


def health_events(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Collapse guards that fired, rollbacks decided and carried out, versions refused by a canary: in order."""
    out = []
    for r in records:
        when = {"time": r.get("time"), "step": r.get("step"), "policy": r.get("policy", "main")}
        if r.get("kind") == "fault" and r.get("fault") == "collapse":
            what = f"{r.get('guard')}: {r.get('message') or r.get('value')} (threshold {r.get('threshold')})"
            out.append(when | {"event": "guard fired", "version": r.get("version"), "text": what})
        elif r.get("kind") == "fault" and r.get("canary_refused"):
            text = f"a replica's canary refused it; {r.get('serving')} plays instead"
            out.append(when | {"event": "refused", "version": r["canary_refused"], "text": text})
        elif r.get("kind") == "league" and isinstance(r.get("league/rollback"), Mapping):
            d = r["league/rollback"]
            text = (
                f"roll back {d.get('current')} to {d.get('to')} (guards: {', '.join(map(str, d.get('guards') or []))})"
            )
            out.append(when | {"event": "rollback decided", "version": d.get("current"), "text": text})
        elif r.get("kind") == "league" and isinstance(r.get("league/rollback_done"), Mapping):
            d = r["league/rollback_done"]
            text = f"{d.get('to')}'s weights published as {d.get('published')} (from {d.get('from')})"
            out.append(when | {"event": "rolled back", "version": d.get("published"), "text": text})
    return out


def snapshot_entries(health: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each snapshot's rating when it entered the pool (each is in one health record)."""
    out = []
    for r in health:
        for e in r.get("league/snapshot_entries") or []:
            if isinstance(e, Mapping) and _number(e.get("rating")):
                out.append(
                    {"member": e.get("member"), "role": e.get("role"), "step": e.get("step"), "rating": e["rating"]}
                )
    return out


def health_view(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The league page's health section; `records` is metrics.jsonl. `step` is None before the first record."""
    health = health_records(records)
    latest: Mapping[str, Any] = health[-1] if health else {}
    nash = latest.get("league/nash")
    weights = {str(k): float(v) for k, v in nash.items() if _number(v)} if isinstance(nash, Mapping) else {}
    left_out = [str(m) for m in latest.get("league/nash_left_out") or []]
    figures = {
        k.split("/", 1)[1]: latest[k]
        for k in (
            "league/rating",
            "league/nash_entropy",
            "league/nash_support",
            "league/nash_main",
            "league/rpp",
            "league/exploitability_lb",
            "league/exploitability_lb_max",
            "league/best_score",
            "league/exploiters_beat_main",
            "league/exploiters_timed_out",
            "league/rollbacks",
            "league/rollbacks_done",
        )
        if _number(latest.get(k))
    }
    for key in ("league/exploitability_target", "league/best_version"):
        if isinstance(latest.get(key), str):
            figures[key.split("/", 1)[1]] = latest[key]
    pending = latest.get("league/rollback_pending")
    return {
        "step": latest.get("step"),
        "records": len(health),
        "figures": figures,
        "rollback_pending": dict(pending) if isinstance(pending, Mapping) else None,
        "nash": {"weights": dict(sorted(weights.items(), key=lambda kv: -kv[1])), "left_out": left_out},
        "exploitability": exploit_rows(latest),
        "charts": health_charts(health, records) if health else [],
        "pins": pin_events(records),
        "pinned": pinned_versions(records),
        "crossplay": crossplay_rounds(records),
        "events": health_events(records),
        "entries": snapshot_entries(health),
    }
