"""A planted collapse rolls main back, and says so in metrics.jsonl (issue 36).

The driver's own pieces (`EvalSchedule`, `LearnerLoop`, `Journal`), a real `LeagueManager` with
`league.health.rollback` on and a real `Learner` (tiny Qwen3, CPU), joined by Ray stand-ins that answer at
once. An evaluation of main@v3 reports a support rate of 0 (the guard's input, forced): the league decides a
rollback to the best version, main@v2, and the driver carries it out within main's next two steps. A driver killed
between the learner's publish and `rollback_done` resumes without rolling back twice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from diprl.eval.config import load_evaluate_config
from diprl.evaluate import make_plan
from diprl.league import LeagueConfig, LeagueManager
from diprl.league.health import HealthConfig
from diprl.learn.config import LearnerConfig
from diprl.learn.learner import Learner
from diprl.learn.site import LearnerSite
from diprl.messages import EvaluationResult, OpponentResult
from diprl.policy.models import load_preset, resolve_model_path
from diprl.policy.tokenizer import load_tokenizer
from diprl.run.config import EvalScheduleConfig
from diprl.run.evaluations import EvalSchedule
from diprl.run.journal import Journal
from diprl.run.learning import LearnerLoop
from diprl.run.progress import RunStats
from diprl.run.rundir import Counters
from diprl.tracking import Tracker, read_metrics
from tests.learn.groups import make_group, on_policy
from tests.ray_stand_in import Actor as StandInActor
from tests.ray_stand_in import Ref, Remote, use_stand_in_ray

if TYPE_CHECKING:
    from tests.conftest import SmokeSweep

HEALTHY = {"support_rate": 0.1, "void_support_rate": 0.1, "bad_completion_rate": 0.0}
COLLAPSED = {"support_rate": 0.0, "void_support_rate": 0.1, "bad_completion_rate": 0.0}  # the planted input


class Actor(StandInActor):
    """`train_next` is driven by the test: through the handle it answers "no batch yet"."""

    def __getattr__(self, name: str) -> Remote:
        return Remote(lambda *args: None) if name == "train_next" else super().__getattr__(name)


class PlantedEvaluator:
    """Answers an evaluation with a fixed score and the behaviour rates planted for the version."""

    def __init__(self, root: Path, rates: dict[str, dict[str, float]]) -> None:
        self.root, self.rates = root, rates

    def evaluate(self, version: str, tag: str) -> EvaluationResult:
        report = self.root / f"{tag}.json"
        summary = {f"eval/bot:random/{k}": v for k, v in self.rates[version].items()}
        report.write_text(json.dumps({"summary": summary}))
        return EvaluationResult(tag, version, str(report), (OpponentResult("bot:random", 14, 5.0, (4.5, 5.5), 0.0),))


def _adapter_bytes(learner: Learner, version: str) -> bytes:
    return (learner.store.resolve(version).path / "adapter_model.safetensors").read_bytes()


def test_a_planted_collapse_rolls_main_back_once_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_stand_in_ray(monkeypatch)
    tokenizer = load_tokenizer(resolve_model_path(load_preset("tiny")))
    health = HealthConfig(rollback=True, pin_every=0, crossplay_pairs=0)
    league = LeagueManager(LeagueConfig(anchors=["bot:random"], health=health), tmp_path)
    learner = Learner(
        LearnerConfig(lr=2e-2, micro_batch_tokens=1200, checkpoint_every=1),
        LearnerSite(tmp_path, tmp_path / "adapters"),
    )
    tracker = Tracker(tmp_path, {}, use_wandb=False)
    journal = Journal(tmp_path, tracker, RunStats())
    evaluator = PlantedEvaluator(tmp_path, {"main@v2": HEALTHY, "main@v3": COLLAPSED})

    def driver() -> tuple[LearnerLoop, EvalSchedule]:
        loop = LearnerLoop({"main": Actor(learner)}, {}, Actor(league), journal, list, lambda why, code: None)
        evals = EvalSchedule(
            Actor(evaluator),
            EvalScheduleConfig(at_start=False),
            journal,
            Counters(),
            league=Actor(league),
            adapters=learner.store,
        )
        return loop, evals

    def step(loop: LearnerLoop, seed: int) -> str:
        group = on_policy(learner, make_group(learner.table, tokenizer, learner.latest_version(), [1, -1.0], seed=seed))
        report = learner.train_step([group])
        ref = Ref(report)
        loop.stepping[ref] = "main"
        loop.handle(ref)
        loop.stepping.clear()
        return str(report.published)

    def evaluate(evals: EvalSchedule, version: str, step_: int) -> None:
        evals.waiting.append((version, step_, 0))
        evals.fill(stopping=False)
        (ref,) = evals.refs()
        evals.handle(ref)

    try:
        loop, evals = driver()
        loop.start()
        assert step(loop, 1) == "main@v2"
        evaluate(evals, "main@v2", 1)  # healthy: the best version
        assert step(loop, 2) == "main@v3"
        assert str(learner.store.alias("main", "best")) == "main@v2"  # marked main@best in the run's adapters
        evaluate(evals, "main@v3", 2)  # collapsed: a fault, and a rollback decided
        assert str(learner.store.alias("main", "best")) == "main@v2"  # it scored as well, and is not the best
        # What `python -m diprl.evaluate policy=main@best adapters=<run>/adapters` plays.
        named = make_plan(load_evaluate_config(["policy=main@best", f"adapters={tmp_path / 'adapters'}"]), True)
        assert named.suite.policy == "main@v2"
        assert league.pending_rollback("main") == {
            "policy": "main",
            "current": "main@v3",
            "to": "main@v2",
            "step": 2,
            "guards": ["support_rate"],
        }
        # The driver asked the league after step 2, before the decision: step 3 trains on, and the answer
        # asked after it is read with step 4's report; the rollback runs before the step after that.
        assert step(loop, 3) == "main@v4" and learner.latest_version() == "main@v4"
        assert step(loop, 4) == "main@v5"
        assert loop.versions["main"] == learner.latest_version() == "main@v6"
        assert _adapter_bytes(learner, "main@v6") == _adapter_bytes(learner, "main@v2")
        assert league.pending_rollback("main") is None and league.current("main") == "main@v6"
        assert step(loop, 5) == "main@v7"  # training goes on from the restored weights: nothing rolls back again
        assert step(loop, 6) == "main@v8" and learner.counters["rollbacks"] == 1

        # A second collapse, and a driver killed after the learner's publish but before `rollback_done`.
        evaluator.rates["main@v8"] = COLLAPSED
        evaluate(evals, "main@v8", 6)
        decision = league.pending_rollback("main")
        assert decision is not None and decision["to"] == "main@v2"
        assert learner.rollback("main@v2", "main@v8->main@v2") == "main@v9"  # the dead driver's call
        loop, evals = driver()  # the resumed driver
        loop.start()
        assert learner.counters["rollbacks"] == 2 and str(learner.store.versions("main")[-1]) == "main@v9"
        assert league.pending_rollback("main") is None and league.current("main") == "main@v9"
        assert loop.versions["main"] == "main@v9"
    finally:
        learner.engine.destroy()
    tracker.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["league/best"] for r in records if "league/best" in r] == ["main@v2"]
    faults = [r for r in records if r["kind"] == "fault" and r.get("guard") == "support_rate"]
    assert [f["version"] for f in faults] == ["main@v3", "main@v8"]
    decided = [r["league/rollback"] for r in records if "league/rollback" in r]
    assert [(d["current"], d["to"]) for d in decided] == [("main@v3", "main@v2"), ("main@v8", "main@v2")]
    done = [r["league/rollback_done"] for r in records if "league/rollback_done" in r]
    assert done == [
        {"from": "main@v3", "to": "main@v2", "published": "main@v6", "guards": ["support_rate"]},
        {"from": "main@v8", "to": "main@v2", "published": "main@v9", "guards": ["support_rate"]},
    ]
    events = [(e["event"], e.get("published")) for e in league.summary()["health"]["events"]]
    assert events == [
        ("rollback", None),
        ("rollback_done", "main@v6"),
        ("rollback", None),
        ("rollback_done", "main@v9"),
    ]


@pytest.mark.slow
def test_a_smoke_run_with_a_planted_collapse_rolls_main_back_and_says_so(smoke_sweep: SmokeSweep) -> None:
    """The whole system (Ray, PolicyServer, evaluator, league, learner): from step 2 on every evaluation of main
    reports no supports (`train.plant_collapse_at_step`), the guard fires, the league decides a rollback to
    the best version (main@v1, evaluated healthy at the start) and the learner carries it out in the run. The run
    is the trained point of tests/conftest.py's `smoke_sweep` (10 steps, an evaluation every 2)."""
    from diprl.inference.adapters import AdapterStore

    run_dir = smoke_sweep.sweep_dir / "0"
    trained = json.loads((smoke_sweep.sweep_dir / "sweep.json").read_text())["points"][0]
    assert trained["run_dir"] == str(run_dir) and trained["exit_code"] == 0, smoke_sweep.output[-6000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    planted = {r["planted_collapse"]: r["step"] for r in records if r["kind"] == "fault" and "planted_collapse" in r}
    assert planted and min(planted.values()) >= 2, planted
    fired = {r["version"] for r in records if r["kind"] == "fault" and r.get("guard") == "support_rate"}
    assert fired == set(planted)  # the guard fired on every planted evaluation, and on nothing else
    assert [r["league/best"] for r in records if "league/best" in r] == ["main@v1"]  # the start's, never a planted one
    decided = [r["league/rollback"] for r in records if "league/rollback" in r]
    done = [r["league/rollback_done"] for r in records if "league/rollback_done" in r]
    assert decided and all(d["to"] == "main@v1" for d in decided), decided
    assert done and all(d["to"] == "main@v1" for d in done), (decided, done)
    store = AdapterStore(run_dir / "adapters")
    assert str(store.alias("main", "best")) == "main@v1"

    def weights(version: str) -> bytes:
        return (store.resolve(version).path / "adapter_model.safetensors").read_bytes()

    assert all(weights(d["published"]) == weights("main@v1") for d in done)  # every restore is v1, byte for byte
    league = json.loads((run_dir / "league_summary.json").read_text())
    events = [e["event"] for e in league["health"]["events"]]
    assert "rollback" in events and "rollback_done" in events
    # A clean run as far as serving goes: every canaried version a replica checked was the published one.
    canaries = [r for r in records if r["kind"] == "canary"]
    assert canaries and all(r["canary/served_is_published"] == 1 and r["canary/error"] < 1e-4 for r in canaries)
    assert not [r for r in records if r["kind"] == "fault" and "canary_refused" in r]
