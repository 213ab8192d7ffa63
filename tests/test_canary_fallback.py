"""A version a replica refuses by its canary (issue 38) is never played again: the run goes on with the
role's newest version whose canary a replica passed (proven; a version between two canaries is not), else
its first version, in rollouts and in evaluations, and the refusal is a `fault` on record.

The driver's owners of work (`MatchScheduler`, `EvalSchedule`) talk to a real `LeagueManager` here
through Ray stand-ins: a refusal reported by one match reaches the league, and the next match and the
next evaluation play the version before it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diprl.league import LeagueConfig, LeagueManager
from diprl.messages import Match, MatchReport, PlayCounts
from diprl.run.config import EvalScheduleConfig
from diprl.run.evaluations import EvalSchedule
from diprl.run.journal import Journal
from diprl.run.matches import MatchScheduler, refused_version
from diprl.run.progress import RunStats, progress_fields
from diprl.run.rundir import Counters
from diprl.tracking import Tracker, read_metrics
from tests.ray_stand_in import Actor, Remote, use_stand_in_ray

REFUSAL = (
    "CanaryMismatch: main@v3: the engine's canary completions differ from the published weights' "
    "(canary 0: tokens differ from position 2 of 14; tolerance 0.0001): it does not serve the version that "
    "was trained; refused"
)


class Worker:
    """Plays whatever it is handed; its report says a replica refused main@v3 if a seat plays it."""

    def __init__(self) -> None:
        self.played: list[Match] = []
        self.play = Remote(self._play)

    def _play(self, match: Match) -> MatchReport:
        self.played.append(match)
        if "main@v3" in {str(ref) for ref in match.seats.values()}:
            return MatchReport(
                match.match_id, [], [], PlayCounts(completions=10, failed_requests=10, first_error=REFUSAL)
            )
        return MatchReport(match.match_id, [], [], PlayCounts(completions=10))


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LeagueManager, Journal]:
    use_stand_in_ray(monkeypatch)
    league = LeagueManager(LeagueConfig(), tmp_path)
    for number in (1, 2, 3):
        league.register_version("main", f"main@v{number}", number - 1)
    for number in (1, 2):  # a replica passed their canaries (learner.canary_every=1): fallbacks
        league.prove_version(f"main@v{number}")
    return league, Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())


def test_the_version_is_read_from_a_replicas_refusal() -> None:
    assert refused_version(REFUSAL) == "main@v3"
    assert refused_version("CanaryMismatch: exploiter-1@v12: its canary cannot be served (...); refused") == (
        "exploiter-1@v12"
    )
    assert refused_version("AdapterError: main@v3: not found") is None and refused_version(None) is None


def test_a_refused_version_is_a_fault_and_matches_go_on_with_the_last_verified_one(
    run: tuple[LeagueManager, Journal], tmp_path: Path
) -> None:
    league, journal = run
    worker = Worker()
    matches = MatchScheduler(Actor(league), [worker], 2, ["main"], 0, journal, Counters())
    for _ in range(4):  # two matches in flight on main@v3 both come back refused; the next ones play v2
        matches.fill()
        matches.handle(matches.refs()[0])
    heroes = [str(m.seats[m.hero]) for m in worker.played]
    assert heroes[:2] == ["main@v3", "main@v3"] and set(heroes[2:]) == {"main@v2"}, heroes
    assert all("main@v3" not in {str(ref) for ref in m.seats.values()} for m in worker.played[2:])
    assert league.serving("main") == "main@v2" and league.current("main") == "main@v3"
    assert matches.failing == 0  # a refusal is not a server that fails everything
    assert league.reported["matches"] == 0  # a refused seat's game (holds all along) never reaches the payoff
    journal.tracker.close()
    faults = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "fault"]
    assert len(faults) == 1, faults  # once per version, however many matches report it
    assert faults[0]["canary_refused"] == "main@v3" and faults[0]["serving"] == "main@v2"
    assert journal.stats.canary_refused == 1 and journal.stats.faults == 1
    line = progress_fields(journal.stats, 3, {}, 0, "main@v3", {}, None)
    assert line["canary_refused"] == 1


def test_an_evaluation_of_a_refused_version_plays_the_last_verified_one(run: tuple[LeagueManager, Journal]) -> None:
    league, journal = run
    league.refuse_version("main@v3", REFUSAL)
    asked: list[str] = []
    evaluator = Actor(type("Evaluator", (), {"evaluate": lambda self, version, tag: asked.append(version)})())
    evals = EvalSchedule(evaluator, EvalScheduleConfig(), journal, Counters(), league=Actor(league))
    evals.start("main@v3", 3)
    evals.fill(stopping=False)
    assert asked == ["main@v2"] and evals.protected() == ["main@v2"]


def test_the_league_falls_back_persists_refusals_and_moves_on_to_the_next_good_version(
    run: tuple[LeagueManager, Journal], tmp_path: Path
) -> None:
    league, _ = run
    first = league.refuse_version("main@v3", REFUSAL)
    assert first == {"version": "main@v3", "policy": "main", "serving": "main@v2", "new": True}
    assert league.refuse_version("main@v3", REFUSAL)["new"] is False
    assert "main@v2" in league.refs_in_use()  # the fallback's weights outlive pruning
    assert league.verified("main@v3") == "main@v2" and league.verified("main@v2") == "main@v2"
    summary = league.summary()
    assert summary["serving"] == {"main": "main@v2"} and set(summary["canary_refused"]) == {"main@v3"}
    assert league.rating("main@v3") == league.rating("main@v2")  # the role's rating, whichever version plays
    again = LeagueManager(LeagueConfig(), tmp_path)  # a restarted league remembers the refusal
    assert again.serving("main") == "main@v2" and again.next_match("main").seats  # and hands out v2
    again.register_version("main", "main@v4", 3)
    assert again.serving("main") == "main@v4"  # a newer version that no replica refused plays at once
    again.refuse_version("main@v4")
    assert again.serving("main") == "main@v2"
    for number in (1, 2):
        again.refuse_version(f"main@v{number}")
    assert again.serving("main") == "main@v4"  # nothing left to fall back on: the current one stays


def test_each_checked_version_is_a_canary_record_and_a_refusal_found_there_reaches_the_league(
    run: tuple[LeagueManager, Journal], tmp_path: Path
) -> None:
    """The driver reads a replica's canary stats (PolicyServer.status): per-version error and whether the
    served version is the published one become metrics; a refusal no match has met yet is a fault too."""
    from types import SimpleNamespace

    from diprl.run.driver import Driver

    league, journal = run
    matches = MatchScheduler(Actor(league), [Worker()], 1, ["main"], 0, journal, Counters())
    driver: Any = SimpleNamespace(journal=journal, matches=matches, canaries_logged=set())
    status = {"canary_errors": {"main@v1": 1.2e-7, "main@v3": float("inf")}, "canary_refused": ["main@v3"]}
    Driver._log_canaries(driver, status)
    Driver._log_canaries(driver, status | {"canary_errors": {**status["canary_errors"], "main@v2": 2.4e-7}})
    Driver._log_canaries(driver, "the server did not answer")  # nothing to log, nothing raised
    journal.tracker.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    canaries = [
        (r["version"], r["canary/error"], r["canary/served_is_published"]) for r in records if r["kind"] == "canary"
    ]
    assert canaries == [("main@v1", 1.2e-7, 1), ("main@v3", None, 0), ("main@v2", 2.4e-7, 1)]
    assert league.serving("main") == "main@v2"
    [fault] = [r for r in records if r["kind"] == "fault"]
    assert fault["canary_refused"] == "main@v3" and fault["serving"] == "main@v2"


def _versions(tmp_path: Path, last: int) -> LeagueManager:
    league = LeagueManager(LeagueConfig(), tmp_path)
    for number in range(1, last + 1):
        league.register_version("main", f"main@v{number}", number - 1)
    return league


def test_a_version_between_two_canaries_is_never_the_fallback(tmp_path: Path) -> None:
    """With learner.canary_every=10 only main@v1 and main@v11 carry a canary. main@v14 was served on its
    bytes alone: the fault that got main@v15 refused may have reached it too, so it does not stand in."""
    league = _versions(tmp_path, 15)
    for version in ("main@v1", "main@v11"):
        assert league.prove_version(version) == {"version": version, "new": True}
    assert league.prove_version("main@v11")["new"] is False
    assert "main@v11" in league.refs_in_use()  # the fallback-to-be outlives pruning before any refusal
    assert league.refuse_version("main@v15", REFUSAL)["serving"] == "main@v11"
    assert league.verified("main@v14") == "main@v14"  # not refused: served as it is
    league.refuse_version("main@v9")
    assert league.verified("main@v9") == "main@v1"  # not main@v8: the newest proven version before it
    league.refuse_version("main@v11")
    assert league.serving("main") == "main@v1"
    assert league.prove_version("main@v11")["new"] is False  # a refused version is never proven again
    again = LeagueManager(LeagueConfig(), tmp_path)  # proofs persist with the refusals
    assert again.serving("main") == "main@v1" and again.proven == ["main@v1", "main@v11"]


def test_with_no_proven_version_a_role_falls_back_to_its_first(tmp_path: Path) -> None:
    league = _versions(tmp_path, 3)
    assert league.refuse_version("main@v3", REFUSAL)["serving"] == "main@v1"  # not main@v2: unproven
    league.refuse_version("main@v1")
    assert league.serving("main") == "main@v3"  # nothing left to fall back on: the current one stays


def test_the_driver_proves_what_passed_before_it_hands_over_a_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One status can hold both: main@v12 refused and main@v2 passed. "main@v12" sorts before "main@v2";
    the proof still reaches the league first, so main@v2 stands in, not the first version."""
    from types import SimpleNamespace

    from diprl.run.driver import Driver

    use_stand_in_ray(monkeypatch)
    league = _versions(tmp_path, 12)
    journal = Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())
    matches = MatchScheduler(Actor(league), [Worker()], 1, ["main"], 0, journal, Counters())
    driver: Any = SimpleNamespace(journal=journal, matches=matches, canaries_logged=set())
    status = {"canary_errors": {"main@v12": float("inf"), "main@v2": 1.2e-7}, "canary_refused": ["main@v12"]}
    Driver._log_canaries(driver, status)
    journal.tracker.close()
    assert league.proven == ["main@v2"] and league.serving("main") == "main@v2"
    [fault] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "fault"]
    assert fault["canary_refused"] == "main@v12" and fault["serving"] == "main@v2"


def test_a_refusal_a_match_reports_first_reads_the_proofs_since_the_last_health_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """main@v2 passed its canary after the driver last read the server's status; main@v3 is refused by a
    match. The proofs are read before the refusal reaches the league, so main@v2 stands in, not main@v1."""
    from types import SimpleNamespace

    from diprl.run.driver import Driver

    use_stand_in_ray(monkeypatch)
    league = _versions(tmp_path, 3)
    league.prove_version("main@v1")
    journal = Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())
    status = {"canary_errors": {"main@v2": 1.2e-7}, "canary_refused": []}
    driver: Any = SimpleNamespace(journal=journal, canaries_logged=set())
    reads: list[int] = []

    def read_proofs() -> None:
        reads.append(1)
        Driver._log_canaries(driver, status)

    worker = Worker()
    driver.matches = MatchScheduler(
        Actor(league), [worker], 2, ["main"], 0, journal, Counters(), read_proofs=read_proofs
    )
    for _ in range(2):  # both matches in flight play main@v3 and come back refused: one read, one fault
        matches = driver.matches
        matches.fill()
        matches.handle(matches.refs()[0])
    journal.tracker.close()
    assert reads == [1]
    assert league.proven == ["main@v1", "main@v2"] and league.serving("main") == "main@v2"
    [fault] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "fault"]
    assert fault["canary_refused"] == "main@v3" and fault["serving"] == "main@v2"
