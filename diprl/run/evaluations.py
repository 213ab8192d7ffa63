"""Evaluations along the way: the fixed suite at the start, every `evaluation.every_steps` main steps,
and at the end, one at a time, off the training path (the evaluator is another PolicyServer client).

A stopping run starts no new evaluation until its end, where the final version is evaluated on the
same fixed games: the "after" of a before/after comparison.
"""

from __future__ import annotations

from typing import Any

from diprl.messages import EvaluationResult
from diprl.run.config import EvalScheduleConfig
from diprl.run.journal import Journal
from diprl.run.rundir import Counters


class EvalSchedule:
    def __init__(self, evaluator: Any, config: EvalScheduleConfig, journal: Journal, counters: Counters) -> None:
        self.evaluator = evaluator
        self.config = config
        self.journal = journal
        self.counters = counters
        self.running: dict[Any, tuple[str, int]] = {}  # ref -> (version, step)
        self.waiting: list[tuple[str, int]] = []
        self.next_step: int | None = None
        self.last_version: str | None = None
        self.last: dict[str, float] = {}  # opponents -> hero mean centres of the latest evaluation

    def start(self, version: str, step: int) -> None:
        e = self.config
        if e.at_start and self.counters.evaluations == 0:
            self.waiting.append((version, step))
        self.next_step = (step // e.every_steps + 1) * e.every_steps if e.every_steps else None

    def on_step(self, version: str, step: int) -> None:
        if self.next_step is not None and step >= self.next_step:
            self.waiting.append((version, step))
            self.next_step += self.config.every_steps

    def fill(self, stopping: bool) -> None:
        if self.waiting and not self.running and not stopping:
            version, step = self.waiting.pop(0)
            self.running[self.evaluator.evaluate.remote(version, f"step{step}")] = (version, step)

    def refs(self) -> list[Any]:
        return list(self.running)

    def protected(self) -> list[str]:
        """Versions being or waiting to be evaluated: pruning must keep them."""
        return [v for v, _ in [*self.running.values(), *self.waiting]]

    def handle(self, ref: Any) -> None:
        import ray

        version, step = self.running.pop(ref)
        try:
            result = ray.get(ref)
        except Exception as exc:
            self.journal.fault({"evaluation": version, "error": repr(exc)[:500]})
            return
        self.record(result, version, step)

    def record(self, result: EvaluationResult, version: str, step: int) -> None:
        """Count one finished evaluation and log one `eval` line per opponent (the report stays on disk)."""
        self.counters.evaluations += 1
        self.last_version = version
        for o in result.opponents:
            self.last[o.opponent] = o.mean_centres
            self.journal.log(
                "eval",
                {
                    "step": step,
                    "version": version,
                    "opponents": o.opponent,
                    "eval/games": o.games,
                    "eval/hero_mean_sc": o.mean_centres,
                    "eval/hero_mean_sc_lo": o.centres_ci95[0],
                    "eval/hero_mean_sc_hi": o.centres_ci95[1],
                    "eval/hero_solo_rate": o.solo_rate,
                    "eval/report": result.report,
                },
            )

    def final(self, version: str, step: int) -> None:
        """Evaluate the final version now (waiting for it), unless it already was."""
        if self.config.at_end and self.last_version != version:
            ref = self.evaluator.evaluate.remote(version, f"step{step}")
            self.running[ref] = (version, step)
            self.handle(ref)
