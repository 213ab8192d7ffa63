"""Keeping every learner stepping, and acting on what each step reports.

Each learner pulls its batches from its own queue (`Learner.train_next`): the driver only asks an idle
learner for its next step and reads the `StepReport`. For each report it logs the step (and the
rollout statistics beside it), logs every fault the step carried (quarantined records, a failed
publish or checkpoint, skipped non-finite updates), notices a learner Ray restarted (its step went
back: the steps after its checkpoint are superseded), tells the league about a published version
(which may answer with a snapshot or a reset), and has the learner prune versions nobody needs.

One failed step is a fault; `MAX_LEARNER_FAILURES` in a row is a broken learner and ends the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from diprl.league.role_state import VersionDecision
from diprl.messages import StepReport
from diprl.run.journal import Journal

MAX_LEARNER_FAILURES = 3  # consecutive failed steps of one learner that end the run (one bad batch does not)
POLL_S = 2.0  # how long a learner waits on its queue for a batch before answering "none yet"


class LearnerLoop:
    def __init__(
        self,
        learners: dict[str, Any],
        queues: dict[str, Any],
        league: Any,
        journal: Journal,
        keep_versions: Callable[[], Iterable[str]],
        request_stop: Callable[[str, int], None],
    ) -> None:
        self.learners = learners
        self.queues = queues
        self.league = league
        self.journal = journal
        self.keep_versions = keep_versions  # versions pruning must keep beyond the league's (evaluations)
        self.request_stop = request_stop
        self.steps: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, int] = {}
        self.stepping: dict[Any, str] = {}  # ref -> policy

    def start(self) -> None:
        """Read each learner's restored state, supersede what it lost, and register its version."""
        import ray

        for policy, learner in self.learners.items():
            state = ray.get(learner.state.remote())
            self.steps[policy] = int(state["step"])
            self.versions[policy] = str(state["version"])
            self.journal.supersede(policy, self.steps[policy])  # logged after the restored checkpoint: lost
            if ray.get(self.league.pending_reset.remote(policy)):  # stopped between the answer and the reset
                self.versions[policy] = str(ray.get(learner.reset.remote()))
            ray.get(self.league.register_version.remote(policy, self.versions[policy], self.steps[policy]))
            self.journal.recover_learner_records(policy, self.steps[policy])

    def queue_depth(self) -> int:
        return int(sum(q.qsize() for q in self.queues.values()))

    def fill(self) -> None:
        """Every idle learner asks its queue for the next batch."""
        busy = set(self.stepping.values())
        for policy, learner in self.learners.items():
            if policy not in busy:
                self.stepping[learner.train_next.remote(POLL_S)] = policy

    def refs(self) -> list[Any]:
        return list(self.stepping)

    def handle(self, ref: Any) -> StepReport | None:
        import ray

        policy = self.stepping.pop(ref)
        try:
            report: StepReport | None = ray.get(ref)
        except Exception as exc:  # about this batch (kept in the learner's quarantine file): the run goes on
            failures = self.failures.get(policy, 0) + 1
            self.failures[policy] = failures
            stopping = failures >= MAX_LEARNER_FAILURES
            self.journal.fault({"learner": policy, "error": repr(exc)[:500], "stopping": stopping}, policy)
            if stopping:  # not one bad batch but a learner that fails every step: end the run properly
                self.request_stop(f"learner-{policy} failed {failures} steps in a row: {exc!r:.300}", 1)
            return None
        if report is None:  # no batch came in time
            return None
        self.failures[policy] = 0
        self._step(policy, report)
        return report

    def _step(self, policy: str, report: StepReport) -> None:
        import ray

        for q in report.quarantined:
            self.journal.fault({"learner": policy, "fault": "quarantined", **q}, policy)
        for fault in report.faults:
            self.journal.fault({"learner": policy, **fault}, policy)
        previous = self.steps.get(policy, 0)
        if report.step < previous or (report.trained and report.step == previous):
            # Ray restarted the learner: it restored its newest checkpoint and redid this step.
            restored = report.step - int(report.trained)
            moved = self.journal.supersede(policy, restored)
            self.journal.fault({"learner_restored": policy, "step": restored, "superseded": moved}, policy)
        self.steps[policy] = report.step
        self.last[policy] = report.metrics
        self.journal.log("learner", report.record(), policy)
        self.journal.log("rollout", self.journal.stats.rollout_record(report.step, self.queue_depth()), policy)
        if report.published:
            self.versions[policy] = report.published
            decision: VersionDecision = ray.get(
                self.league.register_version.remote(policy, report.published, report.step)
            )
            self.journal.log("league", {"version": report.published, **decision.to_dict()}, policy)
            if decision.reset:
                version = str(ray.get(self.learners[policy].reset.remote()))
                self.versions[policy] = version
                ray.get(self.league.register_version.remote(policy, version, report.step))
            keep = {*ray.get(self.league.refs_in_use.remote()), *self.keep_versions()}
            self.learners[policy].prune_versions.remote(sorted(keep))

    def save_checkpoints(self) -> None:
        """The final checkpoint of every learner; a failure is a fault (the summary still matters)."""
        import ray

        for policy, learner in self.learners.items():
            try:
                ray.get(learner.save_checkpoint.remote())
            except Exception as exc:
                self.journal.fault({"checkpoint": policy, "error": repr(exc)[:500]}, policy)
