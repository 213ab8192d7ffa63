"""The training entry point: bad configuration fails before anything starts; the smoke experiment runs the
whole system end to end on a local Ray cluster, survives killed actors, and resumes."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.tracking import read_metrics
from diprl.train import ConfigError, compose_config, main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+experiment=nope"], "experiment"),
        (["model=gpt5"], "model"),
        (["train.max_stepz=3"], "max_stepz"),
        (["learner.lr=fast"], "lr"),
        (["train.num_workers=0"], "num_workers"),
        (["train.train_turns=every"], "train_turns"),
        (["evaluation.games=10"], "multiple of 7"),
    ],
)
def test_bad_configuration_is_a_clear_error_before_anything_starts(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err


def test_every_experiment_composes() -> None:
    conf = Path(__file__).resolve().parents[1] / "conf" / "experiment"
    names = sorted(p.stem for p in conf.glob("*.yaml"))
    assert {"pfsp", "league", "selfplay", "dumbbot", "smoke"} <= set(names)
    for name in names:
        config, resolved = compose_config([f"+experiment={name}"])
        assert config.experiment == name and "experiment: " + name in resolved


def test_resume_of_a_missing_run_is_refused(tmp_path: Path) -> None:
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={tmp_path / 'nothing'}"])
    from diprl.train import prepare_run_dir

    with pytest.raises(ConfigError, match="not a run directory"):
        prepare_run_dir(config, resolved)


def test_a_failed_learner_step_is_a_fault_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found: the driver's ray.get of a learner step re-raised the learner's exception and ended the run.

    Also: after a publish the driver has the learner prune old versions, keeping what the league holds
    and the versions being (or waiting to be) evaluated.
    """
    import ray

    from diprl.train import Driver

    config, _ = compose_config(["+experiment=smoke"])
    driver = Driver(config, tmp_path)
    logged: list[tuple[str, dict[str, Any]]] = []
    driver.tracker = SimpleNamespace(log=lambda kind, values, policy="main": logged.append((kind, dict(values))))
    driver.queues = {"main": SimpleNamespace(qsize=lambda: 0)}
    outcomes: list[Any] = [
        RuntimeError("one batch the learner could not take"),
        {
            "step": 3,
            "trained": 1,
            "published": None,
            "quarantined": 1,
            "quarantined_records": [{"reason": "constraint", "error": "...", "group_id": "g", "index": 2}],
            "faults": [{"fault": "publish_failed", "step": 3, "error": "OSError(28, 'No space left on device')"}],
        },
        {"step": 4, "trained": 1, "published": "main@v5", "quarantined": 0, "quarantined_records": [], "faults": []},
        {"snapshot": False, "reset": False},  # the league's answer to register_version
        ["bot:random", "main@v5"],  # refs_in_use
    ]
    pruned: list[list[str]] = []
    driver.league = SimpleNamespace(
        register_version=SimpleNamespace(remote=lambda *args: "ref"), refs_in_use=SimpleNamespace(remote=lambda: "ref")
    )
    driver.learners = {"main": SimpleNamespace(prune_versions=SimpleNamespace(remote=pruned.append))}
    driver.evaluations_pending = ({"ref": ("main@v2", 10)}, [("main@v3", 20)])  # being evaluated, queued

    def get(ref: Any) -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(ray, "get", get)
    driver._learner_done(object(), "main")
    driver._learner_done(object(), "main")
    assert driver.steps["main"] == 3 and not pruned
    driver._learner_done(object(), "main")
    assert pruned == [["bot:random", "main@v2", "main@v3", "main@v5"]] and driver.versions["main"] == "main@v5"
    faults = [values for kind, values in logged if kind == "fault"]
    assert [f.get("fault") for f in faults] == [None, "quarantined", "publish_failed"]
    assert "one batch" in faults[0]["error"] and faults[1]["group_id"] == "g" and faults[1]["index"] == 2
    learner = next(values for kind, values in logged if kind == "learner")
    assert learner["quarantined"] == 1 and "quarantined_records" not in learner


@pytest.mark.slow
def test_smoke_run_survives_killed_actors_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    port = f"inference.port={free_port()}"
    chaos = "[rollout-0,league,learner-main,policy-server]"
    common = ["+experiment=smoke", port, "train.dashboard=false"]
    assert main([*common, f"train.run_dir={run_dir}", f"train.chaos={chaos}", "train.max_steps=3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split())
    assert fields["train_steps"] == "3" and int(fields["adapter_versions"]) >= 3 and int(fields["groups"]) >= 3
    records = read_metrics(run_dir / "metrics.jsonl")
    killed = {r["killed"] for r in records if r["kind"] == "fault" and "killed" in r}
    assert killed == {"rollout-0", "league", "learner-main", "policy-server"}
    steps = [r["step"] for r in records if r["kind"] == "learner"]
    assert steps == sorted(steps) and steps[-1] == 3  # a restarted learner continued from its checkpoint
    league = json.loads((run_dir / "league_summary.json").read_text())
    assert any(m["kind"] == "snapshot" for m in league["pool"]), "a snapshot joined the anchors"
    assert league["reported"]["matches"] >= 3 and any(m["games"] > 0 and m["mu"] != 25.0 for m in league["pool"])
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[0]["version"] == "main@v1" and evals[-1]["step"] == 3  # at the start and the end
    assert Path(evals[-1]["eval/report"]).is_file()
    assert (run_dir / "plots" / "learning_curves.png").is_file()

    # Resume: the learner, the league and the counters continue where they were.
    assert main([*common, f"train.resume={run_dir}", "train.max_steps=4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "train_steps=4" in last
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "learner"]
    assert steps[-1] == 4 and steps.count(4) == 1
