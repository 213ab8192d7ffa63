"""Suite reports as text and files: the table a person reads and the JSON a script reads.

Every evaluation command (`python -m diprl.evaluate`, `python -m diprl.arena`, the ladder) prints a
suite report with `format_suite` and ends with `summary_line`, and checks its output path with
`check_writable` before playing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from diprl.eval.records import CATEGORIES

_LABELS = {"solo": "solo", "top": "top (no solo)", "survived": "survived", "eliminated": "eliminated"}


def _ci(cell: dict[str, Any], digits: int = 3) -> str:
    low, high = cell["ci95"]
    return f"[{low:.{digits}f}, {high:.{digits}f}]"


def _rate_line(label: str, cell: dict[str, Any] | None) -> str:
    if cell is None or cell["rate"] is None:
        return f"{label:<34}{'-':>8}"
    return f"{label:<34}{cell['rate']:>8.3f}   {_ci(cell)}  ({cell['count']}/{cell['n']})"


def format_suite(report: dict[str, Any]) -> list[str]:
    """The human-readable report of one suite (the summary line is printed separately, last)."""
    cfg = report["config"]
    play, workers = cfg["play"], cfg["workers"]
    n = report["games"]
    lines = [
        f"{report['label']}: {n} games, max year {play['max_year']}, seed {play['seed']}"
        + (f", {workers} worker processes" if workers > 1 else ""),
        "",
        f"{'hero outcome':<22}{'games':>6}{'rate':>8}   95% CI (Wilson)",
    ]
    for c in CATEGORIES:
        r = report["categories"][c.value]
        lines.append(f"{_LABELS[c.value]:<22}{r['count']:>6}{r['rate']:>8.3f}   {_ci(r)}")
    lines += ["", f"{'hero mean':<22}{'':>6}{'mean':>8}   95% CI (bootstrap)"]
    for key, label in (("hero_centres", "supply centres"), ("hero_sum_of_squares", "sum-of-squares")):
        m = report[key]
        lines.append(f"{label:<22}{'':>6}{m['mean']:>8.2f}   {_ci(m, 2)}")
    lines += ["", f"{'hero power':<22}{'games':>6}{'solo':>8}{'mean SC':>9}{'mean SoS':>10}"]
    for power, p in report["per_power"].items():
        if p["games"]:
            lines.append(
                f"{power:<22}{p['games']:>6}{p['solo']['rate']:>8.3f}{p['mean_centres']:>9.2f}"
                f"{p['mean_sum_of_squares']:>10.2f}"
            )
        else:  # fewer than 7 games: this power never had the hero
            lines.append(f"{power:<22}{0:>6}{'-':>8}{'-':>9}{'-':>10}")
    b = report["behaviour"]
    gained = b["centres_gained_per_year"]
    lines += [
        "",
        "how the hero plays (rates pooled over its movement orders; 95% Wilson)",
        _rate_line("support orders / orders", b["support_rate"]),
        _rate_line("void supports / supports", b["void_support_rate"]),
        _rate_line("critical supports / supports", b["critical_support_rate"]),
        _rate_line("attacks on last turn's supporter", b["attacks_on_recent_supporter"]),
        _rate_line("waived builds / build slots", b["waived_build_rate"]),
        f"{'centres gained per year':<34}{gained['mean']:>8.2f}   {_ci(gained, 2)}",
    ]
    issues, llm, timing = report["order_issues"], report["llm"], report["timing"]
    lines += [
        "",
        f"phases per game: {report['mean_phases']:.1f}, last year played: {report['mean_final_year']:.1f} on average",
        f"order issues: {issues['total']} (hero {issues['hero']})",
    ]
    if llm["requests"]:
        lines.append(
            f"LLM requests: {llm['requests']} ({llm['errors']} errors, {llm['incomplete']} incomplete); "
            f"{timing.get('llm_calls', 0)} batched calls"
        )
    gps = timing.get("games_per_second")
    lines.append(f"time: {timing['wall_seconds']:.1f} s wall" + (f", {gps:.2f} games/s" if gps else ""))
    return lines


def summary_line(report: dict[str, Any]) -> str:
    """The last line of every evaluation: stable, grep-able, meant for scripts and CI."""
    return f"hero_solo_rate={report['hero_solo_rate']:.3f} hero_mean_sc={report['hero_mean_sc']:.2f}"


def unmeasured_hero(report: dict[str, Any]) -> str | None:
    """Why `report` measures no policy, or None: the hero asked the PolicyServer and every answer was an
    error (a crashed replica, an adapter it cannot load), so its units held all game and its score is
    that of holding."""
    llm = report["llm"]
    if llm["hero_requests"] and llm["hero_errors"] == llm["hero_requests"]:
        first = report.get("hero_first_error")
        return (
            f"all {llm['hero_requests']} of the hero's LLM requests failed: its units held all game, so "
            "hero_mean_sc measures holding, not the policy; "
            + (f"the first failure said: {first}" if first else "the PolicyServer's log says why")
        )
    return None


def check_writable(path: Path) -> Path:
    """Fail now, with the reason, if a report cannot be written to `path` later.

    Called before any game is played: finding out after an hour of games that the directory is
    read-only (or the path is a directory) would throw the games away.
    """
    if path.is_dir():
        raise OSError(f"{path} is a directory, not a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OSError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return path
