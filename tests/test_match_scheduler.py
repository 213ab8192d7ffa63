"""The driver's match scheduler: a run whose every LLM request fails ends with the server's error instead of
playing on with holds and nothing to train (a `model=small` run on a server of too narrow LoRA slots once
ran its whole budget that way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diprl.messages import Match, MatchReport
from diprl.run.journal import Journal
from diprl.run.matches import MatchScheduler, ServingFailed
from diprl.run.progress import RunStats
from diprl.run.rundir import Counters
from diprl.tracking import Tracker

SEATS = {p: "main@v1" for p in ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")}


class Ref:
    """An object ref stand-in (hashable, like Ray's): `ray.get` returns its value."""

    def __init__(self, value: Any) -> None:
        self.value = value


class Remote:
    """A Ray method stand-in: `.remote(...)` returns a ref to what `answer` gives."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self, *args: Any) -> Ref:
        return Ref(self.answer(*args))


class Worker:
    def __init__(self, reports: list[MatchReport]) -> None:
        self.reports = reports
        self.play = Remote(lambda match: self.reports.pop(0))


class League:
    def __init__(self) -> None:
        self.count = 0
        self.next_match = Remote(self._next)
        self.report = Remote(lambda results: None)

    def _next(self, policy: str) -> Match:
        self.count += 1
        return Match(f"m{self.count}", SEATS, "FRANCE", self.count)


def report(completions: int, failed: int, error: str | None = None) -> MatchReport:
    return MatchReport("m", [], [], completions=completions, failed_requests=failed, first_error=error)


def scheduler(tmp_path: Path, reports: list[MatchReport], monkeypatch: pytest.MonkeyPatch) -> MatchScheduler:
    import ray

    monkeypatch.setattr(ray, "get", lambda ref: ref.value)
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


def test_failures_that_are_not_every_request_or_not_in_a_row_play_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mixed = [report(10, 10, "x"), report(10, 10, "x"), report(10, 10, "x"), report(10, 9, "x")] * 3
    bots_only = [report(0, 0)] * 6  # a match with no LLM seat has nothing to fail
    s = scheduler(tmp_path, mixed + bots_only + [report(10, 0)] * 2, monkeypatch)
    drain(s, len(mixed) + len(bots_only))
    assert s.failing == 0 and s.counters.matches == len(mixed) + len(bots_only)
