"""Evaluations along the way: the fixed suite at the start, every `evaluation.every_steps` main steps,
and at the end, one at a time, off the training path (the evaluator is another PolicyServer client).

An evaluator slower than the cadence does not build a backlog: an evaluation that comes due while an
earlier scheduled one is still waiting replaces it (the newer version is the one worth measuring; the
start's "before" is never replaced), and the eval records that follow name the versions it replaced
(`eval/superseded`).

A stopping run starts no new evaluation until its end, where the final version is evaluated on the
same fixed games: the "after" of a before/after comparison. Once the training budget is spent, the
evaluation in flight finishes, but no crossplay round starts and (with `evaluation.at_end`) no scheduled
evaluation either: the final one measures a newer version, and its records name those it superseded.

An evaluation whose call failed (its PolicyServer replica or the evaluator restarted under it) is on
record as a fault and runs again, up to `evaluation.retries` times, before the next one: the step-0
"before" is not lost to a restart.

Each finished evaluation is also told to the league (`LeagueManager.observe_evaluation`): it tracks main's
best version and runs the collapse guards; a guard that fires is a `fault` record here, a rollback the
league decides a `league` record.

The frozen evaluation pool: before each evaluation the league's pins (`LeagueManager.eval_pins`: main's
first snapshot and every `league.health.pin_every`-th after it, at most `pin_max`) are handed to the
evaluator (`Evaluator.pin`), so main meets its own past on the same seeded games every time; a new pin is a
`league` record (`league/eval_pin`, `eval/pool`), and its games are `eval` records like any opponent's.

Scheduled crossplay: after each evaluation, when the evaluator is free, one round of pool pairs the league's
Nash lacks games for (`LeagueManager.crossplay_plan`, `league.health.crossplay_pairs` pairs of
`crossplay_games` seeded games) is played by the evaluator (`Evaluator.crossplay`, keeping each pair's first
`crossplay_replays` games as replays for the league page) and goes into the payoff (`report_crossplay`, once
per round); a `league` record (`league/crossplay`) says which pairs and how each hero fared.

A version a replica refused by its canary is not evaluated: the league's stand-in for it (the newest
earlier version whose canary a replica passed, else the role's first, `LeagueManager.verified`) is, and
the `eval` records name it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diprl.messages import EvaluationResult, PolicyRef
from diprl.run.config import EvalScheduleConfig
from diprl.run.journal import Journal
from diprl.run.rundir import Counters


@dataclass(eq=False)
class EvalSchedule:
    """Which version is evaluated when, one evaluation at a time (see the module doc)."""

    evaluator: Any
    config: EvalScheduleConfig
    journal: Journal
    counters: Counters
    running: dict[Any, tuple[str, int, int]] = field(default_factory=dict)  # ref -> (version, step, attempt)
    waiting: list[tuple[str, int, int]] = field(default_factory=list)
    next_step: int | None = None
    last_version: str | None = None
    last: dict[str, float] = field(default_factory=dict)  # opponents -> hero mean centres of the latest evaluation
    league: Any = None  # the LeagueManager actor, told every evaluation (None: nobody is)
    adapters: Any = None  # the run's AdapterStore, where the league's best version is marked `<policy>@best`
    planted_collapse: int = 0  # `train.plant_collapse_at_step`: from this step on, evaluations report no supports
    pinned: set[str] = field(default_factory=set)  # the league's pins already handed to the evaluator
    crossplaying: dict[Any, tuple[str, int]] = field(default_factory=dict)  # ref -> (tag, step)
    crossplay_due: int | None = None  # the step of the evaluation after which a crossplay round is due
    start_step: int | None = None  # the step the run (re)started at: its "before" evaluation is never replaced
    superseded: dict[str, list[str]] = field(default_factory=dict)  # version -> the waiting ones it replaced

    def start(self, version: str, step: int) -> None:
        e = self.config
        self.start_step = step
        if e.at_start and self.counters.evaluations == 0:
            self.waiting.append((version, step, 0))
        self.next_step = (step // e.every_steps + 1) * e.every_steps if e.every_steps else None

    def on_step(self, version: str, step: int) -> None:
        if self.next_step is not None and step >= self.next_step:
            self._supersede(version)
            self.waiting.append((version, step, 0))
            while self.next_step <= step:
                self.next_step += self.config.every_steps

    def _supersede(self, version: str) -> None:
        """The waiting evaluations give way to `version`'s, whose eval records name them (the "before" stays)."""
        replaced = [w for w in self.waiting if not self._is_before(w)]
        for entry in replaced:
            self.waiting.remove(entry)
        earlier = [v for old, *_ in replaced for v in [*self.superseded.pop(old, []), old] if v != version]
        if earlier:
            self.superseded[version] = [*self.superseded.get(version, []), *earlier]

    def _is_before(self, entry: tuple[str, int, int]) -> bool:
        """Whether a waiting entry is the run's "before" (the start's evaluation, or a retry of it)."""
        return self.start_step is not None and entry[1] <= self.start_step

    def fill(self, stopping: bool, spent: bool = False) -> None:
        """Start the next waiting evaluation, else a due crossplay round, when the evaluator is free.

        `stopping` (a stop was requested): nothing new starts. `spent` (the training budget is out): no
        crossplay round starts, and with `evaluation.at_end` no scheduled evaluation either: the final one
        measures a newer version and names them as superseded. The run's "before" still runs.
        """
        if self.running or self.crossplaying or stopping:
            return
        if spent:
            self.crossplay_due = None
        runnable = [w for w in self.waiting if not (spent and self.config.at_end) or self._is_before(w)]
        if runnable:
            self.waiting.remove(runnable[0])
            self._submit(*runnable[0])
        elif self.crossplay_due is not None:
            self._crossplay(self.crossplay_due)
            self.crossplay_due = None

    def _crossplay(self, step: int) -> None:
        """The league's next crossplay round (pool pairs its Nash lacks games for) on the evaluator."""
        import ray

        plan = ray.get(self.league.crossplay_plan.remote())
        if plan["pairs"]:
            tag = f"crossplay-step{step}"
            ref = self.evaluator.crossplay.remote(
                plan["pairs"], plan["games"], tag, plan["replays"], plan["keep_rounds"]
            )
            self.crossplaying[ref] = (tag, step)

    def _submit(self, version: str, step: int, attempt: int) -> Any:
        if self.league is not None:
            import ray

            version = str(ray.get(self.league.verified.remote(version)))
            self._pin(step)
        ref = self.evaluator.evaluate.remote(version, f"step{step}")
        self.running[ref] = (version, step, attempt)
        return ref

    def _pin(self, step: int) -> None:
        """Hand the evaluator the league's new pins (main's snapshots for the frozen pool) before an evaluation.

        `Evaluator.pin` is idempotent and the evaluator keeps its pins on disk, so a resumed driver hands
        them over again harmlessly; a pin is on record (a `league` record) only when it entered the pool."""
        import ray

        new = [v for v in ray.get(self.league.eval_pins.remote()) if v not in self.pinned]
        if not new:
            return
        before = set(ray.get(self.evaluator.pool.remote()))
        for version in new:
            pool = list(ray.get(self.evaluator.pin.remote(version)))
            self.pinned.add(version)
            if version not in before:
                self.journal.log("league", {"step": step, "league/eval_pin": version, "eval/pool": pool})

    def refs(self) -> list[Any]:
        return [*self.running, *self.crossplaying]

    def protected(self) -> list[str]:
        """Versions being or waiting to be evaluated: pruning must keep them."""
        return [v for v, _, _ in [*self.running.values(), *self.waiting]]

    def handle(self, ref: Any) -> None:
        """Log a finished evaluation; a failed one is a fault, queued again first while retries are left."""
        if ref in self.crossplaying:
            self._crossplayed(ref)
            return
        version, step, attempt = self.running[ref]
        if not self._settle(ref) and attempt < self.config.retries:
            self.waiting.insert(0, (version, step, attempt + 1))

    def _settle(self, ref: Any) -> bool:
        """Wait for `ref`, log its result or its fault; whether it succeeded."""
        import ray

        version, step, attempt = self.running.pop(ref)
        try:
            result = ray.get(ref)
        except Exception as exc:
            self.journal.fault({"evaluation": version, "step": step, "attempt": attempt, "error": repr(exc)[:500]})
            return False
        self.record(result, version, step)
        return True

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
                }
                | ({"eval/superseded": self.superseded[version]} if self.superseded.get(version) else {}),
            )
        self.superseded.pop(version, None)
        if self.league is not None:
            self._tell_league(result, version, step)

    def _crossplayed(self, ref: Any) -> None:
        """A crossplay round finished: its games go into the league's payoff, once, and on record."""
        import ray

        tag, step = self.crossplaying.pop(ref)
        try:
            results = ray.get(ref)
        except Exception as exc:  # not retried: the next evaluation schedules the next round
            self.journal.fault({"crossplay": tag, "step": step, "error": repr(exc)[:500]})
            return
        answer = ray.get(self.league.report_crossplay.remote(tag, results))
        pairs = [
            {"hero": r["hero"], "opponent": r["opponent"], "games": r["games"], "hero_outcome": _mean(r["outcomes"])}
            for r in results
        ]
        self.journal.log(
            "league",
            {
                "step": step,
                "league/crossplay": pairs,
                "league/crossplay_games": answer["games"],
                "league/crossplay_tag": tag,
            },
        )

    def _tell_league(self, result: EvaluationResult, version: str, step: int) -> None:
        """The league's best version and collapse guards read this evaluation; what fired goes on record."""
        import ray

        self.crossplay_due = step
        score, low, high, rates = evaluation_health(result)
        if self.planted_collapse and step >= self.planted_collapse:
            rates = rates | {"support_rate": 0.0}
            self.journal.fault({"planted_collapse": version, "step": step, "support_rate": 0.0})
        answer = ray.get(self.league.observe_evaluation.remote(version, step, score, low, high, rates))
        for fault in answer["faults"]:
            self.journal.fault(fault)
        if answer["became_best"] and self.adapters is not None:
            self._mark_best(version, step, score)
        if answer["rollback"] is not None:
            self.journal.log("league", {"step": step, "league/rollback": answer["rollback"]})

    def _mark_best(self, version: str, step: int, score: float) -> None:
        """The league's new best version becomes `<policy>@best` in the run's AdapterStore (what `python -m
        diprl.evaluate policy=main@best` and the web app play); a failure to write it is a fault, not a stop."""
        from diprl.inference.adapters import AdapterError
        from diprl.inference.adapters.store import BEST

        policy = PolicyRef.parse(version).policy
        try:
            self.adapters.set_alias(policy, BEST, version, step=step, score=score)
        except (AdapterError, OSError) as exc:
            self.journal.fault({"best_alias": version, "error": repr(exc)[:500]})
            return
        self.journal.log("league", {"step": step, "league/best": version})

    def final(self, version: str, step: int) -> None:
        """Evaluate the final version now (waiting for it), unless it already was."""
        if not self.config.at_end or self.last_version == version:
            return
        self._supersede(version)
        for attempt in range(self.config.retries + 1):
            if self._settle(self._submit(version, step, attempt)):
                return


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def evaluation_health(result: EvaluationResult) -> tuple[float, float, float, dict[str, Any]]:
    """(score, low, high, behaviour rates) of one evaluation, what the league's best version and guards read.

    Score: the hero's mean centres averaged over the fixed opponents (bots, `base`; pinned snapshots are
    left out so that pinning one does not move the score), its interval the average of theirs. Rates:
    hold, support, void-support and bad-completion rates, and each order kind's share (the order-kind
    mix), averaged over the opponents whose report has them.
    """
    fixed = [o for o in result.opponents if not PolicyRef.parse(o.opponent).is_adapter] or list(result.opponents)
    score = sum(o.mean_centres for o in fixed) / len(fixed)
    low = min(score, sum(o.centres_ci95[0] for o in fixed) / len(fixed))
    high = max(score, sum(o.centres_ci95[1] for o in fixed) / len(fixed))
    try:
        summary = json.loads(Path(result.report).read_text())["summary"]
    except (OSError, ValueError, KeyError, TypeError):
        summary = {}
    rates: dict[str, Any] = {}
    for name in ("hold_rate", "support_rate", "void_support_rate", "bad_completion_rate"):
        if (mean := _mean_of(summary, name)) is not None:
            rates[name] = mean
    kinds = sorted({k.split("/kind_share/", 1)[1] for k in summary if "/kind_share/" in k})
    shares = {kind: mean for kind in kinds if (mean := _mean_of(summary, f"kind_share/{kind}")) is not None}
    if shares:
        rates["kind_shares"] = shares
    return score, low, high, rates


def _mean_of(summary: dict[str, Any], name: str) -> float | None:
    """The mean of `eval/<opponent>/<name>` over the opponents whose summary has a number for it."""
    values = [v for k, v in summary.items() if k.endswith(f"/{name}") and isinstance(v, int | float)]
    return float(sum(values) / len(values)) if values else None
