"""The driver of a training run: keeps rollout workers, learners and the evaluator busy until the budget
runs out or a stop is requested, then ends the run properly.

The pieces each own one job (`MatchScheduler`, `LearnerLoop`, `EvalSchedule`, `Watchdog`, `Journal`);
the loop below only waits for whichever call finishes next and hands it to its owner. Groups never
pass through here: rollout workers deliver them to the ledger, learners pull them from their queues.

Stopping: a signal or an actor's error stops taking new work (the ledger refuses further groups, so
workers blocked on a full queue return); what runs finishes, then the final checkpoints, the final
evaluation and the summary are written. A second signal aborts at once (KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diprl.atomic_io import write_json_atomic
from diprl.league.roles import ROLE_TABLE
from diprl.run.config import Config
from diprl.run.evaluations import EvalSchedule
from diprl.run.faults import Watchdog, chaos
from diprl.run.journal import Journal
from diprl.run.learning import LearnerLoop
from diprl.run.matches import MatchScheduler
from diprl.run.progress import RunStats, progress_fields
from diprl.run.rundir import Counters, json_safe, load_counters, save_counters

WAIT_S = 1.0  # the loop wakes at least this often (budget, progress line, watchdog)
STATUS_TIMEOUT_S = 10.0  # a PolicyServer status asked during the run (canaries); the end waits longer

log = logging.getLogger(__name__)


def _finished(pending: list[Any]) -> list[Any]:
    """The calls of `pending` that have finished: as soon as one has (at most `WAIT_S`), all that have.

    Waiting for all of them instead (`num_returns=len(pending)`) always ran to the timeout, since
    matches are always playing: a learner's next step was asked for up to a second late, and a CPU
    learner idled 90% of a run between steps of 0.1 s.
    """
    import ray

    ready, rest = ray.wait(pending, num_returns=1, timeout=WAIT_S, fetch_local=False)
    if ready and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=False)
        ready += more
    return list(ready)


def may_reset(policy: str, league: Any) -> bool:
    """Whether the league may answer a version of `policy` with a reset (its role's reset probability);
    a policy no role names is assumed to (its learner then waits for each answer)."""
    role = ROLE_TABLE.get(policy)
    return role is None or role.reset_probability(league) > 0


@dataclass
class Stop:
    """Why a run stops before its budget (a signal, a failed actor) and the exit status it then has.

    Made before anything starts, so a signal during start-up is not lost."""

    reason: str | None = None
    exit_code: int = 0

    def request(self, reason: str, exit_code: int) -> None:
        if self.reason is None:
            self.reason, self.exit_code = reason, exit_code


@dataclass
class Actors:
    """Everything a run created, by role (see `diprl.run.actors.start_actors`)."""

    serve_app: str
    league: Any
    ledger: Any
    queues: dict[str, Any]
    learners: dict[str, Any]
    workers: list[Any]
    evaluator: Any


@dataclass(eq=False)
class Driver:
    """The run's loop over its owners of work (see the module doc)."""

    config: Config
    run_dir: Path
    actors: Actors
    journal: Journal
    counters: Counters
    stop: Stop

    @classmethod
    def for_run(cls, config: Config, run_dir: Path, actors: Actors, stop: Stop) -> Driver:
        """The run's driver: its journal writes `metrics.jsonl` (and W&B with `train.wandb`), its counters
        are read back from the run directory (zero for a new run)."""
        from diprl.tracking import Tracker

        tracker = Tracker(run_dir, json_safe(asdict(config)), use_wandb=config.train.wandb)
        return cls(config, run_dir, actors, Journal(run_dir, tracker, RunStats()), load_counters(run_dir), stop)

    def __post_init__(self) -> None:
        config, actors, journal, counters = self.config, self.actors, self.journal, self.counters
        self.started = time.monotonic()
        self.ledger_closed = False
        self.chaos_done = False
        self.rating: float | None = None
        from diprl.inference.adapters import AdapterStore

        self.evals = EvalSchedule(
            actors.evaluator,
            config.evaluation,
            journal,
            counters,
            league=actors.league,
            adapters=AdapterStore(self.run_dir / "adapters"),
            planted_collapse=config.train.plant_collapse_at_step,
        )
        self.learning = LearnerLoop(
            actors.learners,
            actors.queues,
            actors.league,
            journal,
            self.evals.protected,
            self.request_stop,
            running=self.budget_left,
            may_reset=lambda policy: may_reset(policy, config.league),
            delivered=lambda policy: counters.delivered.get(policy, 0),
        )
        self.matches = MatchScheduler(
            actors.league,
            actors.workers,
            config.rollout.matches_in_flight,
            list(actors.learners),
            config.rollout.match_retries,
            journal,
            counters,
            read_proofs=lambda: self._log_canaries(self._server_status(STATUS_TIMEOUT_S)),
            weights=config.league.match_weights,
        )
        watched = {f"rollout-{i}": w for i, w in enumerate(actors.workers)}
        watched |= {f"learner-{p}": learner for p, learner in actors.learners.items()}
        watched |= {"league": actors.league, "group-ledger": actors.ledger, "evaluator": actors.evaluator}
        self.watchdog = Watchdog(watched, journal, self._in_flight)
        self.progress: Any = None
        self.canaries_logged: set[str] = set()  # versions whose `canary` record is written

    # ---------------------------------------------------------------- control
    def request_stop(self, reason: str, exit_code: int) -> None:
        """Stop taking new work; what runs finishes, then the final checkpoint, evaluation and summary."""
        self.stop.request(reason, exit_code)

    @property
    def main_step(self) -> int:
        return self.learning.steps.get("main", 0)

    def budget_left(self) -> bool:
        t = self.config.train
        if self.stop.reason is not None or self.main_step >= t.max_steps:
            return False
        return not (t.max_minutes and (time.monotonic() - self.started) / 60 >= t.max_minutes)

    def _in_flight(self, name: str) -> list[str]:
        if name.startswith("rollout-"):
            return self.matches.in_flight(int(name.split("-", 1)[1]))
        if name.startswith("learner-") and name[len("learner-") :] in self.learning.stepping.values():
            return ["the batch in training"]
        return []

    # ---------------------------------------------------------------- the loop
    def start(self) -> None:
        self.learning.start()
        self.evals.start(self.learning.versions["main"], self.main_step)

    def run(self) -> None:
        """Train until the budget runs out or a stop is requested, then end the run properly.

        An unexpected error in the loop stops it at once (what was in flight is abandoned); the final
        checkpoint, evaluation and summary are still written.
        """
        from diprl.tracking import ProgressLine

        self.progress = ProgressLine(self.config.train.progress_every_s)
        try:
            self._loop()
        except Exception as exc:
            self.request_stop(f"error: {exc!r:.300}", 1)
            self.journal.fault({"error": repr(exc)[:500], "stopping": True})
        self._end()

    def _loop(self) -> None:
        while True:
            running = self.budget_left()
            if running:
                self.matches.fill()
                self.learning.fill()
            else:
                self._stop_rollouts()
            self.evals.fill(stopping=self.stop.reason is not None, spent=not running)
            self._maybe_chaos()
            self.watchdog.poll()
            pending = self.matches.refs() + self.learning.refs() + self.evals.refs()
            if not pending:
                break
            for ref in _finished(pending):
                if ref in self.matches.playing:
                    self.matches.handle(ref)
                elif ref in self.learning.stepping:
                    report = self.learning.handle(ref)
                    if report is not None:
                        self._after_step(report.policy)
                else:
                    self.evals.handle(ref)
            self.progress.update(self._progress_fields())
            self.counters.minutes = (time.monotonic() - self.started) / 60

    def _after_step(self, policy: str) -> None:
        if policy == "main":
            self.evals.on_step(self.learning.versions["main"], self.main_step)
            self.rating = self._main_rating()
            if self.main_step == 1 or self.main_step % self.config.league.health.every_steps == 0:
                self._log_league()
                self._log_canaries(self._server_status(STATUS_TIMEOUT_S))
        save_counters(self.run_dir, self.counters)

    def _stop_rollouts(self) -> None:
        """Nobody takes batches any more: deliveries waiting on a full queue return instead of blocking."""
        import ray

        if not self.ledger_closed:
            self.ledger_closed = True
            ray.get(self.actors.ledger.close.remote())

    def _maybe_chaos(self) -> None:
        t = self.config.train
        if self.chaos_done or not t.chaos or self.main_step < t.chaos_after_step:
            return
        self.chaos_done = True
        chaos(t.chaos, self.actors.serve_app, self.journal)

    def _main_rating(self) -> float | None:
        """The league's rating of main's current version (None before it has one)."""
        import ray

        version = self.learning.versions.get("main")
        return None if version is None else ray.get(self.actors.league.rating.remote(version))

    def _log_league(self) -> None:
        """One `league` record: main's rating and the league's health (`LeagueManager.health`)."""
        import ray

        health = ray.get(self.actors.league.health.remote())
        rating = {"league/rating": self.rating} if self.rating is not None else {}
        self.journal.log("league", {"step": self.main_step} | rating | health)

    def _progress_fields(self) -> dict[str, Any]:
        version = self.learning.versions.get("main", "-")
        if version in self.matches.refused:  # refused by a replica's canary: say what plays instead
            version = f"{version} (refused, serving {self.matches.serving.get('main', '?')})"
        return progress_fields(
            self.journal.stats,
            self.main_step,
            self.learning.last.get("main", {}),
            self.learning.queue_depth(),
            version,
            self.evals.last,
            self.rating,
            trained_share=self.learning.trained_share("main"),
        )

    # ---------------------------------------------------------------- the end
    def summary(self) -> dict[str, Any]:
        """The run's last line: main's steps, the versions in the store, the groups trained on, the run
        directory, and `stopped`: why it ended before its budget (a signal, a failed actor), if it did."""
        summary: dict[str, Any] = {
            "train_steps": self.main_step,
            "adapter_versions": _count_versions(self.run_dir / "adapters"),
            "groups": self.counters.groups,
            "run_dir": str(self.run_dir),
        }
        if self.stop.reason is not None:
            summary["stopped"] = self.stop.reason.replace(" ", "_")[:80]
        return summary

    def _end(self) -> None:
        """The final evaluation (if configured), checkpoints and summary, on every exit the run survives."""
        self.evals.final(self.learning.versions["main"], self.main_step)
        self.watchdog.final()
        if self.progress is not None:
            self.progress.update(self._progress_fields(), force=True)
            self.progress.close()
        self._finish()

    def _server_status(self, timeout_s: float) -> dict[str, Any] | str:
        """One replica's `PolicyServer.status`, or why there is none (it did not answer in time)."""
        from ray import serve

        app = self.actors.serve_app
        try:
            return dict(serve.get_deployment_handle(app, app_name=app).status.remote().result(timeout_s=timeout_s))
        except Exception as exc:  # a run without a reachable server goes on, and still ends properly
            log.warning("PolicyServer %s status: %r", app, exc)
            return repr(exc)[:300]

    def _log_canaries(self, status: dict[str, Any] | str) -> None:
        """One `canary` record per version a replica checked since the last (one replica's view): its canary
        error (the largest |learner - engine| log-probability; null when the tokens differ) and whether the
        served version is the published one. Versions that passed are proven to the league (the fallbacks
        for a refused one), before any refusal the rollouts have not met yet is handed to it."""
        if isinstance(status, str):
            return
        refused = set(status.get("canary_refused", []))
        checked = [
            (v, e) for v, e in sorted(dict(status.get("canary_errors", {})).items()) if v not in self.canaries_logged
        ]
        for version, error in checked:
            self.canaries_logged.add(version)
            same = version not in refused
            values = {"version": version, "canary/error": error if math.isfinite(error) else None}
            self.journal.log("canary", values | {"canary/served_is_published": int(same)}, version.split("@")[0])
            if same and math.isfinite(error):
                self.matches.prove(version)
        for version, _ in checked:
            if version in refused and version not in self.matches.refused:
                self.matches.refuse(version, f"CanaryMismatch: {version}: refused by a replica's canary")

    def _log_serving(self) -> None:
        """What the PolicyServer saw (one replica's view): the mean batch inside its engine while busy,
        the seconds it was busy, its failed requests. The batch is what matches in flight are for. And the
        canary records of the versions checked since the last (`_log_canaries`)."""
        status = self._server_status(60.0)
        if isinstance(status, str):
            self.journal.fault({"serving_status": self.actors.serve_app, "error": status})
            return
        self._log_canaries(status)
        self.journal.log(
            "serving",
            {
                "serving/mean_batch": status["mean_batch"],
                "serving/busy_s": status["busy_s"],
                "serving/failed_requests": status["failed_requests"],
            },
        )

    def _finish(self) -> None:
        import ray

        from diprl.tracking import plot_learning_curves, read_metrics

        self.learning.save_checkpoints()
        self._log_serving()
        summary = ray.get(self.actors.league.summary.remote())
        write_json_atomic(self.run_dir / "league_summary.json", summary, indent=1)  # the web app may be reading it
        self.rating = self._main_rating()
        self._log_league()
        save_counters(self.run_dir, self.counters)
        self.journal.tracker.close()
        plot_learning_curves(
            read_metrics(self.run_dir / "metrics.jsonl"),
            self.run_dir / "plots" / "learning_curves.png",
            title=f"{self.config.experiment}: {self.run_dir.name}",
        )


def _count_versions(adapter_root: Path) -> int:
    from diprl.inference.adapters import AdapterStore

    if not adapter_root.is_dir():
        return 0
    store = AdapterStore(adapter_root)
    return sum(len(store.versions(p)) for p in store.policies())


@contextlib.contextmanager
def stop_on_signals(stop: Stop) -> Iterator[None]:
    """SIGINT/SIGTERM: the first asks the run to stop and drain; the second aborts (KeyboardInterrupt).

    Installed after `ray.init`, which sets its own SIGTERM handler (exit at once); the handlers replaced
    are put back when the block ends.
    """
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt(f"second signal ({signal.Signals(signum).name}): aborting")
        name = signal.Signals(signum).name
        print(
            f"\n{name}: finishing the steps in flight, then the final checkpoint, evaluation and summary "
            "(send it again to abort)",
            file=sys.stderr,
            flush=True,
        )
        stop.request(f"signal {name}", 128 + signum)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for number, replaced in previous.items():
            signal.signal(number, replaced)
