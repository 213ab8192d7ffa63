"""Keeping every rollout worker full: matches from the league, results back to it, failed matches replayed.

Each worker plays up to `rollout.matches_in_flight` matches at once (in lockstep: one policy call per
phase for all of them), so the scheduler keeps that many `play` calls outstanding per worker, taking
the trained policies in turn: in proportion to their weights (`league.match_weights`), interleaved
(smooth weighted round robin; equal weights take them in order). A finished match's results go to the
league (its G forks weigh 1/G each) and its counts to the run's statistics. A call that failed (the
PolicyServer restarting, an engine error) is replayed with the same match, hence the same seed: the ledger
drops any group it already accepted. Ray itself retries a call a worker's death interrupted, on the restarted worker.

A match whose requests a replica refused by the version's canary (`CanaryMismatch`: the engine does not
serve the weights that were trained) is a `fault`: the league is told (`refuse_version`) and hands out the
role's last verified version from then on (what a replica proved since the driver last looked is read
first, `read_proofs`: the stand-in is the newest proven version, not the newest the last health step saw),
and the match's results are not reported (a seat that held all game would skew the payoff). Its failed
turns are not trained (workers drop them), so it does not count towards the every-request-failed stop either.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diprl.messages import POLICY_PATTERN, VERSION_PATTERN, Match, MatchReport, group_seat
from diprl.run.journal import Journal
from diprl.run.rundir import Counters

REFUSED = re.compile(rf"CanaryMismatch: (?P<version>{POLICY_PATTERN}@v{VERSION_PATTERN}):", re.ASCII)
"""A request's error when a replica refused its version by the canary (`diprl.inference.canary`)."""


def refused_version(error: str | None) -> str | None:
    """The version a request's `error` says a replica refused by its canary, or None."""
    found = REFUSED.search(error or "")
    return found.group("version") if found else None


class ServingFailed(RuntimeError):
    """Every LLM request of many matches in a row failed: the PolicyServer cannot serve this run's policies."""


@dataclass
class _Playing:
    worker: int
    match: Match
    attempt: int


@dataclass(eq=False)
class MatchScheduler:
    """Keeps `per_worker` matches in flight on each worker (see the module doc); a failed call is replayed up
    to `retries` times."""

    league: Any
    workers: list[Any]
    per_worker: int
    policies: list[str]
    retries: int
    journal: Journal
    counters: Counters
    # Reads the canaries a replica checked since the last read and proves those that passed (the driver's
    # `_log_canaries`), called before a refusal a match reports is handed to the league. None: proofs arrive
    # only when the driver reads them.
    read_proofs: Callable[[], None] | None = None
    # policy -> its share of new matches relative to the others (`league.match_weights`); a policy not named
    # weighs 1, so none named takes the policies in turn.
    weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.playing: dict[Any, _Playing] = {}
        # Matches in a row whose every LLM request failed; a whole round of every worker's matches, twice
        # over, ends the run: played on with holds it would only produce nothing to train on.
        self.failing = 0
        self.failing_limit = max(4, 2 * self.per_worker * len(self.workers))
        self.load = [0] * len(self.workers)
        self._weight = [float(self.weights.get(p, 1.0)) for p in self.policies]
        if any(not w > 0 for w in self._weight):
            named = dict(zip(self.policies, self._weight, strict=True))
            raise ValueError(f"match weights must be positive, got {named}")
        self._credit = [0.0] * len(self.policies)  # smooth weighted round robin's running credit per policy
        self.refused: set[str] = set()  # versions a replica refused by their canary
        self.serving: dict[str, str] = {}  # policy -> the version the league plays instead, since the last refusal

    def fill(self) -> None:
        """Hand every worker below its share a new match (the trained policies in turn)."""
        import ray

        for index in range(len(self.workers)):
            while self.load[index] < self.per_worker:
                match = ray.get(self.league.next_match.remote(self.next_policy()))
                self._submit(index, match, 0)

    def next_policy(self) -> str:
        """The policy whose turn it is: each gains its weight in credit, the richest plays and pays the total."""
        for i, weight in enumerate(self._weight):
            self._credit[i] += weight
        chosen = max(range(len(self.policies)), key=lambda i: self._credit[i])  # the first of equals
        self._credit[chosen] -= sum(self._weight)
        return self.policies[chosen]

    def _submit(self, index: int, match: Match, attempt: int) -> None:
        self.playing[self.workers[index].play.remote(match)] = _Playing(index, match, attempt)
        self.load[index] += 1

    def refs(self) -> list[Any]:
        return list(self.playing)

    def _check_serving(self, report: MatchReport) -> None:
        counts = report.counts
        every_request_failed = counts.completions > 0 and counts.failed_requests == counts.completions
        self.failing = self.failing + 1 if every_request_failed else 0
        if self.failing >= self.failing_limit:
            raise ServingFailed(
                f"every LLM request of the last {self.failing} matches failed; the PolicyServer said: "
                f"{counts.first_error}"
            )

    def _refused(self, report: MatchReport) -> bool:
        """Whether a replica refused a version of this match by its canary; the league is told, once a fault."""

        version = refused_version(report.counts.first_error)
        if version is None:
            return False
        if version not in self.refused and self.read_proofs is not None:
            self.read_proofs()
        self.refuse(version, str(report.counts.first_error))
        return True

    def refuse(self, version: str, error: str) -> None:
        """A replica refused `version` by its canary: the league stops handing it out; a fault the first time."""
        import ray

        answer = ray.get(self.league.refuse_version.remote(version, error))
        self.refused.add(version)
        self.serving[answer["policy"]] = answer["serving"]
        if answer["new"]:
            self.journal.stats.canary_refused += 1
            self.journal.fault(
                {"canary_refused": version, "serving": answer["serving"], "error": error[:500]}, answer["policy"]
            )

    def prove(self, version: str) -> None:
        """A replica's canary passed for `version`: the league may fall back on it (`LeagueManager.prove_version`)."""
        import ray

        ray.get(self.league.prove_version.remote(version))

    def in_flight(self, index: int) -> list[str]:
        """Ids of the matches worker `index` is playing (what a restart of it replays)."""
        return sorted(p.match.match_id for p in self.playing.values() if p.worker == index)

    def handle(self, ref: Any) -> MatchReport | None:
        """A finished `play` call: its report, or None when it failed (replayed if retries are left)."""
        import ray

        playing = self.playing.pop(ref)
        self.load[playing.worker] -= 1
        try:
            report: MatchReport = ray.get(ref)
        except Exception as exc:
            self.counters.failed_matches += 1
            values = {"match_id": playing.match.match_id, "attempt": playing.attempt, "error": repr(exc)[:500]}
            self.journal.fault(values)
            if playing.attempt < self.retries:
                self._submit(playing.worker, playing.match, playing.attempt + 1)
            return None
        self.counters.matches += 1
        refused = self._refused(report)
        if not refused:
            self._check_serving(report)
        if report.results and not refused:
            ray.get(self.league.report.remote(report.results))
            self.counters.results += len(report.results)
        self.counters.groups += len(report.groups)
        for gid in report.groups:  # a group goes to the queue of the policy playing its seat
            seat = playing.match.seats.get(group_seat(gid).power)
            policy = seat.policy if seat is not None else ""
            self.counters.delivered[policy] = self.counters.delivered.get(policy, 0) + 1
        self.counters.completions += report.counts.completions
        self.counters.hero_completions += report.counts.hero_completions
        self.counters.bad_completions += report.counts.bad_completions
        self.counters.zero_variance_skips += report.counts.skipped_zero_variance
        self.journal.stats.match(report)
        return report
