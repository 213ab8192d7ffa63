"""The run's record: `metrics.jsonl` (through the `Tracker`), with every learner step counted exactly once.

A learner step counts once its checkpoint is durable. Steps logged after the checkpoint a learner
restored (lost with a killed driver, or with a learner Ray restarted) are moved to
`metrics.superseded.jsonl` when the learner takes them again; a step the learner checkpointed but a
killed driver never logged is copied from the learner's own log (`recovered: true`). Every fault
(injected or real: a failed step, a quarantined record, a restarted actor) is one `fault` record and
counted on the progress line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diprl.atomic_io import move_jsonl_records
from diprl.run.progress import RunStats

LEARNER_LOG = Path("learner") / "{policy}" / "metrics.jsonl"


class Journal:
    def __init__(self, run_dir: Path, tracker: Any, stats: RunStats) -> None:
        self.run_dir = run_dir
        self.tracker = tracker
        self.stats = stats

    def log(self, kind: str, values: dict[str, Any], policy: str = "main") -> None:
        self.tracker.log(kind, values, policy)

    def fault(self, values: dict[str, Any], policy: str = "main") -> None:
        self.stats.faults += 1
        self.tracker.log("fault", values, policy)

    def supersede(self, policy: str, last_step: int) -> int:
        """Move `policy`'s learner, rollout and evaluation records after `last_step` to metrics.superseded.jsonl."""

        def lost(record: dict[str, Any]) -> bool:
            step = record.get("step", record.get("learner/step"))
            return (
                record.get("policy") == policy
                and record.get("kind") in ("learner", "rollout", "eval")
                and isinstance(step, int)
                and step > last_step
            )

        if self.tracker is not None:
            return int(self.tracker.move_records(lost, self.run_dir / "metrics.superseded.jsonl"))
        return move_jsonl_records(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.superseded.jsonl", lost)

    def recover_learner_records(self, policy: str, step: int) -> int:
        """Copy into metrics.jsonl the learner steps up to `step` its own log holds but this file lacks.

        A driver killed after the learner took (and checkpointed) a step but before logging it leaves a
        step that counts (its checkpoint is durable) with no record here. The learner's own log has it.
        """
        from diprl.tracking import read_metrics

        logged = {
            r["step"]
            for r in read_metrics(self.run_dir / "metrics.jsonl")
            if r.get("kind") == "learner" and r.get("policy") == policy and isinstance(r.get("step"), int)
        }
        recovered = 0
        for record in read_metrics(self.run_dir / str(LEARNER_LOG).format(policy=policy)):
            number = record.get("step")
            if isinstance(number, int) and 0 < number <= step and number not in logged and record.get("trained", 1):
                values = {k: v for k, v in record.items() if k not in ("time", "kind", "policy")}
                self.log("learner", values | {"recovered": True}, policy)
                logged.add(number)
                recovered += 1
        return recovered
