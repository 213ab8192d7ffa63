"""What a run shows while it goes: recent-window statistics and the fields of the progress line.

The windows are short (the last `window` groups and matches), so the progress line and the
`rollout` records follow the policy as it changes rather than averaging the whole run. Besides returns
and centres, the `rollout` record carries what tells a sick run from a healthy one: the share of
malformed completions, the share of trained seats whose forks all tied (no GRPO comparison, nothing
trained), the share of matches whose hero ended its forks with the same centres (`level_outcome`: only
the shaping and order rewards rank such forks, so a high share says the horizon is too short to decide
anything), and where a worker's time goes per match (`MATCH_STAGES`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from diprl.messages import MATCH_STAGES, MatchReport

WINDOW = 64


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0


def level_outcome(report: MatchReport) -> bool | None:
    """Whether every fork of a match left its hero with the same centres at the horizon (None: under two forks)."""
    centres = [r.centres[r.hero] for r in report.results]
    return len(set(centres)) == 1 if len(centres) > 1 else None


@dataclass
class RunStats:
    """Recent returns, centres and group arrivals; faults and restarts counted over the whole run."""

    window: int = WINDOW
    returns: deque[float] = field(default_factory=deque)
    centres: deque[float] = field(default_factory=deque)
    group_times: deque[tuple[float, int]] = field(default_factory=deque)  # (when, groups) per match
    matches: deque[MatchReport] = field(default_factory=deque)
    faults: int = 0
    restarts: int = 0
    canary_refused: int = 0  # versions a replica refused by their canary (each also a fault)

    def __post_init__(self) -> None:
        self.returns = deque(maxlen=self.window)
        self.centres = deque(maxlen=self.window)
        self.group_times = deque(maxlen=self.window)
        self.matches = deque(maxlen=self.window)

    def match(self, report: MatchReport) -> None:
        centres = report.hero_centres()
        if centres is not None:
            self.centres.append(centres)
        self.returns.extend(report.hero_returns)
        self.group_times.append((time.monotonic(), len(report.groups)))
        self.matches.append(report)

    def health(self) -> dict[str, float]:
        """Malformed completions and tied groups as shares, and each stage's mean seconds per match."""
        reports = list(self.matches)
        completions = sum(r.counts.completions for r in reports)
        bad = sum(r.counts.bad_completions for r in reports)
        tied = sum(r.counts.skipped_zero_variance for r in reports)
        compared = tied + sum(len(r.groups) + r.undelivered for r in reports)
        levels = [level for r in reports if (level := level_outcome(r)) is not None]
        record = {
            "rollout/bad_completion_rate": bad / completions if completions else 0.0,
            "rollout/zero_variance_rate": tied / compared if compared else 0.0,
            "rollout/level_outcome_rate": sum(levels) / len(levels) if levels else 0.0,
        }
        for stage in MATCH_STAGES:
            record[f"rollout/{stage}_s"] = mean(r.timings.get(stage, 0.0) for r in reports)
        return record

    def groups_per_s(self) -> float:
        """Groups delivered per second over the recent matches (those after the first of the window)."""
        if len(self.group_times) < 2:
            return 0.0
        span = self.group_times[-1][0] - self.group_times[0][0]
        groups = sum(n for _, n in list(self.group_times)[1:])
        return groups / span if span > 0 else 0.0

    def rollout_record(self, step: int, queue_depth: int) -> dict[str, Any]:
        """The `rollout` metrics record logged beside each learner step."""
        return {
            "learner/step": step,
            "rollout/mean_reward": mean(self.returns),
            "rollout/hero_centres": mean(self.centres),
            "rollout/groups_per_s": self.groups_per_s(),
            "queue/depth": queue_depth,
            **self.health(),
        }


def progress_fields(
    stats: RunStats,
    step: int,
    learner: dict[str, Any],
    queue_depth: int,
    version: str,
    evals: dict[str, float],
    rating: float | None,
    trained_share: float | None = None,
) -> dict[str, Any]:
    """The progress line: step, rates, rewards, queue, the share of delivered groups trained, lag, version,
    last evaluation, rating, faults."""
    fields: dict[str, Any] = {
        "step": step,
        "groups/s": round(stats.groups_per_s(), 3),
        "tok/s": round(float(learner.get("tokens_per_s", 0.0)), 1),
        "reward": round(mean(stats.returns), 3),
        "hero_sc": round(mean(stats.centres), 2),
        "queue": queue_depth,
    }
    if trained_share is not None:  # of the groups delivered to the learner's queue, the share it trained
        fields["trained"] = round(trained_share, 2)
    fields |= {"lag": round(float(learner.get("policy_lag_mean", 0.0)), 2), "version": version}
    for opponents, centres in evals.items():
        fields[f"eval_sc[{opponents}]"] = round(centres, 2)
    if rating is not None:
        fields["rating"] = round(rating, 2)
    if stats.faults:
        fields["faults"] = stats.faults
    if stats.restarts:
        fields["restarts"] = stats.restarts
    if stats.canary_refused:
        fields["canary_refused"] = stats.canary_refused
    return fields
