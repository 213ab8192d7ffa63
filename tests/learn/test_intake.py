"""A learner's intake: balanced batches from its own queue, stale groups dropped, the batch in flight on disk."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diprl.learn.intake import GroupIntake, balanced
from diprl.messages import PolicyRef, TrainingRecord, TrajectoryGroup


def _group(gid: str, power: str, version: str = "main@v3") -> TrajectoryGroup:
    ref = PolicyRef.parse(version)
    record = TrainingRecord([1, 2], [3], [-0.5], {"power": power}, [1.0], ref, 1.0, power, "S1901M")
    return TrajectoryGroup(gid, "m", power, "S1901M", ref, [record], [1.0], 1.0)


class FakeQueue:
    """The part of `ray.util.queue.Queue` the intake uses, in memory."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)

    def qsize(self) -> int:
        return len(self.items)

    def get_nowait_batch(self, n: int) -> list[Any]:
        assert n <= len(self.items), "the intake asked for more than the queue holds"
        taken, self.items = self.items[:n], self.items[n:]
        return taken

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        from ray.util.queue import Empty

        if not self.items:
            raise Empty
        return self.items.pop(0)


def _intake(tmp_path: Path, items: list[Any], n: int = 4, holdover: int = 8) -> GroupIntake:
    intake = GroupIntake("queue-main", tmp_path, n, holdover)
    intake._queue = FakeQueue(items)
    return intake


def test_a_batch_is_balanced_over_powers_oldest_first() -> None:
    """Seven groups of one self-play match must not make a step of one position: round-robin over powers."""
    arrivals = [_group(f"a{i}", "FRANCE") for i in range(5)] + [_group("b0", "ITALY"), _group("c0", "RUSSIA")]
    batch, rest = balanced(arrivals, 4)
    assert [g.group_id for g in batch] == ["a0", "b0", "c0", "a1"]
    assert [g.group_id for g in rest] == ["a2", "a3", "a4"]
    only_one_power, _ = balanced([_group(f"a{i}", "FRANCE") for i in range(3)], 2)
    assert [g.group_id for g in only_one_power] == ["a0", "a1"]  # nothing else waiting: that power it is


def test_take_waits_for_enough_fresh_groups_and_drops_stale_ones(tmp_path: Path) -> None:
    items = [_group("old", "FRANCE", "main@v1"), *[_group(f"g{i}", p) for i, p in enumerate(["FRANCE", "ITALY"])]]
    intake = _intake(tmp_path, items, n=2)
    fresh = lambda version: version != PolicyRef.parse("main@v1")  # noqa: E731
    batch = intake.take(fresh, timeout_s=0.1)
    assert batch is not None and [g.group_id for g in batch] == ["g0", "g1"]
    assert intake.dropped_stale == 1
    assert intake.take(fresh, timeout_s=0.05) is None  # the queue is empty: no batch, no error


def test_the_holdover_is_bounded_so_the_queue_still_pushes_back(tmp_path: Path) -> None:
    items = [_group(f"g{i}", "FRANCE") for i in range(20)]
    intake = _intake(tmp_path, items, n=2, holdover=4)
    assert intake.take(lambda v: True, timeout_s=0.1) is not None
    assert len(intake.waiting) == 2 and intake._queue.qsize() == 16  # took 4, trained 2, kept 2


def test_the_batch_in_flight_survives_a_restart_unless_its_step_was_checkpointed(tmp_path: Path) -> None:
    intake = _intake(tmp_path, [])
    batch = [_group("g0", "FRANCE"), _group("g1", "ITALY")]
    intake.hold(batch, for_step=8)
    # A learner killed mid-step restores step 6 (its checkpoint): the batch of step 8 is trained again.
    again = GroupIntake("queue-main", tmp_path, 4, 8).pending(restored_step=6)
    assert again == batch
    # Restored at step 8: that step was checkpointed, so its batch was trained; it is dropped.
    assert GroupIntake("queue-main", tmp_path, 4, 8).pending(restored_step=8) is None
    assert not (tmp_path / "pending.json").exists()
    intake.hold(batch, for_step=9)
    assert intake.has_pending()  # what `Learner.ready` asks: the next step has a batch without waiting
    intake.release()
    assert not intake.has_pending()
    assert intake.pending(restored_step=0) is None


def test_a_pending_batch_written_before_versions_were_parsed_refs_still_resumes(tmp_path: Path) -> None:
    """A run directory from before a group's version was a PolicyRef: its pending.json holds the version as
    text, exactly the form written now, and the learner trains that batch again after a restart."""
    record = {
        "prompt_ids": [1, 2], "completion_ids": [3], "behaviour_logprobs": [-0.5], "legal": {"power": "FRANCE"},
        "advantages": [1.0], "policy_version": "main@v3", "temperature": 1.0, "power": "FRANCE", "phase": "S1901M",
        "reward": 0.0, "reward_components": {}, "order_rewards": {},
    }  # fmt: skip
    group = {
        "group_id": "g0", "match_id": "m", "power": "FRANCE", "phase": "S1901M", "policy_version": "main@v3",
        "records": [record], "returns": [1.0], "advantage_std": 1.0, "hero": True,
    }  # fmt: skip
    (tmp_path / "pending.json").write_text(json.dumps({"for_step": 8, "groups": [group]}))
    [again] = GroupIntake(None, tmp_path, 4, 8).pending(restored_step=6) or []
    assert again == _group("g0", "FRANCE") and again.policy_version == PolicyRef.adapter("main", 3)
    assert again.records[0].policy_version == PolicyRef.adapter("main", 3)  # the records' versions parsed too


@pytest.mark.parametrize("text", ["{torn", "[" * 100_000 + "]" * 100_000])  # torn; nested too deeply (N5)
def test_an_unreadable_pending_batch_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    (tmp_path / "pending.json").write_text(text)
    assert GroupIntake(None, tmp_path, 4, 8).pending(restored_step=0) is None
    assert "unreadable pending batch" in caplog.text
    with pytest.raises(RuntimeError, match="no queue"):
        GroupIntake(None, tmp_path, 4, 8).take(lambda v: True, timeout_s=0.0)


def test_a_waiting_take_gives_way_at_once_and_ready_takes_nothing_it_cannot_batch(tmp_path: Path) -> None:
    """A learner host's waiting adapter stops waiting when another adapter has a batch (`give_way`)."""
    import time

    intake = _intake(tmp_path, [_group("g0", "FRANCE")], n=2)
    fresh = lambda version: True  # noqa: E731
    assert not intake.ready(fresh)
    asked: list[float] = []

    def give_way() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 2

    began = time.monotonic()
    assert intake.take(fresh, timeout_s=30.0, give_way=give_way) is None
    assert time.monotonic() - began < 5.0  # gave way, did not wait out its 30 s
    assert [g.group_id for g in intake.waiting] == ["g0"]  # what it pulled stays for its next take
    intake._queue.items.append(_group("g1", "ITALY"))
    assert intake.ready(fresh)
    assert [g.group_id for g in intake.take(fresh, timeout_s=0.0, give_way=lambda: True) or []] == ["g0", "g1"]
