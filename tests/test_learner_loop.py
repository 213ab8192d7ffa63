"""The driver's learner loop (`diprl.run.learning.LearnerLoop`) with stand-in actors.

Found (issue 35): in self-play a CPU learner's step of 0.15 s waited about 0.7 s of the driver's
bookkeeping of the step before (journal, league and pruning calls) before it was asked for the next. The
next `train_next` is now sent as soon as the report is read; a reset the league asks for is sent before
it (an actor runs one caller's calls in order). And the run counts, per policy, where the delivered
groups went: trained, dropped as stale or foreign, quarantined.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.league.role_state import VersionDecision
from diprl.messages import Match, MatchReport, PolicyRef, QuarantinedRecord, StepReport
from diprl.run.journal import Journal
from diprl.run.learning import LearnerLoop
from diprl.run.matches import MatchScheduler
from diprl.run.progress import RunStats, progress_fields
from diprl.run.rundir import Counters
from tests.ray_stand_in import Ref


class Method:
    """A Ray method stand-in: `.remote(...)` notes `name` in the call log and returns a ref to `answer(...)`."""

    def __init__(self, calls: list[str], name: str, answer: Any = None) -> None:
        self.calls, self.name, self.answer = calls, name, answer

    def remote(self, *args: Any) -> Ref:
        self.calls.append(self.name)
        return Ref(self.answer(*args) if callable(self.answer) else self.answer, self.name)


class Actor:
    """A learner or the league: every attribute is a `Method` noted as `<actor>.<method>`."""

    def __init__(self, calls: list[str], name: str, **answers: Any) -> None:
        self._calls, self._name, self._answers = calls, name, answers

    def __getattr__(self, method: str) -> Method:
        if method.startswith("_"):
            raise AttributeError(method)
        return Method(self._calls, f"{self._name}.{method}", self._answers.get(method))


class Tracker:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def log(self, kind: str, values: dict[str, Any], policy: str = "main") -> None:
        self.calls.append(f"log.{kind}")
        self.records.append((kind, policy, dict(values)))


def decision(reset: bool) -> VersionDecision:
    return VersionDecision(snapshot=reset, reset=reset, member=None, steps_since_snapshot=1, win_rate=0.5)


def loop_of(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    policies: tuple[str, ...] = ("main",),
    reset: bool = False,
    may_reset: bool = False,
    delivered: dict[str, int] | None = None,
) -> tuple[LearnerLoop, list[str], Tracker]:
    import ray

    calls: list[str] = []

    def get(ref: Ref) -> Any:
        calls.append(f"get:{ref.name}")
        return ref.value

    def wait(refs: list[Ref], num_returns: int = 1) -> tuple[list[Ref], list[Ref]]:
        calls.extend(f"wait:{ref.name}" for ref in refs)
        return refs[:num_returns], refs[num_returns:]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    tracker = Tracker(calls)
    learners = {
        p: Actor(calls, p, reset=f"{p}@v9", state={"step": 0, "version": f"{p}@v1", "counters": {}}) for p in policies
    }
    league = Actor(calls, "league", register_version=decision(reset), refs_in_use=["bot:random"], pending_reset=False)
    loop = LearnerLoop(
        learners,
        {p: SimpleNamespace(qsize=lambda: 0) for p in policies},
        league,
        Journal(tmp_path, tracker, RunStats()),
        list,
        lambda reason, code: None,
        running=lambda: True,
        may_reset=lambda policy: may_reset,
        delivered=lambda policy: (delivered or {}).get(policy, 0),
    )
    monkeypatch.setattr(loop.journal, "supersede", lambda policy, step: 0)
    monkeypatch.setattr(loop.journal, "recover_learner_records", lambda policy, step: 0)
    return loop, calls, tracker


def step_report(step: int, published: bool = True, **metrics: Any) -> StepReport:
    version = PolicyRef.adapter("main", step + 1)
    return StepReport("main", step, True, version, published=version if published else None, metrics=metrics)


def answer(loop: LearnerLoop, report: StepReport | None, policy: str = "main") -> StepReport | None:
    ref = Ref(report, f"{policy}.train_next")
    loop.stepping[ref] = policy
    return loop.handle(ref)


def test_the_next_step_is_asked_for_before_the_steps_bookkeeping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy the league never resets: its learner is asked for its next step before the driver logs the
    step, waits for the league's answer to the published version, or asks which versions to keep."""
    loop, calls, tracker = loop_of(tmp_path, monkeypatch)
    answer(loop, step_report(1))
    asked = calls.index("main.train_next")
    assert calls[:asked] == ["get:main.train_next", "league.register_version"]  # sent, its answer not awaited
    for later in ("get:league.register_version", "log.learner", "log.league", "league.refs_in_use", "log.rollout"):
        assert calls.index(later) > asked, later
    assert list(loop.stepping.values()) == ["main"]  # one step in flight, not two
    [league] = [v for kind, _, v in tracker.records if kind == "league"]
    assert league["version"] == "main@v2" and league["reset"] is False
    [rollout] = [v for kind, _, v in tracker.records if kind == "rollout"]
    assert rollout["driver/answer_s"] >= 0 and rollout["driver/bookkeeping_s"] >= 0

    loop.stepping.clear()
    answer(loop, None)  # no batch came in time: asked again at once
    assert list(loop.stepping.values()) == ["main"]


def test_a_reset_reaches_the_learner_before_its_next_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy the league may reset waits for the league's answer; on a reset, `reset` is sent and has run
    before the next `train_next` is sent (a learner host's threads keep no call order), so the next step
    trains the fresh adapter."""
    loop, calls, _ = loop_of(tmp_path, monkeypatch, reset=True, may_reset=True)
    answer(loop, step_report(3))
    sequence = ("get:league.register_version", "main.reset", "wait:main.reset", "main.train_next")
    order = [calls.index(c) for c in sequence]
    assert order == sorted(order)
    assert calls.count("league.register_version") == 2  # the published version, then the reset's
    assert loop.versions["main"] == "main@v9"

    calls.clear()
    loop.stepping.clear()
    loop.league = Actor(calls, "league", register_version=decision(False), refs_in_use=[])
    answer(loop, step_report(4))
    assert "main.reset" not in calls and not any(c.startswith("wait:") for c in calls)  # nothing to wait for
    assert calls.index("get:league.register_version") < calls.index("main.train_next")


def test_no_next_step_once_the_budget_is_spent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`running` is asked after the step is counted: a run ends at its `max_steps` without one more step."""
    loop, calls, _ = loop_of(tmp_path, monkeypatch)
    loop.running = lambda: loop.steps["main"] < 2
    answer(loop, step_report(1))
    assert calls.count("main.train_next") == 1
    loop.stepping.clear()
    answer(loop, step_report(2))
    assert calls.count("main.train_next") == 1 and not loop.stepping


def test_each_policys_groups_are_counted_where_they_went(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per policy: delivered, trained, dropped as stale or foreign, quarantined (groups with a quarantined
    record), from the learner's counters at start plus each step, and the share trained."""
    delivered = {"main": 40, "main_exploiter": 8}
    loop, _, tracker = loop_of(tmp_path, monkeypatch, ("main", "main_exploiter"), delivered=delivered)
    loop.learners["main"] = Actor(
        [], "main", state={"step": 5, "version": "main@v6", "counters": {"groups_trained": 12, "dropped_stale": 3}}
    )
    loop.start()
    assert loop.trained_share("main") == 12 / 40
    bad = [QuarantinedRecord("constraint", "...", "m1/S1901M/FRANCE", "main@v6", i) for i in (0, 1)]
    answer(
        loop,
        StepReport(
            "main", 6, True, PolicyRef.parse("main@v7"), metrics={"groups": 4, "dropped_stale": 2}, quarantined=bad
        ),
    )
    answer(loop, StepReport("main", 7, True, PolicyRef.parse("main@v8"), metrics={"groups": 4, "dropped_foreign": 1}))
    answer(
        loop,
        StepReport(
            "main_exploiter", 1, True, PolicyRef.parse("main_exploiter@v2"), metrics={"groups": 2, "dropped_stale": 6}
        ),
        "main_exploiter",
    )
    rollouts = {p: v for kind, p, v in tracker.records if kind == "rollout"}
    main = {k: v for k, v in rollouts["main"].items() if k.startswith("groups/")}
    assert main == {
        "groups/delivered": 40,
        "groups/trained": 20,
        "groups/dropped_stale": 5,
        "groups/dropped_foreign": 1,
        "groups/quarantined": 1,
        "groups/trained_share": 0.5,
    }
    exploiter = rollouts["main_exploiter"]
    assert (exploiter["groups/trained"], exploiter["groups/dropped_stale"]) == (2, 6)
    assert exploiter["groups/trained_share"] == 0.25 and loop.trained_share("main") == 0.5


def test_the_match_scheduler_counts_the_groups_delivered_to_each_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group goes to the queue of the policy in its seat: the match's seats say whose it was."""
    import ray

    monkeypatch.setattr(ray, "get", lambda ref: ref.value)
    seats = dict.fromkeys(("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA"), PolicyRef.parse("main@v3"))
    seats["TURKEY"] = PolicyRef.parse("main_exploiter@v2")
    match = Match("m1", seats, "TURKEY", 1, train=("TURKEY", "FRANCE", "ITALY"))
    played = MatchReport("m1", [], ["m1/S1901M/TURKEY", "m1/F1901M/FRANCE", "m1/S1902M/ITALY"])
    calls: list[str] = []
    league = Actor(calls, "league", next_match=match)
    worker = Actor(calls, "worker", play=played)
    journal = Journal(tmp_path, Tracker(calls), RunStats())
    counters = Counters()
    s = MatchScheduler(league, [worker], 1, ["main"], 0, journal, counters)
    s.fill()
    s.handle(s.refs()[0])
    assert counters.delivered == {"main": 2, "main_exploiter": 1} and counters.groups == 3


def test_the_progress_line_shows_the_share_trained() -> None:
    fields = progress_fields(RunStats(), 3, {}, 2, "main@v4", {}, None, trained_share=0.914)
    assert list(fields)[5:8] == ["queue", "trained", "lag"] and fields["trained"] == 0.91
    assert "trained" not in progress_fields(RunStats(), 3, {}, 2, "main@v4", {}, None)
