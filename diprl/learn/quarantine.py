"""Screening and quarantine: which records a step trains, and where the others go so nothing is lost.

A record the learner must not train on (malformed, non-finite, rejected by its rebuilt constraint,
too long, or whose own loss is not finite) is not an error that ends the step: it is kept whole in
`run_dir/learner/<policy>/quarantine.jsonl` with its reason and origin (group id, the version that
sampled it, its index in the step), counted, and left out; the rest of the step trains. When the step
itself fails (a bug, not a record), the groups it was given are kept the same way as `learner_error`
before the error goes to the caller.

The file's lines are the JSON form of `QuarantineEntry` with the time, policy and step in front; the
step's `StepReport.quarantined` carries the same entries without the record (`QuarantinedRecord`s).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from diprl.learn.batching import BadRecord, PreparedRecord
from diprl.messages import PolicyRef, QuarantinedRecord, TrainingRecord, TrajectoryGroup

logger = logging.getLogger(__name__)

QUARANTINE_FILE = "quarantine.jsonl"
MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class Origin:
    """Where a record came from, enough to find it again: its group, the version that sampled it, its index."""

    group_id: str | None
    policy_version: str | None
    index: int


@dataclass(frozen=True)
class QuarantineEntry:
    """One quarantined record (or, for `learner_error`, one group of a failed step): why, whence, and itself."""

    reason: str
    error: str
    group_id: str | None
    policy_version: str | None
    index: int | None = None  # the record's index in the step; None for a whole group
    record: Any = None
    group: Any = None

    @classmethod
    def of_record(cls, reason: str, error: str, origin: Origin, record: Any) -> QuarantineEntry:
        return cls(reason, error[:MAX_ERROR_CHARS], origin.group_id, origin.policy_version, origin.index, record=record)

    @classmethod
    def of_group(cls, error: BaseException, group: Any) -> QuarantineEntry:
        """A group of a step that raised: kept whole, with the error."""
        return cls(
            "learner_error",
            f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS],
            getattr(group, "group_id", None),
            _text_or_none(getattr(group, "policy_version", None)),
            group=group,
        )

    def origin(self) -> QuarantinedRecord:
        """Reason and origin, without the record (what the step's report carries; the file keeps the record)."""
        index = None if self.group is not None else self.index
        return QuarantinedRecord(self.reason, self.error, self.group_id, self.policy_version, index)

    def line(self) -> dict[str, Any]:
        """The quarantine file's JSON of this entry (without its time, policy and step)."""
        fields = self._fields()
        for key in ("record", "group"):
            if key in fields:
                fields[key] = _plain(fields[key])
        return fields

    def _fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reason": self.reason, "error": self.error}
        out.update(group_id=self.group_id, policy_version=self.policy_version)
        if self.group is not None:
            out["group"] = self.group
        else:
            out.update(index=self.index, record=self.record)
        return out


@dataclass
class Screened:
    """A step's records after screening: what trains (prepared, with the record and origin of each) and what not."""

    prepared: list[PreparedRecord] = field(default_factory=list)
    records: list[TrainingRecord] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)
    quarantined: list[QuarantineEntry] = field(default_factory=list)

    def entry(self, i: int, reason: str, error: str) -> QuarantineEntry:
        """A quarantine entry for the screened record `i` (one that passed screening and failed later)."""
        return QuarantineEntry.of_record(reason, error, self.origins[i], self.records[i])


def screen(
    records: Sequence[TrainingRecord],
    origins: Sequence[Origin],
    prepare: Callable[[TrainingRecord, int], PreparedRecord],
) -> Screened:
    """Validate every record (`prepare` raises `BadRecord`); the bad ones are quarantined, the rest prepared."""
    out = Screened()
    for i, (record, origin) in enumerate(zip(records, origins, strict=True)):
        try:
            if not isinstance(record, TrainingRecord):
                raise BadRecord("malformed", f"record {i}: a {type(record).__name__}, not a TrainingRecord")
            prepared = prepare(record, i)
        except BadRecord as err:
            out.quarantined.append(QuarantineEntry.of_record(err.reason, str(err), origin, record))
            continue
        out.prepared.append(prepared)
        out.records.append(record)
        out.origins.append(origin)
    return out


def origins_of(groups: Sequence[TrajectoryGroup]) -> tuple[list[TrainingRecord], list[Origin]]:
    """Every record of `groups` with its origin, in order."""
    records: list[TrainingRecord] = []
    origins: list[Origin] = []
    for group in groups:
        for index, record in enumerate(group.records):
            records.append(record)
            origins.append(Origin(group.group_id, str(group.policy_version), index))
    return records, origins


def loose_origins(records: Sequence[TrainingRecord]) -> list[Origin]:
    """The origins of records handed in without their groups (`train_records`): the version each names."""
    return [Origin(None, _text_or_none(getattr(r, "policy_version", None)), i) for i, r in enumerate(records)]


class QuarantineFile:
    """One policy's `quarantine.jsonl`; only the writer (rank 0 of a group) appends, every rank logs."""

    def __init__(self, path: Path, policy: str, writer: bool = True) -> None:
        self.path = path
        self.policy = policy
        self.writer = writer

    def record(self, entries: Sequence[QuarantineEntry], step: int) -> int:
        """Log and keep bad records found while taking step `step`; returns how many."""
        for entry in entries:
            logger.warning("%s: quarantined a record (%s): %s", self.policy, entry.reason, entry.error)
        self.append(entries, step)
        return len(entries)

    def append(self, entries: Sequence[QuarantineEntry], step: int) -> None:
        """Append `entries` (nothing is lost: the whole record is kept). A failing write (a full disk) is
        logged, not raised: the step's metrics still name every entry."""
        if not entries or not self.writer:
            return
        now = time.time()
        lines = "".join(
            json.dumps({"time": now, "policy": self.policy, "step": step, **e.line()}, default=str) + "\n"
            for e in entries
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write(lines)
        except OSError as err:
            logger.error("%s: could not write %d quarantined records (%s)", self.policy, len(entries), err)


def _plain(obj: Any) -> Any:
    """A record or group as JSON-ready data for the quarantine file, versions as text (what their `to_dict`
    writes), whatever it holds: a malformed one is kept as it is, nothing is lost."""
    if isinstance(obj, PolicyRef):
        return str(obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def _text_or_none(version: Any) -> str | None:
    """A group's version as the entry keeps it: text (whatever a malformed group held instead)."""
    return None if version is None else str(version)
