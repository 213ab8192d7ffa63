"""Behaviour cloning through the learner: batches of whole game states, one optimiser step each.

The learner is the GRPO learner (`Learner.train_records(records, "bc")`: the same masks, packing,
optimiser and publishing), so imitation has no trainer of its own. What belongs here is the order
of the data: every decision of one game state (the seven powers of one phase of one game) goes into
the same step, because their prompts share the rules and the board, and a learner that forwards a
shared prefix once gains most where a batch holds the whole state.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from diprl.imitation.teacher import TeacherExample
from diprl.messages import StepReport, TrainingRecord


class RecordTrainer(Protocol):
    """What behaviour cloning needs from a trainer (`diprl.learn.learner.Learner` is the one used)."""

    def train_records(self, records: Sequence[TrainingRecord], objective: str = "bc") -> StepReport: ...


def state_groups(examples: Sequence[TeacherExample]) -> list[list[int]]:
    """Indices of `examples` grouped by game state (game, phase), in first-seen order."""
    groups: dict[tuple[int, str], list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault(example.state, []).append(i)
    return list(groups.values())


def state_batches(groups: Sequence[Sequence[int]], batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of about `batch_size` indices made of whole groups, over seeded shuffled epochs.

    A batch closes before a group that would take it past `batch_size` (a group larger than the
    batch is a batch of its own), so every index is trained once per epoch and no state is split; the
    last batch of an epoch is completed from the next epoch's first groups.
    """
    if not groups or not any(groups):
        raise ValueError("no training examples")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    rng = random.Random(f"bc:{seed}")
    batch: list[int] = []
    while True:
        epoch = list(range(len(groups)))
        rng.shuffle(epoch)
        for g in epoch:
            if batch and len(batch) + len(groups[g]) > batch_size:
                yield batch
                batch = []
            batch.extend(groups[g])


def planned_batches(
    examples: Sequence[TeacherExample], batch_size: int, seed: int, steps: int = 0, epochs: float = 0.0
) -> Iterator[list[int]]:
    """The batches (indices into `examples`) of `steps` steps or of `epochs` passes over `examples`
    (exactly one is set; `epochs` counts records, since batches of whole states vary in size)."""
    if (steps > 0) == (epochs > 0):
        raise ValueError(f"set exactly one of steps and epochs, got steps={steps} epochs={epochs}")
    target = epochs * len(examples)
    batches = state_batches(state_groups(examples), batch_size, seed)
    taken = sent = 0
    while (steps and taken < steps) or (epochs and sent < target):
        batch = next(batches)
        taken, sent = taken + 1, sent + len(batch)
        yield batch


def train_bc(
    trainer: RecordTrainer,
    examples: Sequence[TeacherExample],
    batches: Iterable[Sequence[int]],
    on_step: Callable[[dict[str, Any]], bool | None] | None = None,
) -> list[dict[str, Any]]:
    """One optimiser step per batch (indices into `examples`, e.g. `planned_batches`); `on_step` returning
    True stops early."""
    history: list[dict[str, Any]] = []
    for batch in batches:
        records = [examples[i].to_training_record() for i in batch]
        metrics = trainer.train_records(records, objective="bc").record()
        history.append(metrics)
        if on_step is not None and on_step(metrics):
            break
    return history
