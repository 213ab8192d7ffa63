"""Faults on purpose and faults noticed: `train.chaos` kills named actors once, and the `Watchdog`
records every restart of an actor, injected or real (a killed process, an OOM, a lost node).

Ray restarts every actor of a run and retries the calls a death interrupted, so a run goes on without
anyone noticing; the watchdog makes it visible. It asks each actor for its process id now and then
(never blocking the driver: a restarting actor answers when it is back) and, when the id changed,
logs a `fault` record naming the actor, its old and new process, and what the restart replays (a
rollout worker's matches in flight, a learner's batch). The progress line counts them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from diprl.run.journal import Journal

POLL_S = 5.0


class Watchdog:
    def __init__(self, actors: dict[str, Any], journal: Journal, replayed: Callable[[str], list[str]]) -> None:
        self.actors = actors  # name -> handle with a `pid_of` method
        self.journal = journal
        self.replayed = replayed  # name -> what its restart replays (match ids, a batch)
        self.pids: dict[str, int] = {}
        self.asking: dict[str, tuple[Any, list[str]]] = {}  # name -> (ref, what was in flight when asked)
        self.next_poll = 0.0

    def poll(self, wait_s: float = 0.0) -> None:
        """Read the answers that came (waiting up to `wait_s` for each), then ask again when due."""
        import ray

        for name, (ref, before) in list(self.asking.items()):
            ready, _ = ray.wait([ref], timeout=wait_s)
            if not ready:
                continue
            del self.asking[name]
            try:
                pid = int(ray.get(ready[0]))
            except Exception:  # died while asked: the next poll asks its restarted self
                continue
            old = self.pids.get(name)
            self.pids[name] = pid
            if old is not None and old != pid:
                self.journal.stats.restarts += 1
                self.journal.fault({"restarted": name, "pid": pid, "previous_pid": old, "replayed": before})
        if time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + POLL_S
        self._ask()

    def _ask(self) -> None:
        for name, actor in self.actors.items():
            if name not in self.asking:
                self.asking[name] = (actor.pid_of.remote(), self.replayed(name))

    def final(self, wait_s: float = 30.0) -> None:
        """At the end of a run: one last answer from every actor, so a late restart is on record too."""
        self.poll(wait_s)
        self._ask()
        self.poll(wait_s)


def chaos(names: list[str], serve_app: str, journal: Journal) -> None:
    """Kill the named actors (fault-tolerance tests); Ray restarts every one of them."""
    import ray

    for name in names:
        if name == "policy-server":  # Serve notices the dead replica and starts another
            for actor in ray.util.list_named_actors(all_namespaces=True):
                if "SERVE_REPLICA" in actor["name"] and serve_app in actor["name"]:
                    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
        else:
            ray.kill(ray.get_actor(name), no_restart=False)
        journal.fault({"killed": name})
