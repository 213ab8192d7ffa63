"""Quarantine entries and the step timer, without a model: the file's JSON lines and the phase sums by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diprl.learn import report
from diprl.learn.batching import BadRecord, PreparedRecord
from diprl.learn.quarantine import Origin, QuarantineEntry, QuarantineFile, screen
from diprl.learn.report import StepTimer
from diprl.messages import PolicyRef, QuarantinedRecord, TrainingRecord, TrajectoryGroup


def _record(version: str = "main@v2") -> TrainingRecord:
    return TrainingRecord(
        prompt_ids=[1, 2],
        completion_ids=[3],
        behaviour_logprobs=[-0.5],
        legal={},
        advantages=[1.0],
        policy_version=PolicyRef.parse(version),
        temperature=1.0,
        power="FRANCE",
        phase="S1901M",
        reward=1.0,
    )


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_quarantined_record_and_a_failed_steps_group_are_written_whole_in_their_json_form(tmp_path: Path) -> None:
    record = _record()
    group = TrajectoryGroup("g1", "m1", "FRANCE", "S1901M", PolicyRef.parse("main@v2"), [record], [1.0], 1.0)
    bad = QuarantineEntry.of_record("nonfinite", "x" * 2000, Origin("g1", "main@v2", 4), record)
    failed = QuarantineEntry.of_group(RuntimeError("a bug"), group)
    file = QuarantineFile(tmp_path / "quarantine.jsonl", "main")
    assert file.record([bad], step=3) == 1
    file.append([failed], step=3)
    QuarantineFile(tmp_path / "quarantine.jsonl", "main", writer=False).append([bad], step=4)  # rank > 0: no write

    first, second = _lines(tmp_path / "quarantine.jsonl")
    assert list(first) == ["time", "policy", "step", "reason", "error", "group_id", "policy_version", "index", "record"]
    assert first["step"] == 3 and first["index"] == 4 and first["error"] == "x" * 1000
    assert first["record"] == json.loads(json.dumps(record.to_dict()))  # the whole record, nothing lost
    assert first["record"]["policy_version"] == "main@v2"  # the version as text, as everywhere in JSON
    assert list(second) == ["time", "policy", "step", "reason", "error", "group_id", "policy_version", "group"]
    assert second["reason"] == "learner_error" and second["error"] == "RuntimeError: a bug"
    assert second["group"]["records"][0]["completion_ids"] == [3]
    assert second["group"]["records"][0]["policy_version"] == "main@v2"
    # the step's report names the entry without the record
    assert bad.origin() == QuarantinedRecord("nonfinite", "x" * 1000, "g1", "main@v2", 4)
    assert failed.origin() == QuarantinedRecord("learner_error", "RuntimeError: a bug", "g1", "main@v2", None)
    assert failed.origin().record() == {k: second[k] for k in ("reason", "error", "group_id", "policy_version")}


def test_screening_quarantines_bad_records_and_keeps_the_origins_of_the_rest() -> None:
    records: list[object] = [_record(), "not a record", _record("main@v3")]
    origins = [Origin("g", "main@v2", 0), Origin("g", "main@v2", 1), Origin("h", "main@v3", 0)]

    def prepare(record: TrainingRecord, i: int) -> PreparedRecord:
        if record.policy_version == PolicyRef.adapter("main", 3):
            raise BadRecord("constraint", f"record {i}: rejected")
        return PreparedRecord([1, 2], [3], [], 1.0, [-0.5], [1.0], record.policy_version)

    screened = screen(records, origins, prepare)  # type: ignore[arg-type]
    assert len(screened.prepared) == 1 and screened.origins == [origins[0]]
    assert [(e.reason, e.index, e.group_id) for e in screened.quarantined] == [
        ("malformed", 1, "g"),
        ("constraint", 0, "h"),
    ]
    assert screened.entry(0, "nonfinite_loss", "late").record is records[0]


def test_the_timer_sums_each_phase_over_its_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 3.0, 3.0, 10.0, 10.5, 11.0, 12.0])
    monkeypatch.setattr(report.time, "perf_counter", lambda: next(clock))
    timer = StepTimer()  # starts at 0
    with timer.phase("optimizer"):  # 1 -> 3
        pass
    with timer.phase("epochs"):  # 3 -> 10
        pass
    with timer.phase("optimizer"):  # 10.5 -> 11: entered again, added
        pass
    assert timer.metrics(("recompute", "optimizer")) == {
        "time_recompute_s": 0.0,
        "time_optimizer_s": 2.5,
        "time_step_s": 12.0,
    }
    assert timer.spent["epochs"] == 7.0
