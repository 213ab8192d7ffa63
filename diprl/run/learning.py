"""Keeping every learner stepping, and acting on what each step reports.

Each learner pulls its batches from its own queue (`Learner.train_next`): the driver only asks an idle
learner for its next step and reads the `StepReport`. For each report it logs the step (and the
rollout statistics beside it), logs every fault the step carried (quarantined records, a failed
publish or checkpoint, skipped non-finite updates), notices a learner Ray restarted (its step went
back: the steps after its checkpoint are superseded), tells the league about a published version
(which may answer with a snapshot or a reset), and has the learner prune versions nobody needs.

**The learner never waits on that bookkeeping.** Its next `train_next` is asked for as soon as the
report is read, before the journal, league and pruning calls (and before the driver's `_after_step`):
a CPU learner's step of 0.15 s used to wait out 0.7 s of them. The one thing that must come first is
a reset: when the league may reset this policy (`may_reset`, its role's reset probability), the driver
waits for the league's answer to a published version and, on a reset, has `reset` done before it sends the
next `train_next` (a learner host on CPU runs its policies' calls in threads, in no set order), so the step
never trains the weights the league dropped. A policy the league never resets (`main`) does not wait for the
answer, and a step without a reset or rollback waits for nothing.

**Where groups go.** Per policy, beside each step, the `rollout` record counts the groups rollouts
delivered to its queue (`delivered`, from the match reports), trained, dropped as stale or foreign, and
quarantined (a group with a quarantined record), and `groups/trained_share` = trained / delivered: the
groups still waiting in the queue count as delivered, not yet trained.

**A rollback** the league decided (a collapse guard fired on an evaluation, `league.health.rollback`) is
carried out like a reset, before the policy's next `train_next`: after each step the driver asks the league,
without waiting, whether one is pending, and reads the answer when the next report comes (a decision made
while a step runs is carried out after the step that follows it, at the latest). The learner
publishes the best version's weights as its next version (`Learner.rollback`, which remembers the decision),
the league registers it and is told `rollback_done`, and a `league` record says `league/rollback_done`. A
driver resumed between the learner's publish and `rollback_done` finds the decision still pending at start
and asks again: the learner answers the version it already published, so it is rolled back once, not twice.

One failed step is a fault; `MAX_LEARNER_FAILURES` in a row is a broken learner and ends the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from diprl.league.role_state import VersionDecision
from diprl.messages import StepReport
from diprl.run.journal import Journal

MAX_LEARNER_FAILURES = 3  # consecutive failed steps of one learner that end the run (one bad batch does not)
POLL_S = 2.0  # how long a learner waits on its queue for a batch before answering "none yet"


@dataclass
class GroupCounts:
    """One policy's groups after delivery: trained, dropped (stale: too old a version; foreign: another
    policy's) and quarantined (at least one record quarantined), over the whole run."""

    trained: int = 0
    dropped_stale: int = 0
    dropped_foreign: int = 0
    quarantined: int = 0

    def add(self, report: StepReport) -> None:
        m = report.metrics
        self.trained += int(m.get("groups", 0))
        self.dropped_stale += int(m.get("dropped_stale", 0))
        self.dropped_foreign += int(m.get("dropped_foreign", 0))
        self.quarantined += len({q.group_id for q in report.quarantined})

    def record(self, delivered: int) -> dict[str, Any]:
        """The `groups/...` fields of a `rollout` record."""
        return {
            "groups/delivered": delivered,
            "groups/trained": self.trained,
            "groups/dropped_stale": self.dropped_stale,
            "groups/dropped_foreign": self.dropped_foreign,
            "groups/quarantined": self.quarantined,
            "groups/trained_share": self.trained / delivered if delivered else 0.0,
        }


class LearnerLoop:
    def __init__(
        self,
        learners: dict[str, Any],
        queues: dict[str, Any],
        league: Any,
        journal: Journal,
        keep_versions: Callable[[], Iterable[str]],
        request_stop: Callable[[str, int], None],
        running: Callable[[], bool] = lambda: False,
        may_reset: Callable[[str], bool] = lambda policy: True,
        delivered: Callable[[str], int] = lambda policy: 0,
    ) -> None:
        self.learners = learners
        self.queues = queues
        self.league = league
        self.journal = journal
        self.keep_versions = keep_versions  # versions pruning must keep beyond the league's (evaluations)
        self.request_stop = request_stop
        self.running = running  # whether a learner's next step is wanted (the run's budget is not spent)
        self.may_reset = may_reset  # whether the league may answer a version of this policy with a reset
        self.delivered = delivered  # groups the rollouts delivered to this policy's queue, whole run
        self.steps: dict[str, int] = {}
        self.versions: dict[str, str] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self.failures: dict[str, int] = {}
        self.counts: dict[str, GroupCounts] = {}
        self.stepping: dict[Any, str] = {}  # ref -> policy
        self.rollback_asked: dict[str, Any] = {}  # policy -> ref of the league's pending rollback, asked after a step

    def start(self) -> None:
        """Read each learner's restored state, supersede what it lost, and register its version."""
        import ray

        for policy, learner in self.learners.items():
            state = ray.get(learner.state.remote())
            self.steps[policy] = int(state["step"])
            self.versions[policy] = str(state["version"])
            counters = state.get("counters", {})
            self.counts[policy] = GroupCounts(
                int(counters.get("groups_trained", 0)),
                int(counters.get("dropped_stale", 0)),
                int(counters.get("dropped_foreign", 0)),
            )
            self.journal.supersede(policy, self.steps[policy])  # logged after the restored checkpoint: lost
            if ray.get(self.league.pending_reset.remote(policy)):  # stopped between the answer and the reset
                self.versions[policy] = str(ray.get(learner.reset.remote()))
            pending = ray.get(self.league.pending_rollback.remote(policy))
            rolled = None if pending is None else self._rolled(policy, pending, self._roll_back(policy, pending))
            if rolled is not None:  # decided, and maybe carried out, before the driver stopped
                self.versions[policy] = str(ray.get(learner.latest_version.remote()))  # a step may follow it
            ray.get(self.league.register_version.remote(policy, self.versions[policy], self.steps[policy]))
            if pending is not None and rolled is not None:
                self._rolled_back(policy, pending, rolled, self.steps[policy])
            self.journal.recover_learner_records(policy, self.steps[policy])

    def queue_depth(self) -> int:
        return int(sum(q.qsize() for q in self.queues.values()))

    def trained_share(self, policy: str) -> float:
        """Groups trained / groups delivered to `policy`'s queue over the run (0 before any delivery)."""
        delivered = self.delivered(policy)
        return self.counts.get(policy, GroupCounts()).trained / delivered if delivered else 0.0

    def fill(self) -> None:
        """Every idle learner asks its queue for the next batch."""
        busy = set(self.stepping.values())
        for policy in self.learners:
            if policy not in busy:
                self._ask(policy)

    def _ask(self, policy: str) -> None:
        self.stepping[self.learners[policy].train_next.remote(POLL_S)] = policy

    def _ask_again(self, policy: str) -> None:
        """The learner's next step, at once, while the run wants steps (else `fill` or the end decides)."""
        if policy not in self.stepping.values() and self.running():
            self._ask(policy)

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
            self._ask_again(policy)
            return None
        self.failures[policy] = 0
        self._step(policy, report)
        return report

    def _step(self, policy: str, report: StepReport) -> None:
        """Act on one report: the reset (if any) and the next step first, the bookkeeping after (module doc)."""
        import ray

        answered = time.monotonic()
        previous = self.steps.get(policy, 0)
        self.steps[policy] = report.step  # before `running`: a run ends at its `max_steps`
        decision: Any = None
        reset: Any = None
        if report.published:
            self.versions[policy] = str(report.published)
            decision = self.league.register_version.remote(policy, str(report.published), report.step)
            if self.may_reset(policy):  # the answer must reach the learner before its next step
                decision = ray.get(decision)
                if decision.reset:
                    reset = self.learners[policy].reset.remote()  # runs before the next train_next (below)
        asked_rollback = self.rollback_asked.pop(policy, None)
        pending = None if asked_rollback is None or reset is not None else ray.get(asked_rollback)
        rollback = None if pending is None else self._roll_back(policy, pending)  # before the next train_next
        ordered = [ref for ref in (reset, rollback) if ref is not None]
        if ordered:  # done before the next step is sent: a learner host runs a policy's calls in any order
            ray.wait(ordered, num_returns=len(ordered))
        self._ask_again(policy)
        asked = time.monotonic()
        for q in report.quarantined:
            self.journal.fault({"learner": policy, "fault": "quarantined", **q.record()}, policy)
        for fault in report.faults:
            self.journal.fault({"learner": policy, **fault.record()}, policy)
        if report.step < previous or (report.trained and report.step == previous):
            # Ray restarted the learner: it restored its newest checkpoint and redid this step.
            restored = report.step - int(report.trained)
            moved = self.journal.supersede(policy, restored)
            self.journal.fault({"learner_restored": policy, "step": restored, "superseded": moved}, policy)
        self.last[policy] = report.metrics
        counts = self.counts.setdefault(policy, GroupCounts())
        counts.add(report)
        self.journal.log("learner", report.record(), policy)
        if report.published:
            if not isinstance(decision, VersionDecision):
                decision = ray.get(decision)
            self.journal.log("league", {"version": str(report.published), **decision.to_dict()}, policy)
            if reset is not None:
                version = str(ray.get(reset))
                self.versions[policy] = version
                ray.get(self.league.register_version.remote(policy, version, report.step))
            keep = {*ray.get(self.league.refs_in_use.remote()), *self.keep_versions()}
            self.learners[policy].prune_versions.remote(sorted(keep))
        rolled = None if pending is None else self._rolled(policy, pending, rollback)
        if pending is not None and rolled is not None:
            self.versions[policy] = rolled
            ray.get(self.league.register_version.remote(policy, rolled, report.step))
            self._rolled_back(policy, pending, rolled, report.step)
        self.rollback_asked[policy] = self.league.pending_rollback.remote(policy)  # read with the next report
        timing = {"driver/answer_s": asked - answered, "driver/bookkeeping_s": time.monotonic() - asked}
        rollout = self.journal.stats.rollout_record(report.step, self.queue_depth())
        self.journal.log("rollout", rollout | counts.record(self.delivered(policy)) | timing, policy)

    def _roll_back(self, policy: str, pending: dict[str, Any]) -> Any:
        """Ask `policy`'s learner to carry out the league's pending rollback (a ref to the version it publishes)."""
        return self.learners[policy].rollback.remote(pending["to"], f"{pending['current']}->{pending['to']}")

    def _rolled(self, policy: str, pending: dict[str, Any], ref: Any) -> str | None:
        """The version the learner published for the rollback; None and a fault if it failed (asked again later)."""
        import ray

        try:
            return str(ray.get(ref))
        except Exception as exc:  # the best version's weights unreadable, ...: the decision stays pending
            self.journal.fault({"learner": policy, "rollback": pending, "error": repr(exc)[:500]}, policy)
            return None

    def _rolled_back(self, policy: str, pending: dict[str, Any], restored: str, step: int) -> None:
        """The learner published `restored`, the best version's weights: the league closes the decision."""
        import ray

        ray.get(self.league.rollback_done.remote(policy, restored))
        done = {"from": pending["current"], "to": pending["to"], "published": restored, "guards": pending["guards"]}
        self.journal.log("league", {"step": step, "league/rollback_done": done}, policy)

    def save_checkpoints(self) -> None:
        """The final checkpoint of every learner; a failure is a fault (the summary still matters)."""
        import ray

        for policy, learner in self.learners.items():
            try:
                ray.get(learner.save_checkpoint.remote())
            except Exception as exc:
                self.journal.fault({"checkpoint": policy, "error": repr(exc)[:500]}, policy)
