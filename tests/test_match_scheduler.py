"""The driver's match scheduler: a run whose every LLM request fails ends with the server's error instead of
playing on with holds and nothing to train (a `model=small` run on a server of too narrow LoRA slots once
ran its whole budget that way)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from diprl.messages import Match, MatchReport, MatchResult, PlayCounts, PolicyRef
from diprl.run.journal import Journal
from diprl.run.matches import MatchScheduler, ServingFailed
from diprl.run.progress import RunStats
from diprl.run.rundir import Counters
from diprl.tracking import Tracker
from tests.ray_stand_in import Actor, Ref, Remote, use_stand_in_ray

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")
SEATS = dict.fromkeys(POWERS, PolicyRef.parse("main@v1"))


class Worker:
    def __init__(self, reports: list[MatchReport]) -> None:
        self.reports = reports
        self.play = Remote(lambda match: self.reports.pop(0))


class League:
    def __init__(self) -> None:
        self.count = 0
        self.heroes: list[str] = []  # the policy each match was asked for
        self.next_match = Remote(self._next)
        self.report = Remote(lambda results: None)

    def _next(self, policy: str) -> Match:
        self.count += 1
        self.heroes.append(policy)
        return Match(f"m{self.count}", SEATS, "FRANCE", self.count)


def report(completions: int, failed: int, error: str | None = None) -> MatchReport:
    return MatchReport("m", [], [], PlayCounts(completions=completions, failed_requests=failed, first_error=error))


def scheduler(tmp_path: Path, reports: list[MatchReport], monkeypatch: pytest.MonkeyPatch) -> MatchScheduler:
    use_stand_in_ray(monkeypatch)
    journal = Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())
    return MatchScheduler(League(), [Worker(reports)], 2, ["main"], 0, journal, Counters())


def drain(s: MatchScheduler, n: int) -> None:
    for _ in range(n):
        s.fill()
        s.handle(s.refs()[0])


def test_a_server_that_fails_every_request_ends_the_run_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = "LoRA rank 16 is greater than max_lora_rank 8"
    s = scheduler(tmp_path, [report(10, 10, error) for _ in range(8)], monkeypatch)
    assert s.failing_limit == 4  # two rounds of one worker's two matches, at least 4
    drain(s, 3)
    with pytest.raises(ServingFailed, match="last 4 matches failed; the PolicyServer said: LoRA rank 16"):
        drain(s, 1)


def test_matches_go_to_the_policies_by_their_weights_interleaved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_stand_in_ray(monkeypatch)
    journal = Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())
    roles = ["main", "main_exploiter", "league_exploiter"]

    def heroes(weights: dict[str, float], matches: int) -> list[str]:
        league = League()
        workers = [Worker([report(1, 0)] * matches) for _ in range(2)]
        s = MatchScheduler(league, workers, 1, roles, 0, journal, Counters(), weights=weights)
        while league.count < matches:
            s.fill()
            s.handle(s.refs()[0])
        return league.heroes[:matches]

    assert heroes({}, 6) == roles * 2  # equal weights: the policies in turn, as before weights existed
    assert heroes({"main": 1}, 6) == roles * 2  # a policy not named weighs 1
    weighted = heroes({"main": 1, "main_exploiter": 3, "league_exploiter": 3}, 14)
    assert [weighted.count(r) for r in roles] == [2, 6, 6]
    # Interleaved, not in runs: no exploiter is the hero of more than two matches in a row.
    assert all(len(set(weighted[i : i + 3])) > 1 for i in range(len(weighted) - 2))
    with pytest.raises(ValueError, match="match weights must be positive"):
        MatchScheduler(League(), [], 1, roles, 0, journal, Counters(), weights={"main": 0.0})


def test_failures_that_are_not_every_request_or_not_in_a_row_play_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = [report(10, 10, "x"), report(10, 10, "x"), report(10, 10, "x"), report(10, 9, "x")] * 3
    bots_only = [report(0, 0)] * 6  # a match with no LLM seat has nothing to fail
    s = scheduler(tmp_path, mixed + bots_only + [report(10, 0)] * 2, monkeypatch)
    drain(s, len(mixed) + len(bots_only))
    assert s.failing == 0 and s.counters.matches == len(mixed) + len(bots_only)


def test_bad_completions_tied_groups_and_stage_timings_reach_the_runs_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found: the workers counted bad completions and tied groups and timed every stage, and the driver
    dropped all of it: a run whose model wrote 30% malformed orders looked healthy in metrics.jsonl."""
    from types import SimpleNamespace

    from diprl.messages import PolicyRef, StepReport
    from diprl.run.learning import LearnerLoop
    from diprl.tracking import read_metrics

    logged: list[dict[str, float]] = []
    fake_wandb = SimpleNamespace(
        init=lambda **kwargs: SimpleNamespace(log=logged.append, finish=lambda: None), Settings=lambda **kw: kw
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    stages = {"play": 4.0, "deliver": 0.5, "inference": 2.0, "engine": 1.0, "bots": 0.25}

    def forks(match: str, *hero_centres: int) -> list[MatchResult]:
        return [
            MatchResult(match, i, SEATS, "FRANCE", {"FRANCE": c}, {"FRANCE": 1}, "F1902M", None, len(hero_centres))
            for i, c in enumerate(hero_centres)
        ]

    played = [
        MatchReport(
            "m1",
            forks("m1", 5, 5, 5),  # the hero's centres the same in every fork: a level outcome
            ["g1"],
            PlayCounts(completions=10, bad_completions=3, skipped_zero_variance=1),
            timings=stages,
        ),
        MatchReport(
            "m2", forks("m2", 4, 6, 5), ["g2", "g3"], PlayCounts(completions=10), timings=dict.fromkeys(stages, 0.0)
        ),
    ]
    s = scheduler(tmp_path, played, monkeypatch)
    s.journal.tracker = Tracker(tmp_path, {}, use_wandb=True)
    s.fill()  # both matches in flight on the one worker
    for ref in s.refs():
        s.handle(ref)
    league = Actor(SimpleNamespace(pending_rollback=lambda policy: None))  # asked after each step: none pending
    loop = LearnerLoop({"main": None}, {"main": SimpleNamespace(qsize=lambda: 0)}, league, s.journal, list, print)
    ref = Ref(StepReport("main", 1, True, PolicyRef.parse("main@v1")))
    loop.stepping[ref] = "main"
    loop.handle(ref)
    s.journal.tracker.close()
    [rollout] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "rollout"]
    assert rollout["rollout/bad_completion_rate"] == 3 / 20
    assert rollout["rollout/zero_variance_rate"] == 1 / 4  # one tied seat of four compared
    assert rollout["rollout/level_outcome_rate"] == 1 / 2  # one match of two ended level in every fork
    assert {k: rollout[f"rollout/{k}_s"] for k in stages} == {k: v / 2 for k, v in stages.items()}  # per match
    assert (s.counters.bad_completions, s.counters.zero_variance_skips) == (3, 1)  # whole run, kept on resume
    [wandb_row] = [row for row in logged if "main/rollout/bad_completion_rate" in row]
    assert wandb_row["main/rollout/zero_variance_rate"] == 0.25 and wandb_row["main/rollout/inference_s"] == 1.0


def test_a_match_is_level_when_its_hero_ends_every_fork_with_the_same_centres() -> None:
    from diprl.run.progress import level_outcome

    def played(*hero_centres: int) -> MatchReport:
        results = [
            MatchResult("m", i, SEATS, "FRANCE", {"FRANCE": c, "ENGLAND": i}, {"FRANCE": 1}, "F1902M", None, 3)
            for i, c in enumerate(hero_centres)
        ]
        return MatchReport("m", results, [])

    # Other powers' centres differ in every fork here: only the hero's count decides.
    assert (level_outcome(played(5, 5, 5)), level_outcome(played(5, 6, 5)), level_outcome(played(5))) == (
        True,
        False,
        None,
    )
