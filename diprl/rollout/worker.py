"""Ray actors that play matches many at a time and deliver their groups exactly once into bounded queues.

- `RolloutWorker` (CPU actor, restarted after a crash) keeps up to `matches_in_flight` matches going:
  each `play(match)` call hands a match to the worker's lockstep loop (a thread of its own, see
  `diprl.rollout.lockstep`), which plays one phase of every in-flight match, every fork and every LLM
  seat in ONE PolicyServer call, and starts the next match as one ends, so the engine's batch stays
  full. The call returns the match's `MatchReport` once its groups are delivered. Calls run
  concurrently (a threaded actor), so a call blocked on a full queue (backpressure) never stalls the
  loop. When the worker dies, Ray retries every interrupted call on the restarted worker: each match
  is replayed with its seed, and the ledger drops any group it already accepted.
- `GroupLedger` (async actor, restarted after a crash) is the only way into the learners' queues: it
  routes each `TrajectoryGroup` to the queue of its policy (`main@v3` -> `main`), remembers every
  group id it accepted (ids are `<match>/<phase>/<power>`; in an fsynced append-only file when given
  one, so a restarted ledger still knows them), and waits while a queue is full: backpressure instead
  of unbounded memory. Once the run stops consuming, `close()` makes waiting deliveries return
  refused (nothing half-delivered) instead of blocking their workers forever.
- `RolloutRunner` drives a few workers from a script (benchmarks, tests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.queue import Full, Queue

from diprl.atomic_io import write_file_atomic
from diprl.game.seating import game_seed, rotated_seats
from diprl.messages import GroupSeat, Match, MatchReport, TrajectoryGroup, group_seat
from diprl.rollout.episode import Episode, EpisodeConfig, EpisodeOutput
from diprl.rollout.lockstep import Job, LockstepStats, QueueSource, drive

CLOSE_POLL_S = 1.0  # how often a delivery waiting on a full queue checks whether the ledger was closed
SETTLE_POLL_S = 0.05  # how often a report waiting for a match's in-flight deliveries checks them


@dataclass
class WorkerConfig:
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    reward: str = "default"  # conf/reward/<name>.yaml
    client: str = "serve"  # "serve": the PolicyServer deployment; "uniform": a uniform constrained sampler
    serve_app: str = "policy"
    seed: int = 0
    train_turns: str | None = None  # overrides the reward config's credit.train_turns (fork | all)
    model: str = "tiny"  # the served model's preset: its tokenizer and logits width spell the completions
    matches_in_flight: int = 8  # matches one worker plays in lockstep (one policy call per phase for all)
    start_states: float = 0.0  # share of matches starting from a stored mid-game state
    trace_dir: str | None = None  # where sampled traces are written (<trace_dir>/<match_id>.json); None: not kept


def stratified_matches(
    n: int, hero_policy: str, opponents: Sequence[str], seed: int = 0, prefix: str = "m"
) -> Iterator[Match]:
    """Matches whose hero power cycles through all seven powers, so every batch covers every start."""
    from diprl.messages import PolicyRef, parse_seats

    trains = PolicyRef.parse(hero_policy).is_adapter
    for i in range(n):
        hero, texts = rotated_seats(i, hero_policy, opponents)
        seats = parse_seats(texts)
        yield Match(f"{prefix}{seed}-{i}", seats, hero=hero, seed=game_seed(seed, i), train=(hero,) * trains)


def make_episode(config: WorkerConfig) -> Episode:
    """The episode a worker plays: rubric and credit from the reward config, the model's token table."""
    from diprl.policy.models import load_preset, logits_width, preset_tokenizer_path
    from diprl.policy.tokenizer import load_tokenizer
    from diprl.policy.vocab import token_table
    from diprl.rollout.credit import CreditAssigner
    from diprl.rollout.rewards import Rubric, load_reward_config

    preset = load_preset(config.model)
    table = token_table(load_tokenizer(preset_tokenizer_path(preset)), logits_width(preset))
    reward = load_reward_config(config.reward)
    if config.train_turns is not None:
        reward = replace(reward, credit=replace(reward.credit, train_turns=config.train_turns))
    store = None
    if config.start_states > 0:
        from diprl.rollout.start_states import StartStateRecipe, load_or_build

        store = load_or_build(StartStateRecipe(max_year=config.episode.max_year))
    return Episode(config.episode, Rubric(reward), CreditAssigner(reward.credit), table, store, config.start_states)


def _queue(queue: Queue | str) -> Queue:
    """A queue, or a client of the queue actor with this name (its bound is enforced by the actor)."""
    if not isinstance(queue, str):
        return queue
    client = Queue.__new__(Queue)
    client.maxsize = 0
    client.actor = ray.get_actor(queue)
    return client


@ray.remote(max_restarts=-1, max_task_retries=-1)
class GroupLedger:
    """Exactly-once delivery of trajectory groups into bounded queues, one per trained policy.

    `queues` is one queue that takes every group, or a mapping from policy name to that policy's
    learner queue: a group goes to the queue of its version's policy (`main@v3` -> `main`). A group
    for a policy no learner trains (`base`) is counted, not queued.

    Queues may be given by the name of their actor (`Queue(actor_options={"name": ...})`), which is
    what a restartable ledger needs: a handle among the constructor arguments lives in the object
    store, and Ray cannot promise it survives until a restart (ray-project/ray#53727, an error-level
    line for every such actor); a name is a plain value.

    Exactly once means one group per seat of a match and fork point (`group_seat`): a match replayed
    after its worker died is played again from its seed, but sampling need not repeat itself, and the
    replay may fork at another phase than the attempt that already delivered; its group is dropped all
    the same, and `delivered_for` names the one that went through.

    `accepted_log` (a path; None keeps the ids in memory only) records each accepted id, fsynced
    after the put and before `deliver` returns, so a ledger Ray restarts reads them back and still
    drops a retried group. A crash between the put and the write can let one group through twice;
    the queues themselves are in memory, so a crashed queue loses what it held (the learner trains on
    fresh groups instead).
    """

    def __init__(self, queues: Queue | str | Mapping[str, Queue | str], accepted_log: str | None = None) -> None:
        self.queues: dict[str, Queue] | Queue = (
            {p: _queue(q) for p, q in queues.items()} if isinstance(queues, Mapping) else _queue(queues)
        )
        # match -> (power, fork point) -> the id accepted for that seat
        self.accepted: dict[str, dict[tuple[str, int], str]] = {}
        self.in_flight: set[GroupSeat] = set()
        self.duplicates = 0
        self.unroutable = 0
        self.refused = 0
        self.closed = False
        self.log_path = Path(accepted_log) if accepted_log else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            if self.log_path.is_file():
                # A torn last line (a crash mid-write) has no newline: its id was never acknowledged.
                lines = self.log_path.read_text().split("\n")
                for gid in (line for line in lines[:-1] if line):
                    self._remember(gid)

    def _queue_for(self, group: TrajectoryGroup) -> Queue | None:
        if not isinstance(self.queues, dict):
            return self.queues
        return self.queues.get(group.policy)

    async def deliver(self, group: TrajectoryGroup, timeout_s: float | None = None) -> bool:
        """Put `group` in its policy's queue unless a group with its id was already accepted; True if put.

        Waits while the queue is full (up to `timeout_s`, then `Full`, as the queue does); returns
        False at once, without putting, once the ledger is closed.
        """
        gid = group.group_id
        seat = group_seat(gid)
        if (seat.power, seat.point) in self.accepted.get(seat.match, {}) or seat in self.in_flight:
            self.duplicates += 1
            return False
        queue = self._queue_for(group)
        if queue is None:
            self.unroutable += 1
            return False
        self.in_flight.add(seat)  # no await before this line: check-and-mark is atomic
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                if self.closed:
                    self.refused += 1
                    return False
                wait = CLOSE_POLL_S if deadline is None else max(0.0, min(CLOSE_POLL_S, deadline - time.monotonic()))
                try:
                    await queue.put_async(group, block=True, timeout=wait)
                    break
                except Full:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
        finally:
            self.in_flight.discard(seat)
        self._accept(gid)
        return True

    async def delivered_for(self, match_id: str) -> list[str]:
        """Every id accepted for a seat of `match_id`, once no delivery for one of its seats is in flight.

        This is what a match's report names: a replay whose own group tied (none to deliver), or whose
        delivery found an earlier attempt's put still waiting on a full queue, names the group that went
        through all the same, so the reports account for every queued group.
        """
        while any(seat.match == match_id for seat in self.in_flight):
            await asyncio.sleep(SETTLE_POLL_S)
        return sorted(self.accepted.get(match_id, {}).values())

    def _remember(self, gid: str) -> None:
        seat = group_seat(gid)
        self.accepted.setdefault(seat.match, {}).setdefault((seat.power, seat.point), gid)

    def _accept(self, gid: str) -> None:
        self._remember(gid)
        if self.log_path is not None:
            with self.log_path.open("a") as fh:
                fh.write(gid + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def close(self) -> None:
        """The consumer stopped: refuse every waiting and future delivery (the groups stay unaccepted)."""
        self.closed = True

    def stats(self) -> dict[str, int]:
        return {
            "accepted": sum(len(powers) for powers in self.accepted.values()),
            "duplicates": self.duplicates,
            "unroutable": self.unroutable,
            "refused": self.refused,
        }

    def pid_of(self) -> int:
        return os.getpid()


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class RolloutWorker:
    """Plays matches in lockstep and delivers their groups through the ledger (see the module doc).

    The ledger is passed by NAME and looked up here, not passed as a handle: a handle to a
    non-detached actor is a reference Ray keeps in the object store, and Ray cannot guarantee such
    constructor arguments survive until a restart (ray-project/ray#53727). A name is a plain value, so
    a restarted worker always finds the ledger again.
    """

    def __init__(self, config: WorkerConfig, ledger_name: str | None, worker_index: int = 0) -> None:
        from diprl.rollout.clients import make_client

        self.config = config
        self.ledger: Any = ray.get_actor(ledger_name) if ledger_name else None
        self.episode = make_episode(config)
        self.client = make_client(config.client, config.serve_app, config.model, config.seed * 1000 + worker_index)
        self.pid = os.getpid()
        self.stats = LockstepStats()
        self._reported = dict.fromkeys(self.stats.seconds, 0.0)  # the loop's seconds up to the last report
        self._source = QueueSource()
        self._pending: dict[int, tuple[Job, concurrent.futures.Future[EpisodeOutput]]] = {}
        self._lock = threading.Lock()
        self._loop = threading.Thread(target=self._run, name="lockstep", daemon=True)
        self._loop.start()

    def _run(self) -> None:
        def settle(job: Job, result: Any, error: BaseException | None) -> None:
            with self._lock:
                _, future = self._pending.pop(id(job))
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        drive(
            self._source,
            self.client,
            self.config.matches_in_flight,
            on_done=lambda job, out: settle(job, out, None),
            on_error=lambda job, exc: settle(job, None, exc),
            stats=self.stats,
        )

    def play(self, match: Match) -> MatchReport:
        """Play `match` (with the others in flight), deliver its groups, and report it."""
        start = time.perf_counter()
        job = self.episode.play(match)
        future: concurrent.futures.Future[EpisodeOutput] = concurrent.futures.Future()
        with self._lock:
            self._pending[id(job)] = (job, future)
        self._source.put(job)
        out = future.result()
        played = time.perf_counter() - start
        report = MatchReport(
            match_id=match.match_id,
            results=out.results,
            groups=[],
            counts=out.counts,
            group_records=sum(len(g.records) for g in out.groups),
            hero_returns=list(out.hero_returns),
            worker_pid=self.pid,
        )
        start = time.perf_counter()
        if self.ledger is not None:
            for group in out.groups:
                ray.get(self.ledger.deliver.remote(group))
            # What went through for this match's seats: its own groups, and those an earlier attempt of a
            # replayed match delivered (whether or not this attempt's sampling forked the same seats).
            report.groups = ray.get(self.ledger.delivered_for.remote(match.match_id))
            through = {group_seat(gid) for gid in report.groups}
            report.undelivered = sum(group_seat(g.group_id) not in through for g in out.groups)  # refused
        report.timings = {"play": played, "deliver": time.perf_counter() - start, **self._loop_seconds()}
        if out.trace is not None and self.config.trace_dir:
            report.trace = self._write_trace(match.match_id, out.trace)
        return report

    def _loop_seconds(self) -> dict[str, float]:
        """The lockstep loop's seconds per stage since the previous report: the loop plays every match in
        flight at once, so a report carries its share of the loop's time, and no second twice."""
        with self._lock:
            now = dict(self.stats.seconds)
            since = {stage: seconds - self._reported.get(stage, 0.0) for stage, seconds in now.items()}
            self._reported = now
        return since

    def _write_trace(self, match_id: str, trace: dict[str, Any]) -> str:
        path = Path(self.config.trace_dir or ".") / f"{_UNSAFE.sub('_', match_id)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(path, json.dumps(trace).encode())
        return str(path)

    def pid_of(self) -> int:
        return self.pid


def worker_actor(
    config: WorkerConfig,
    ledger_name: str | None,
    index: int,
    num_cpus: float,
    name: str | None,
    resources: Mapping[str, float] | None = None,
) -> Any:
    """A `RolloutWorker` actor: restarted forever with its calls retried; threaded, so that every match
    in flight (plus a status call) has a thread to wait in. `resources` (custom resources,
    `placement.rollout`) keep it, and its restarts, on the nodes that declare them."""
    options: dict[str, Any] = {
        "num_cpus": num_cpus,
        "max_restarts": -1,
        "max_task_retries": -1,
        "max_concurrency": config.matches_in_flight + 2,
    }
    if name is not None:
        options["name"] = name
    if resources:
        options["resources"] = dict(resources)
    return ray.remote(RolloutWorker).options(**options).remote(config, ledger_name, index)


class RolloutRunner:
    """Driver side for scripts and tests: N workers, one ledger, one bounded queue; results into run_dir."""

    def __init__(self, config: WorkerConfig, num_workers: int, run_dir: Path, queue_size: int = 64) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = replace(config, trace_dir=config.trace_dir or str(self.run_dir / "traces"))
        suffix = uuid.uuid4().hex[:12]  # unique: several runners may share a cluster
        queue_name, ledger_name = f"queue-{suffix}", f"group-ledger-{suffix}"
        # By name, not handle: the ledger is restartable (see GroupLedger).
        self.queue = Queue(maxsize=queue_size, actor_options={"name": queue_name})
        self.ledger = GroupLedger.options(name=ledger_name).remote(queue_name)  # type: ignore[attr-defined]
        self.workers = [worker_actor(self.config, ledger_name, i, 0.5, None) for i in range(num_workers)]
        self.results_path = self.run_dir / "results.jsonl"

    def run(self, matches: Sequence[Match]) -> list[MatchReport]:
        """Play every match (spread over the workers, all in flight at once); reports in finishing order."""
        pending = {self.workers[i % len(self.workers)].play.remote(m): m for i, m in enumerate(matches)}
        reports = []
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            pending.pop(done[0])
            report = ray.get(done[0])
            with self.results_path.open("a") as f:
                for result in report.results:
                    f.write(json.dumps(result.to_dict()) + "\n")
            reports.append(report)
        return reports
