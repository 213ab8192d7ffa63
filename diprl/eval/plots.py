"""PNG plots of suite reports (matplotlib, headless Agg backend): what a person looks at first.

- `outcomes.png`: DipNet's categories with their Wilson intervals, one bar group per suite.
- `per_power.png`: mean hero centres by the power the hero played.
- `centres_by_year.png`: mean hero centres at the start of each year (growth, stalls, collapse).
- `behaviour.png`: support, void-support, critical-support rates and attacks on recent supporters.
- `crossplay.png`: the crossplay payoff matrix, when there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

CATEGORY_ORDER = ("solo", "top", "survived", "eliminated")


def _errors(cells: Sequence[dict[str, Any]]) -> np.ndarray:
    rates = np.array([c["rate"] or 0.0 for c in cells])
    lows = np.array([c["ci95"][0] for c in cells])
    highs = np.array([c["ci95"][1] for c in cells])
    return np.vstack([np.maximum(rates - lows, 0), np.maximum(highs - rates, 0)])


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_NO_RATE: dict[str, Any] = {"rate": 0.0, "ci95": [0.0, 0.0]}


def _rate_bars(
    reports: Sequence[dict[str, Any]],
    cells_of: Callable[[dict[str, Any]], Sequence[dict[str, Any] | None]],
    ticks: Sequence[str],
    ylabel: str,
    title: str,
    width_in: float,
) -> Any:
    """Grouped bars of rates with their Wilson intervals: one group per tick, one bar per suite.

    `cells_of(report)` gives the report's rate cells in `ticks` order; a missing rate draws as 0.
    """
    fig, ax = plt.subplots(figsize=(width_in, 4))
    width = 0.8 / len(reports)
    x = np.arange(len(ticks))
    for k, report in enumerate(reports):
        cells = [c if c is not None and c["rate"] is not None else _NO_RATE for c in cells_of(report)]
        ax.bar(x + k * width - 0.4 + width / 2, [c["rate"] for c in cells], width, yerr=_errors(cells), capsize=3,
               label=f"{report['label']} ({report['games']} games)")  # fmt: skip
    ax.set_xticks(x, ticks)
    ax.set_ylim(0, 1)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def plot_outcomes(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    width = max(6.0, 1.6 * len(CATEGORY_ORDER) * max(1, len(reports)) / 2)
    fig = _rate_bars(
        reports,
        lambda r: [r["categories"][c] for c in CATEGORY_ORDER],
        CATEGORY_ORDER,
        "share of games (95% Wilson)",
        "hero outcome",
        width,
    )
    return _save(fig, path)


def plot_per_power(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    powers = list(reports[0]["per_power"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(reports)
    x = np.arange(len(powers))
    for k, report in enumerate(reports):
        means = [report["per_power"][p]["mean_centres"] or 0.0 for p in powers]
        ax.bar(x + k * width - 0.4 + width / 2, means, width, label=report["label"])
    ax.axhline(18, color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(x, [p[:3] for p in powers])
    ax.set_ylabel("mean hero centres at the end")
    ax.set_title("by hero power")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_centres_by_year(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4))
    for report in reports:
        series = report["centres_by_year"]
        ax.plot(series["years"], series["mean"], marker=".", label=report["label"])
    ax.axhline(18, color="grey", linestyle=":", linewidth=1, label="solo (18)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("year (start of)")
    ax.set_ylabel("mean hero centres")
    ax.set_title("hero centres over the game (a finished game keeps its final count)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_behaviour(reports: Sequence[dict[str, Any]], path: Path) -> Path:
    keys = ("support_rate", "void_support_rate", "critical_support_rate", "attacks_on_recent_supporter")
    labels = ("supports /\norders", "void /\nsupports", "critical /\nsupports", "attacks on a\nrecent supporter")
    fig = _rate_bars(
        reports, lambda r: [r["behaviour"][k] for k in keys], labels, "rate (95% Wilson)", "how the hero plays", 8.0
    )
    return _save(fig, path)


def plot_crossplay(crossplay: dict[str, Any], path: Path) -> Path:
    refs = crossplay["policies"]
    payoff = np.array([[np.nan if v is None else v for v in row] for row in crossplay["payoff"]], dtype=float)
    fig, ax = plt.subplots(figsize=(1.3 * len(refs) + 3, 1.1 * len(refs) + 2))
    image = ax.imshow(payoff, vmin=0, vmax=1, cmap="RdYlGn")
    ax.set_xticks(range(len(refs)), refs, rotation=30, ha="right")
    ax.set_yticks(range(len(refs)), refs)
    ax.set_xlabel("opponent (6 seats)")
    ax.set_ylabel("hero")
    for i in range(len(refs)):
        for j in range(len(refs)):
            if not np.isnan(payoff[i, j]):
                ax.text(j, i, f"{payoff[i, j]:.2f}", ha="center", va="center", fontsize=9)
    fig.colorbar(image, ax=ax, label="share of opponent seats the hero outranks")
    ax.set_title("crossplay payoff")
    return _save(fig, path)


def write_plots(reports: Sequence[dict[str, Any]], out: Path, crossplay: dict[str, Any] | None = None) -> list[Path]:
    """All plots for `reports` (one or more suites) into `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    if reports:
        paths += [
            plot_outcomes(reports, out / "outcomes.png"),
            plot_per_power(reports, out / "per_power.png"),
            plot_centres_by_year(reports, out / "centres_by_year.png"),
            plot_behaviour(reports, out / "behaviour.png"),
        ]
    if crossplay is not None:
        paths.append(plot_crossplay(crossplay, out / "crossplay.png"))
    return paths
