"""Where a learner's batches come from: its own bounded queue, balanced across powers, one batch at a time.

The learner pulls trajectory groups straight from its policy's queue (`queue-<policy>`, a
`ray.util.queue.Queue` actor fed by the group ledger): no group passes through the driver process.

- **Balance.** Groups wait in a small holdover (at most `holdover` groups, so the queue's bound still
  pushes back on the rollout workers). A batch takes them round-robin over the powers, oldest first:
  each power gets at most `ceil(n / powers waiting)` of the batch's `n` groups, so the seven groups of
  one self-play match do not make a step of one position, and a power with a backlog is served first.
- **Staleness.** Waiting groups that the learner can no longer train on (their version lags too far
  behind) are dropped from the holdover and counted, never batched.
- **Exactly once.** The batch being trained is written to `pending.json` (atomically) before the
  step and removed after it. A learner that dies mid-step finds it on restart and trains it again,
  unless its restored checkpoint already holds that step (then the batch was trained and is dropped).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_file_atomic
from diprl.messages import PolicyRef, TrajectoryGroup

log = logging.getLogger(__name__)

PENDING_FILE = "pending.json"
GIVE_WAY_S = 0.1  # how often a waiting learner asks whether it should give way to another adapter


def balanced(groups: list[TrajectoryGroup], n: int) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup]]:
    """(batch, rest): up to `n` groups taken round-robin over powers, each power's oldest first; powers
    in the order of their oldest waiting group. `groups` is in arrival order."""
    by_power: dict[str, list[TrajectoryGroup]] = {}
    for group in groups:
        by_power.setdefault(group.power, []).append(group)
    batch: list[TrajectoryGroup] = []
    while len(batch) < n and any(by_power.values()):
        for power in list(by_power):
            if by_power[power] and len(batch) < n:
                batch.append(by_power[power].pop(0))
    taken = {id(g) for g in batch}
    return batch, [g for g in groups if id(g) not in taken]


class GroupIntake:
    """The queue side of one learner (see the module doc). `queue_name` None: batches are handed in."""

    def __init__(self, queue_name: str | None, directory: Path, groups_per_step: int, holdover: int) -> None:
        self.queue_name = queue_name
        self.pending_path = directory / PENDING_FILE
        self.groups_per_step = groups_per_step
        self.holdover = max(holdover, groups_per_step)
        self.waiting: list[TrajectoryGroup] = []
        self.dropped_stale = 0
        self._queue: Any = None

    # ------------------------------------------------------------------ the queue
    def _client(self) -> Any:
        if self._queue is None:
            import ray
            from ray.util.queue import Queue

            client = Queue.__new__(Queue)  # a client of the named queue actor (its bound is the actor's)
            client.maxsize = 0
            if self.queue_name is None:
                raise RuntimeError("this learner has no queue: its batches are handed to train_step")
            client.actor = ray.get_actor(self.queue_name)
            self._queue = client
        return self._queue

    def _pull(self, wait_s: float) -> None:
        """Move groups from the queue into the holdover, waiting up to `wait_s` for the first one."""
        from ray.util.queue import Empty

        queue = self._client()
        room = self.holdover - len(self.waiting)
        if room <= 0:
            return
        available = min(room, queue.qsize())
        if available:
            self.waiting.extend(queue.get_nowait_batch(available))
        elif wait_s > 0:
            try:
                self.waiting.append(queue.get(block=True, timeout=wait_s))
            except Empty:
                return

    def take(
        self, fresh: Callable[[PolicyRef], bool], timeout_s: float, give_way: Callable[[], bool] | None = None
    ) -> list[TrajectoryGroup] | None:
        """The next balanced batch of `groups_per_step` fresh groups, or None if the queue has not
        delivered enough within `timeout_s`, or `give_way` said true while it waited (checked every
        `GIVE_WAY_S`)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready(fresh):
            left = deadline - time.monotonic()
            if left <= 0 or (give_way is not None and give_way()):
                return None
            self._pull(left if give_way is None else min(left, GIVE_WAY_S))
        batch, self.waiting = balanced(self.waiting, self.groups_per_step)
        return batch

    def ready(self, fresh: Callable[[PolicyRef], bool]) -> bool:
        """Whether a whole batch of fresh groups is here (what the queue holds taken in, nothing waited for)."""
        self._pull(0.0)
        self._drop_stale(fresh)
        return len(self.waiting) >= self.groups_per_step

    def _drop_stale(self, fresh: Callable[[PolicyRef], bool]) -> None:
        keep = [g for g in self.waiting if fresh(g.policy_version)]
        self.dropped_stale += len(self.waiting) - len(keep)
        self.waiting = keep

    # ------------------------------------------------------------------ the batch in flight
    def hold(self, batch: list[TrajectoryGroup], for_step: int) -> None:
        """Keep `batch` on disk until `release`: the step `for_step` is being taken on it."""
        data = {"for_step": for_step, "groups": [g.to_dict() for g in batch]}
        self.pending_path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.pending_path, json.dumps(data).encode())

    def release(self) -> None:
        self.pending_path.unlink(missing_ok=True)

    def has_pending(self) -> bool:
        """Whether a batch is held on disk (in flight, or left by a previous life): the next step trains it."""
        return self.pending_path.is_file()

    def pending(self, restored_step: int) -> list[TrajectoryGroup] | None:
        """The batch a previous life of this learner was training, unless its step is already durable."""
        if not self.has_pending():
            return None
        try:
            data = json.loads(self.pending_path.read_text())
            groups = [TrajectoryGroup.from_dict(g) for g in data["groups"]]
            for_step = int(data["for_step"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            log.warning("unreadable pending batch %s (%s): dropped", self.pending_path, exc)
            self.release()
            return None
        if for_step <= restored_step:  # that step was checkpointed: its batch was trained
            self.release()
            return None
        return groups
