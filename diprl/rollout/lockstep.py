"""Lockstep play: one phase of every game in flight, with ONE batched policy call per phase.

Training episodes, the evaluation suite and the arena all play games the same way: rule-bot seats
decide locally, every LLM seat of every game is sent to the policy in one `generate` call, then every
game steps. Batching across games is what fills the PolicyServer's batch (and a GPU replica's
`max_num_seqs`): an LLM seat waits for one call per phase, not one per game.

A caller describes its games as **jobs**: generators that yield the `Table`s (games and who plays
them) to advance by one phase, receive one `PhaseOutcome` per table, and return their result when
they end. `drive` keeps up to `max_active` jobs going from a `JobSource`, starts a new job as one ends
(so the batch stays full), and advances every active job's tables in one `play_phase` call per step:

    def job(spec):                      # one game to its end
        table = Table(DiplomacyGame(), seats, bots, ...)
        while not table.game.is_done:
            (outcome,) = yield [table]
        return result_of(table)

    drive(IterSource(job(s) for s in specs), client, max_active=64, on_done=results.append)

An episode that forks a decision state yields all its forks at once, so the G forks of a group, the
seven seats of each fork and many matches share one call. A job that raises fails alone (`on_error`);
a failed policy call fails the jobs that were waiting on it, never the loop.
"""

from __future__ import annotations

import hashlib
import queue
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from diprl.bots.base import Agent
from diprl.game import DiplomacyGame, PhaseRecord
from diprl.messages import Generation, GenerationRequest, LegalOrders, PolicyRef
from diprl.policy.prompt import build_prompt
from diprl.rollout.search import PendingSearch, SearchConfig, plan_search


class PolicyClient(Protocol):
    """Answers a batch of generation requests, one `Generation` per request, in order."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...


SeedFn = Callable[[str, str], int | None]
"""(power, phase) -> the sampling seed of that seat's request (reproducible evaluation, common random numbers
across a group's forks); None leaves that request's sampling to the engine."""


TemperatureFn = Callable[[str, str], float]
"""(power, phase) -> the sampling temperature of that seat's request, where seats of one table differ (a
group's forks: the compared decisions at the rollout's temperature, the rest at `untrained_temperature`)."""


def request_seed(game_seed: int, power: str, phase: str, stream: int = 0) -> int:
    """The sampling seed of one seat's decision in one game: stable across processes and runs."""
    digest = hashlib.sha256(f"{stream}:{game_seed}:{power}:{phase}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits: a non-negative int64


@dataclass
class Table:
    """A game in progress and how each of its seats is played.

    `seats` maps every power to its PolicyRef; powers in `bots` are decided by that rule agent, the
    others by the policy client. `sample_seed` (None: sampling left to the engine) seeds each LLM
    seat's request reproducibly from its power and phase; `temperature_of` (None: `temperature` for every
    seat) gives each its temperature. LLM seats in `search` decide their movement phases by one-ply search
    (`diprl.rollout.search`), its requests in the same call.
    """

    game: DiplomacyGame
    seats: Mapping[str, PolicyRef | str]  # text where the caller holds text (the web's seats, the suite's specs)
    bots: Mapping[str, Agent]
    temperature: float = 1.0
    max_tokens: int = 384
    sample_seed: SeedFn | None = None
    temperature_of: TemperatureFn | None = None
    search: Mapping[str, SearchConfig] = field(default_factory=dict)

    def request(self, power: str) -> GenerationRequest:
        game = self.game
        return GenerationRequest(
            policy=str(self.seats[power]),
            prompt=build_prompt(game, power).text,
            legal=game.legal_orders(power).to_dict(),
            temperature=self.temperature if self.temperature_of is None else self.temperature_of(power, game.phase),
            max_tokens=self.max_tokens,
            sample_seed=None if self.sample_seed is None else self.sample_seed(power, game.phase),
        )


@dataclass(frozen=True)
class Turn:
    """One LLM seat's turn: the phase, the legal orders that constrained it, and the policy's answer."""

    phase: str
    legal: LegalOrders
    answer: Generation


@dataclass(frozen=True)
class PhaseOutcome:
    """What one phase of one table produced: the engine's record and every LLM seat's turn."""

    record: PhaseRecord
    turns: Mapping[str, Turn]  # power -> turn (LLM seats only)


@dataclass
class LockstepStats:
    """Counters of a lockstep run: steps (one per `play_phase`), policy calls, requests (the batch sizes a
    client saw), game phases, searched decisions (and those where search played another answer than the
    greedy one), seconds (a search's adjudications count as the engine's)."""

    steps: int = 0
    calls: int = 0
    requests: int = 0
    phases: int = 0
    searches: int = 0
    search_changed: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"inference": 0.0, "engine": 0.0, "bots": 0.0})


@dataclass(frozen=True)
class _Seat:
    """An LLM seat of one phase: its table, its power and its requests' span in the call (one, or a search's)."""

    table: int
    power: str
    start: int
    stop: int
    search: PendingSearch | None


def play_phase(
    tables: Sequence[Table], client: PolicyClient | None, stats: LockstepStats | None = None
) -> list[PhaseOutcome]:
    """One phase of every table (each must have a game not yet done), in ONE `client.generate` call.

    A failed request costs only its seat's orders: its `Generation.error` is set and the game layer
    replaces the missing orders with defaults and reports them in the record's issues.
    """
    stats = stats if stats is not None else LockstepStats()
    orders: list[dict[str, list[str]]] = [{} for _ in tables]
    requests: list[GenerationRequest] = []
    seats: list[_Seat] = []
    start = time.perf_counter()
    for k, table in enumerate(tables):
        if table.game.is_done:
            raise ValueError(f"table {k} is finished ({table.game.phase}): nothing to play")
        for power in table.game.orderable_powers():
            bot = table.bots.get(power)
            if bot is not None:
                orders[k][power] = bot.orders(table.game, power)
                continue
            request = table.request(power)
            search = table.search.get(power)
            pending = None if search is None else plan_search(table.game, power, request, search)
            mine = [request] if pending is None else list(pending.requests)
            seats.append(_Seat(k, power, len(requests), len(requests) + len(mine), pending))
            requests += mine
    stats.seconds["bots"] += time.perf_counter() - start
    turns: list[dict[str, Turn]] = [{} for _ in tables]
    if requests:
        if client is None:
            names = sorted({r.policy for r in requests})
            raise ValueError(f"LLM seats ({', '.join(names)}) need a policy client")
        start = time.perf_counter()
        answers = client.generate(requests)
        stats.seconds["inference"] += time.perf_counter() - start
        if len(answers) != len(requests):
            raise RuntimeError(f"the policy client answered {len(answers)} of {len(requests)} requests")
        stats.calls += 1
        stats.requests += len(requests)
        start = time.perf_counter()
        for seat in seats:
            request, answer = requests[seat.start], answers[seat.start]
            if seat.search is not None:
                outcome = seat.search.choose(answers[seat.start : seat.stop])
                answer = outcome.answer
                stats.searches += 1
                stats.search_changed += outcome.changed
            assert request.legal is not None
            phase = tables[seat.table].game.phase
            turns[seat.table][seat.power] = Turn(phase=phase, legal=request.legal, answer=answer)
            orders[seat.table][seat.power] = list(answer.orders)  # the game layer fills defaults, reports issues
        stats.seconds["engine"] += time.perf_counter() - start  # a search's adjudications
    start = time.perf_counter()
    records = [table.game.step(orders[k]) for k, table in enumerate(tables)]
    stats.seconds["engine"] += time.perf_counter() - start
    stats.phases += len(tables)
    stats.steps += 1
    return [PhaseOutcome(record, turns[k]) for k, record in enumerate(records)]


Job = Generator[Sequence[Table], Sequence[PhaseOutcome], Any]
"""Yields the tables to advance by one phase, receives their outcomes, returns its result."""


class JobSource(Protocol):
    def take(self, block: bool) -> Job | None:
        """The next job; with `block` False, None when none is ready now; with `block` True, None
        only when no job will ever come (the source is closed or exhausted)."""
        ...


class IterSource:
    """A finite iterable of jobs as a source."""

    def __init__(self, jobs: Iterable[Job]) -> None:
        self._jobs: Iterator[Job] = iter(jobs)

    def take(self, block: bool) -> Job | None:
        return next(self._jobs, None)


class QueueSource:
    """Jobs put in from other threads (a rollout worker's incoming matches); `close()` ends `drive`."""

    _CLOSED = object()

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()

    def put(self, job: Job) -> None:
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(self._CLOSED)

    def take(self, block: bool) -> Job | None:
        try:
            item = self._queue.get(block=block)
        except queue.Empty:
            return None
        if item is self._CLOSED:
            self._queue.put(item)  # every later take sees it too
            return None
        return item


@dataclass
class _Active:
    job: Job
    tables: Sequence[Table]


def drive(
    source: JobSource,
    client: PolicyClient | None,
    max_active: int,
    on_done: Callable[[Job, Any], None],
    on_error: Callable[[Job, BaseException], None] | None = None,
    stats: LockstepStats | None = None,
) -> LockstepStats:
    """Play jobs from `source` in lockstep, up to `max_active` at once, until the source runs dry.

    `on_done(job, result)` gets each job's return value as it ends; `on_error(job, exc)` each job that
    raised (without it the exception propagates and ends the run). When the policy call itself fails,
    every job of that step fails with its exception (each one's caller decides to replay it).
    """
    if max_active < 1:
        raise ValueError(f"max_active must be >= 1, got {max_active}")
    stats = stats if stats is not None else LockstepStats()
    active: list[_Active] = []

    def fail(job: Job, exc: BaseException) -> None:
        job.close()
        if on_error is None:
            raise exc
        on_error(job, exc)

    def advance(job: Job, sent: Sequence[PhaseOutcome] | None) -> None:
        try:
            tables = next(job) if sent is None else job.send(sent)
        except StopIteration as stop:
            on_done(job, stop.value)
            return
        except Exception as exc:
            fail(job, exc)
            return
        if not tables:
            fail(job, ValueError("a lockstep job yielded no table: it must yield games to play or return"))
            return
        active.append(_Active(job, tables))

    while True:
        while len(active) < max_active:
            job = source.take(block=not active)
            if job is None:
                break
            advance(job, None)
        if not active:  # the blocking take above found the source dry
            return stats
        stepping, active = active, []
        flat = [table for entry in stepping for table in entry.tables]
        try:
            outcomes = play_phase(flat, client, stats)
        except Exception as exc:  # the policy call or an engine step failed: every job of this step fails
            for entry in stepping:
                fail(entry.job, exc)
            continue
        offset = 0
        for entry in stepping:
            mine = outcomes[offset : offset + len(entry.tables)]
            offset += len(entry.tables)
            advance(entry.job, mine)
