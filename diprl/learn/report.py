"""What a learner step tells: its times by phase, and the learner's own metrics log.

`StepTimer` adds up the wall time of each phase of a step (a phase may be entered more than once: the
optimiser's time is its step and its EMA, not the later epochs between them); `MetricsLog` appends each
step's record to `run_dir/learner/<policy>/metrics.jsonl` (rank 0 of a group only).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STEP_PHASES = ("recompute", "fwd_bwd", "optimizer", "publish", "checkpoint")
"""The phases every taken step reports (`time_<phase>_s`), in the order of the metrics."""


class StepTimer:
    """Wall time of a step since it began, and of each named phase (summed over its entries)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.spent: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - began

    def total(self) -> float:
        return time.perf_counter() - self.start

    def metrics(self, phases: tuple[str, ...] = STEP_PHASES) -> dict[str, float]:
        """`time_<phase>_s` for each of `phases` (0 for one not entered), then `time_step_s`."""
        out = {f"time_{name}_s": self.spent.get(name, 0.0) for name in phases}
        out["time_step_s"] = self.total()
        return out


class MetricsLog:
    """A learner's own metrics file; a failing write (full disk) is logged, never raised.

    The metrics also return to the driver, whose `metrics.jsonl` is the run's record.
    """

    def __init__(self, path: Path, policy: str, writer: bool = True) -> None:
        self.path = path
        self.policy = policy
        self.writer = writer

    def append(self, metrics: dict[str, Any]) -> None:
        if not self.writer:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write(json.dumps({"time": time.time(), "policy": self.policy, **metrics}) + "\n")
        except OSError as err:
            logger.error("%s: could not append to %s (%s)", self.policy, self.path, err)
