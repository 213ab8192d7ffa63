"""Ray actors that run episodes and deliver their groups exactly once into a bounded queue.

- `RolloutWorker` (CPU actor, restarted after a crash) plays one `Match` per call. Ray retries a call
  that a crash interrupted on the restarted worker; the retry replays the same match (same seed).
- `GroupLedger` (async actor, restarted after a crash) is the only way into the learner's
  `ray.util.queue.Queue`: it remembers every group id it accepted (in an fsynced append-only file in
  the run directory when given one, so a restarted ledger still knows them), so a retried match whose
  group was already delivered is dropped, and a match that crashed before delivering is delivered by
  its retry. Its `put` waits while the queue is full: backpressure instead of unbounded memory. Once
  the driver stops consuming it calls `close()`: waiting deliveries return False (refused, not
  accepted: nothing half-delivered) instead of blocking their workers forever.
- `RolloutRunner` (driver side) hands out matches with the hero's power stratified, collects the
  match results (to a JSONL sink in the run directory until the league manager exists) and writes
  the sampled traces.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.util.queue import Full, Queue

from diprl.game import DiplomacyGame
from diprl.rollout.episode import Episode, EpisodeConfig
from diprl.rollout.types import Match

CLOSE_POLL_S = 1.0  # how often a delivery waiting on a full queue checks whether the ledger was closed


@dataclass
class WorkerConfig:
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    reward: str = "default"  # conf/reward/<name>.yaml
    client: str = "serve"  # "serve": the PolicyServer deployment; "uniform": a uniform constrained sampler
    serve_app: str = "policy"
    seed: int = 0
    train_turns: str | None = None  # overrides the reward config's credit.train_turns (fork | all)
    model: str = "tiny"  # the served model's preset: its tokenizer and logits width spell the completions


def stratified_matches(
    n: int, hero_policy: str, opponents: Sequence[str], seed: int = 0, prefix: str = "m"
) -> Iterator[Match]:
    """Matches whose hero power cycles through all seven powers, so every batch covers every start."""
    powers = DiplomacyGame().powers
    for i in range(n):
        hero = powers[i % len(powers)]
        others = [p for p in powers if p != hero]
        seats = {hero: hero_policy} | {p: opponents[(i + j) % len(opponents)] for j, p in enumerate(others)}
        yield Match(match_id=f"{prefix}{seed}-{i}", seats=seats, hero=hero, seed=seed * 1_000_003 + i)


def policy_of(version: str) -> str:
    """The trained policy a version belongs to: "main@v3" -> "main"; "base" and bots have none ("")."""
    return version.split("@", 1)[0] if "@" in version else ""


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
    learner queue: a group goes to the queue of the policy its hero played (`main@v3` -> `main`).
    A group for a policy no learner trains (the hero was `base`) is counted, not queued.

    Queues may be given by the name of their actor (`Queue(actor_options={"name": ...})`), which is
    what a restartable ledger needs: a handle among the constructor arguments lives in the object
    store, and Ray cannot promise it survives until a restart (ray-project/ray#53727, an error-level
    line for every such actor); a name is a plain value.

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
        self.accepted: set[str] = set()
        self.in_flight: set[str] = set()
        self.duplicates = 0
        self.unroutable = 0
        self.refused = 0
        self.closed = False
        self.log_path = Path(accepted_log) if accepted_log else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            if self.log_path.is_file():
                # A torn last line (a crash mid-write) has no newline: its id was never acknowledged.
                text = self.log_path.read_text()
                lines = text.split("\n")
                self.accepted.update(line for line in lines[:-1] if line)

    def _queue_for(self, group: dict[str, Any]) -> Queue | None:
        if not isinstance(self.queues, dict):
            return self.queues
        return self.queues.get(policy_of(str(group.get("policy_version", ""))))

    async def deliver(self, group: dict[str, Any], timeout_s: float | None = None) -> bool:
        """Put `group` in its policy's queue unless a group with its id was already accepted; True if put.

        Waits while the queue is full (up to `timeout_s`, then `Full`, as the queue does); returns
        False at once, without putting, once the ledger is closed.
        """
        group_id = group["group_id"]
        if group_id in self.accepted or group_id in self.in_flight:
            self.duplicates += 1
            return False
        queue = self._queue_for(group)
        if queue is None:
            self.unroutable += 1
            return False
        self.in_flight.add(group_id)  # no await before this line: check-and-mark is atomic
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
            self.in_flight.discard(group_id)
        self._accept(group_id)
        return True

    def _accept(self, group_id: str) -> None:
        self.accepted.add(group_id)
        if self.log_path is not None:
            with self.log_path.open("a") as fh:
                fh.write(group_id + "\n")
                fh.flush()
                os.fsync(fh.fileno())

    def close(self) -> None:
        """The consumer stopped: refuse every waiting and future delivery (the groups stay unaccepted)."""
        self.closed = True

    def stats(self) -> dict[str, int]:
        return {
            "accepted": len(self.accepted),
            "duplicates": self.duplicates,
            "unroutable": self.unroutable,
            "refused": self.refused,
        }


@ray.remote(max_restarts=-1, max_task_retries=-1)
class RolloutWorker:
    """Plays matches and delivers their groups through the ledger.

    The ledger is passed by NAME and looked up here, not passed as a handle: a handle to a
    non-detached actor is a reference Ray keeps in the object store, and Ray cannot guarantee such
    constructor arguments survive until a restart (ray-project/ray#53727; it logs an error-level
    line for every actor created that way). A name is a plain value, so a restarted worker always
    finds the ledger again.
    """

    def __init__(self, config: WorkerConfig, ledger_name: str, worker_index: int = 0) -> None:
        from diprl.policy.models import load_preset, logits_width, resolve_model_path
        from diprl.policy.tokenizer import load_tokenizer
        from diprl.policy.vocab import token_table
        from diprl.rollout.credit import CreditAssigner
        from diprl.rollout.rewards import Rubric, load_reward_config

        self.config = config
        self.ledger: Any = ray.get_actor(ledger_name)
        preset = load_preset(config.model)
        tokenizer = load_tokenizer(resolve_model_path(preset))
        table = token_table(tokenizer, logits_width(preset))
        client: Any
        if config.client == "serve":
            from diprl.rollout.clients import ServeClient

            client = ServeClient(app_name=config.serve_app)
        elif config.client == "uniform":
            from diprl.rollout.clients import UniformConstrainedClient

            client = UniformConstrainedClient(table, seed=config.seed * 1000 + worker_index, tokenizer=tokenizer)
        else:
            raise ValueError(f"unknown rollout client {config.client!r}: use 'serve' or 'uniform'")
        reward = load_reward_config(config.reward)
        if config.train_turns is not None:
            reward = replace(reward, credit=replace(reward.credit, train_turns=config.train_turns))
        self.episode = Episode(config.episode, Rubric(reward), CreditAssigner(reward.credit), client, table)
        self.pid = os.getpid()

    def play(self, match: Match) -> dict[str, Any]:
        start = time.perf_counter()
        out = self.episode.run(match)
        delivered = False
        queue_seconds = 0.0
        if out.group is not None:
            t = time.perf_counter()
            delivered = ray.get(self.ledger.deliver.remote(out.group.to_dict()))
            queue_seconds = time.perf_counter() - t
        return {
            "match_id": match.match_id,
            "results": [r.to_dict() for r in out.results],
            "trace": out.trace,
            "group_id": out.group.group_id if out.group else None,
            "delivered": delivered,
            "skipped_zero_variance": out.skipped_zero_variance,
            "timings": dict(out.timings) | {"queue": queue_seconds, "total": time.perf_counter() - start},
            "phases": out.phases,
            "completions": out.completions,
            "bad_completions": out.bad_completions,
            "untrainable_completions": out.untrainable_completions,
            "group_records": len(out.group.records) if out.group else 0,
            "group_returns": list(out.returns),
            "worker_pid": self.pid,
        }

    def pid_of(self) -> int:
        return self.pid


class RolloutRunner:
    """Driver side: N workers, one ledger, one bounded queue; results and traces into the run directory."""

    def __init__(self, config: WorkerConfig, num_workers: int, run_dir: Path, queue_size: int = 64) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        suffix = uuid.uuid4().hex[:12]  # unique: several runners may share a cluster
        queue_name, ledger_name = f"queue-{suffix}", f"group-ledger-{suffix}"
        # By name, not handle: the ledger is restartable (see GroupLedger).
        self.queue = Queue(maxsize=queue_size, actor_options={"name": queue_name})
        self.ledger = GroupLedger.options(name=ledger_name).remote(queue_name)  # type: ignore[attr-defined]
        self.workers = [
            RolloutWorker.options(num_cpus=0.5).remote(config, ledger_name, i)  # type: ignore[attr-defined]
            for i in range(num_workers)
        ]
        self.results_path = self.run_dir / "match_results.jsonl"

    def run(self, matches: Iterable[Match]) -> list[dict[str, Any]]:
        """Play all matches (round robin over workers), sink results and traces, return per-match summaries."""
        pending = {}
        for i, match in enumerate(matches):
            worker = self.workers[i % len(self.workers)]
            pending[worker.play.remote(match)] = match.match_id
        summaries = []
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            summary = ray.get(done[0])
            pending.pop(done[0])
            self._sink(summary)
            summaries.append(summary)
        return summaries

    def _sink(self, summary: dict[str, Any]) -> None:
        with self.results_path.open("a") as f:
            for result in summary["results"]:
                f.write(json.dumps(result) + "\n")
        if summary.get("trace") is not None:
            traces = self.run_dir / "traces"
            traces.mkdir(exist_ok=True)
            (traces / f"{summary['match_id']}.json").write_text(json.dumps(summary["trace"], indent=1))

    def drain(self, timeout_s: float = 1.0) -> list[dict[str, Any]]:
        """Everything currently in the queue (what the learner would consume)."""
        items = []
        while not self.queue.empty():
            items.append(self.queue.get(timeout=timeout_s))
        return items
