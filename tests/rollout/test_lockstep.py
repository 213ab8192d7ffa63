"""The lockstep runner: one policy call per phase for every game in flight, new jobs as old ones end,
a failing job or policy call failing only what depends on it."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import pytest

from diprl.bots import make_agent
from diprl.game import DiplomacyGame
from diprl.messages import Generation, GenerationRequest
from diprl.rollout.lockstep import IterSource, LockstepStats, PhaseOutcome, QueueSource, Table, drive, play_phase
from tests.eval.conftest import RecordingClient

POWERS = ("AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY")


def _table(llm: Sequence[str] = ("FRANCE",), seed: int = 0, max_year: int = 1902) -> Table:
    seats = {p: ("base" if p in llm else "bot:random") for p in POWERS}
    bots = {p: make_agent("random", seed + i) for i, p in enumerate(POWERS) if p not in llm}
    return Table(DiplomacyGame(max_year=max_year), seats, bots)


def _game_job(table: Table, phases: int) -> Generator[Sequence[Table], Sequence[PhaseOutcome], int]:
    played = 0
    while played < phases and not table.game.is_done:
        (outcome,) = yield [table]
        assert outcome.record.name  # a real engine record came back
        played += 1
    return played


def test_one_policy_call_per_phase_holds_every_llm_seat_of_every_game() -> None:
    client = RecordingClient()
    tables = [_table(("FRANCE", "ITALY"), seed=s) for s in range(3)]
    outcomes = play_phase(tables, client)
    assert len(client.calls) == 1 and len(client.calls[0]) == 6  # 3 games x 2 LLM seats
    assert all(set(o.turns) == {"FRANCE", "ITALY"} for o in outcomes)
    assert all(t.game.phase == "F1901M" for t in tables)


def test_drive_keeps_the_batch_full_and_starts_jobs_as_others_end() -> None:
    """Five jobs, three at a time, of different lengths: every step asks for every active game's seats."""
    client = RecordingClient()
    lengths = [1, 3, 2, 4, 2]
    done: list[int] = []
    stats = drive(
        IterSource(_game_job(_table(seed=i), n) for i, n in enumerate(lengths)),
        client,
        max_active=3,
        on_done=lambda job, played: done.append(played),
    )
    assert sorted(done) == sorted(lengths)
    # 12 phases in all, never more than 3 games a step, and a freed slot is refilled at once: steps of
    # 3, 3, 3, 2, 1 games (waves of three would take 4 + 4 = 8 steps).
    assert stats.phases == sum(lengths) and stats.steps == 5
    sizes = [len(call) for call in client.calls]  # France has nothing to order in some winters: no request
    assert max(sizes) == 3 and sum(sizes) == stats.requests <= stats.phases


def test_a_failing_job_fails_alone() -> None:
    def broken(table: Table) -> Generator[Sequence[Table], Sequence[PhaseOutcome], int]:
        yield [table]
        raise RuntimeError("a bug in one episode")

    errors: list[BaseException] = []
    done: list[int] = []
    drive(
        IterSource([broken(_table(seed=0)), _game_job(_table(seed=1), 3)]),
        RecordingClient(),
        max_active=2,
        on_done=lambda job, n: done.append(n),
        on_error=lambda job, exc: errors.append(exc),
    )
    assert done == [3] and [str(e) for e in errors] == ["a bug in one episode"]


class _Unreachable:
    def __init__(self) -> None:
        self.calls = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        self.calls += 1
        raise ConnectionError("the PolicyServer is restarting")


def test_a_failed_policy_call_fails_the_jobs_waiting_on_it_not_the_loop() -> None:
    errors: list[BaseException] = []
    bots_only = _table(llm=(), seed=5)
    done: list[int] = []
    drive(
        IterSource([_game_job(_table(seed=0), 2), _game_job(_table(seed=1), 2)]),
        _Unreachable(),
        max_active=2,
        on_done=lambda job, n: done.append(n),
        on_error=lambda job, exc: errors.append(exc),
    )
    assert len(errors) == 2 and all(isinstance(e, ConnectionError) for e in errors)
    # Without LLM seats no call is made at all.
    drive(IterSource([_game_job(bots_only, 3)]), None, 1, on_done=lambda job, n: done.append(n))
    assert done == [3]


def test_a_queue_source_feeds_jobs_from_other_threads_until_closed() -> None:
    import threading

    source = QueueSource()
    done: list[int] = []
    loop = threading.Thread(target=drive, args=(source, RecordingClient(), 4, lambda job, n: done.append(n)))
    loop.start()
    for i in range(3):
        source.put(_game_job(_table(seed=i), 2))
    source.close()
    loop.join(timeout=60)
    assert not loop.is_alive() and done == [2, 2, 2]


def test_jobs_must_yield_games_and_tables_must_have_moves_left() -> None:
    def empty() -> Generator[Sequence[Table], Any, None]:
        yield []

    errors: list[BaseException] = []
    drive(IterSource([empty()]), None, 1, on_done=lambda job, r: None, on_error=lambda job, e: errors.append(e))
    assert "yielded no table" in str(errors[0])
    finished = _table(max_year=1901)
    while not finished.game.is_done:
        play_phase([finished], RecordingClient())
    with pytest.raises(ValueError, match="finished"):
        play_phase([finished], RecordingClient(), LockstepStats())
