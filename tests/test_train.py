"""The training entry point: bad configuration fails before anything starts; the smoke experiment runs the
whole system end to end on a local Ray cluster, survives killed actors, and resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from diprl.inference.adapters import AdapterStore
from diprl.inference.config import rank_to_serve
from diprl.league.role_state import VersionDecision
from diprl.learn.checkpoint import CheckpointDir
from diprl.messages import PolicyRef, QuarantinedRecord, StepFault, StepReport
from diprl.run.config import ConfigError, compose_config
from diprl.run.rundir import load_counters, prepare_run_dir
from diprl.tracking import read_metrics
from diprl.train import main
from tests.ray_stand_in import Remote


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+experiment=nope"], "experiment"),
        (["model=gpt5"], "model"),
        (["train.max_stepz=3"], "max_stepz"),
        (["learner.lr=fast"], "lr"),
        (["rollout.num_workers=0"], "num_workers"),
        (["rollout.train_turns=every"], "train_turns"),
        (["rollout.matches_in_flight=0"], "matches_in_flight"),
        (["league.train_seats=all"], "train_seats"),
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


def test_the_server_follows_the_model_its_weights_and_its_lora_rank() -> None:
    """The server's max LoRA rank follows the model's (tiny 8, small 16): a server left narrower than the
    model's adapters would refuse every one."""
    tiny, _ = compose_config(["+experiment=smoke"])
    assert (tiny.inference.model, tiny.inference.max_lora_rank, tiny.model.lora.rank) == ("tiny", 8, 8)
    small, _ = compose_config(["+experiment=smoke", "model=small"])
    assert (small.inference.model, small.inference.max_lora_rank, small.model.lora.rank) == ("small", 16, 16)
    wide, _ = compose_config(["+experiment=smoke", "model=tiny_wide"])  # RL from the imitation warm start
    assert (wide.inference.model, wide.inference.max_lora_rank, wide.model.lora.rank) == ("tiny_wide", 32, 32)
    wider, _ = compose_config(["+experiment=smoke", "model=small", "inference.max_lora_rank=32"])
    assert wider.inference.max_lora_rank == 32  # a wider setting stays: it serves other adapters too
    assert rank_to_serve(8, 12) == 16
    with pytest.raises(ValueError, match="above every rank"):
        rank_to_serve(8, 4096)


def test_resume_of_a_missing_run_is_refused(tmp_path: Path) -> None:
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={tmp_path / 'nothing'}"])
    with pytest.raises(ConfigError, match="not a run directory"):
        prepare_run_dir(config, resolved)


def _learner_loop(
    tmp_path: Path, outcomes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, list[tuple[str, dict[str, Any]]], list[Any]]:
    """A LearnerLoop whose actors are stand-ins and whose `ray.get` answers from `outcomes`, in order."""
    import ray

    from diprl.run.journal import Journal
    from diprl.run.learning import LearnerLoop
    from diprl.run.progress import RunStats

    logged: list[tuple[str, dict[str, Any]]] = []
    calls: list[Any] = []
    tracker = SimpleNamespace(log=lambda kind, values, policy="main": logged.append((kind, dict(values))))
    journal = Journal(tmp_path, tracker, RunStats())

    def noted(name: str) -> Remote:
        """An actor method whose calls are noted; what `ray.get` reads comes from `outcomes`."""
        return Remote(lambda *args: calls.append((name, args)))

    league = SimpleNamespace(
        register_version=noted("register"),
        refs_in_use=noted("refs"),
        pending_rollback=noted("pending_rollback"),  # asked after each step, read with the next report
    )
    learner = SimpleNamespace(prune_versions=noted("prune"))
    loop = LearnerLoop(
        {"main": learner},
        {"main": SimpleNamespace(qsize=lambda: 0)},
        league,
        journal,
        lambda: ["main@v2", "main@v3"],  # being or waiting to be evaluated
        lambda reason, code: None,
    )

    def get(ref: Any) -> Any:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(ray, "get", get)
    return loop, logged, calls


def test_a_failed_learner_step_is_a_fault_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found: the driver's ray.get of a learner step re-raised the learner's exception and ended the run.

    Also: after a publish the driver has the learner prune old versions, keeping what the league holds
    and the versions being (or waiting to be) evaluated.
    """
    quarantined = [QuarantinedRecord("constraint", "...", "g", "main@v3", 2)]
    outcomes: list[Any] = [
        RuntimeError("one batch the learner could not take"),
        StepReport(
            "main",
            3,
            True,
            PolicyRef.parse("main@v4"),
            quarantined=quarantined,
            faults=[StepFault("publish_failed", 3, "OSError(28, 'No space left on device')")],
            metrics={"quarantined": 1},
        ),
        StepReport("main", 4, True, PolicyRef.parse("main@v5"), published=PolicyRef.parse("main@v5")),
        VersionDecision(snapshot=False, reset=False, member=None, steps_since_snapshot=1, win_rate=0.5),
        None,  # no rollback pending (asked after the step before)
        ["bot:random", "main@v5"],  # refs_in_use
    ]
    loop, logged, calls = _learner_loop(tmp_path, outcomes, monkeypatch)
    for _ in range(3):
        loop.stepping["ref"] = "main"
        loop.handle("ref")
        if loop.steps.get("main") == 3:
            assert not [c for c in calls if c[0] == "prune"]
    assert loop.steps["main"] == 4 and loop.versions["main"] == "main@v5"
    [prune] = [args for name, args in calls if name == "prune"]
    assert prune == (["bot:random", "main@v2", "main@v3", "main@v5"],)
    faults = [values for kind, values in logged if kind == "fault"]
    assert [f.get("fault") for f in faults] == [None, "quarantined", "publish_failed"]
    assert "one batch" in faults[0]["error"]
    # the lines the metrics log gets: the same keys, in the same order, as when reports carried dicts
    assert [list(f.items()) for f in faults[1:]] == [
        [
            ("learner", "main"),
            ("fault", "quarantined"),
            ("reason", "constraint"),
            ("error", "..."),
            ("group_id", "g"),
            ("policy_version", "main@v3"),
            ("index", 2),
        ],
        [
            ("learner", "main"),
            ("fault", "publish_failed"),
            ("step", 3),
            ("error", "OSError(28, 'No space left on device')"),
        ],
    ]
    learner = next(values for kind, values in logged if kind == "learner")
    assert learner["quarantined"] == 1 and "quarantined_records" not in learner and learner["step"] == 3
    assert loop.journal.stats.faults == 3


def test_a_learner_that_fails_every_step_ends_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed batch is a fault; MAX_LEARNER_FAILURES in a row is a broken learner: stop, exit status 1."""
    from diprl.run.learning import MAX_LEARNER_FAILURES

    outcomes: list[Any] = [RuntimeError("CUDA error: an illegal memory access")] * MAX_LEARNER_FAILURES
    loop, logged, _ = _learner_loop(tmp_path, outcomes, monkeypatch)
    stops: list[tuple[str, int]] = []
    loop.request_stop = lambda reason, code: stops.append((reason, code))
    for _ in range(MAX_LEARNER_FAILURES - 1):
        loop.stepping["ref"] = "main"
        loop.handle("ref")
    assert stops == [] and [v["stopping"] for _, v in logged] == [False] * (MAX_LEARNER_FAILURES - 1)
    loop.stepping["ref"] = "main"
    loop.handle("ref")
    [(reason, code)] = stops
    assert code == 1 and "in a row" in reason and logged[-1][1]["stopping"] is True


def test_a_step_checkpointed_but_never_logged_by_a_killed_driver_is_recovered(tmp_path: Path) -> None:
    """Found in the SIGKILL test: the learner took and checkpointed step 6, the driver died before logging
    it, and the resumed run (restored at step 6) went on at 7: metrics.jsonl lacked a step that counts."""
    from diprl.run.journal import Journal
    from diprl.run.progress import RunStats
    from diprl.tracking import Tracker

    journal = Journal(tmp_path, Tracker(tmp_path, {}, use_wandb=False), RunStats())
    for step in range(1, 6):
        journal.log("learner", {"step": step, "loss": 0.1}, "main")
    own = tmp_path / "learner" / "main" / "metrics.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("".join(json.dumps({"policy": "main", "step": s, "loss": 0.2}) + "\n" for s in range(1, 8)))
    # the learner restored its step-6 checkpoint; step 7 was lost with it
    assert journal.recover_learner_records("main", 6) == 1
    journal.tracker.close()
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "learner"]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["recovered"] is True


def test_a_new_run_refuses_a_directory_that_holds_anything(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    config, resolved = compose_config(["+experiment=smoke", f"train.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="not empty"):
        prepare_run_dir(config, resolved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing written beside it


def _new_run(run_dir: Path, *overrides: str) -> None:
    """A run directory as a first run leaves it: config.yaml and a checkpoint of main that verifies."""
    config, resolved = compose_config(["+experiment=smoke", f"train.run_dir={run_dir}", *overrides])
    prepare_run_dir(config, resolved).release()
    CheckpointDir(run_dir / "checkpoints" / "main").save(0, lambda d: (d / "state").write_text("0"), meta={})


def test_resume_refuses_a_changed_configuration_and_names_the_keys(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _new_run(run_dir)
    changed = ["learner.checkpoint_every=7", "rollout.episode.group_size=3"]
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={run_dir}", *changed])
    with pytest.raises(ConfigError) as err:
        prepare_run_dir(config, resolved)
    assert "learner.checkpoint_every, rollout.episode.group_size;" in str(err.value)
    # Budgets (and how this invocation reaches its server) may change.
    budget = ["train.max_steps=9", "train.max_minutes=1", "rollout.num_workers=3", "inference.port=0"]
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={run_dir}", *budget])
    prepare_run_dir(config, resolved).release()


def test_resume_refuses_to_start_over_when_no_checkpoint_verifies(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _new_run(run_dir)
    (run_dir / "checkpoints" / "main" / "step-0" / "state").write_text("flipped")
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={run_dir}"])
    with pytest.raises(ConfigError, match=r"no checkpoint of main verifies.*step-0: .*bytes"):
        prepare_run_dir(config, resolved)


def test_a_run_directory_in_use_is_locked_against_a_second_train(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _new_run(run_dir)
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={run_dir}"])
    with prepare_run_dir(config, resolved), pytest.raises(ConfigError, match="in use by another train run"):
        prepare_run_dir(config, resolved)
    prepare_run_dir(config, resolved).release()  # free again once the first one let go


@pytest.mark.parametrize("resume", [False, True])
def test_a_symlinked_lock_is_refused_and_nothing_is_written_through_it(tmp_path: Path, resume: bool) -> None:
    """Found by review (N4): taking a run directory opened `.lock` following links, so a `.lock` planted as a
    symlink (or a hard link) made the train process truncate and overwrite the file it points at."""
    run_dir = tmp_path / "run"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    if resume:
        _new_run(run_dir)
        (run_dir / ".lock").unlink()
    else:
        run_dir.mkdir()
    (run_dir / ".lock").symlink_to(victim)
    key = "train.resume" if resume else "train.run_dir"
    config, resolved = compose_config(["+experiment=smoke", f"{key}={run_dir}"])
    with pytest.raises(ConfigError, match=r"\.lock is a symbolic link"):
        prepare_run_dir(config, resolved)
    assert victim.read_text() == "precious"
    (run_dir / ".lock").unlink()
    os.link(victim, run_dir / ".lock")
    with pytest.raises(ConfigError, match=r"\.lock has 2 links"):
        prepare_run_dir(config, resolved)
    assert victim.read_text() == "precious"
    (run_dir / ".lock").unlink()
    prepare_run_dir(config, resolved).release()  # a plain lock file is taken as before
    assert (run_dir / ".lock").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("text", ["{torn", "[" * 100_000 + "]" * 100_000])
def test_corrupt_driver_counters_are_a_clear_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "train_state.json").write_text(text)  # N5: nested too deeply was a RecursionError
    with pytest.raises(ConfigError, match=r"train_state\.json is corrupt"):
        load_counters(tmp_path)


def test_resume_refuses_a_config_yaml_with_aliases_at_once(tmp_path: Path) -> None:
    """Found by review (N8): a 334-byte `config.yaml` of nested aliases took 127 s to load in `train.resume`.
    A run's config is resolved YAML without aliases: one that has them is a clear error, at once."""
    from tests.web.test_readers import yaml_bomb

    run_dir = tmp_path / "run"
    _new_run(run_dir)
    saved = (run_dir / "config.yaml").read_text()
    config, resolved = compose_config(["+experiment=smoke", f"train.resume={run_dir}"])
    for text, why in ((yaml_bomb(5), "alias"), (saved + "extra: ${train}\n", "interpolation")):
        (run_dir / "config.yaml").write_text(text)
        start = time.monotonic()
        with pytest.raises(ConfigError, match=f"config.yaml does not load .*{why}"):
            prepare_run_dir(config, resolved)
        assert time.monotonic() - start < 5.0
    (run_dir / "config.yaml").write_text(saved)
    prepare_run_dir(config, resolved).release()


def test_the_league_summary_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review (L1): `league_summary.json` was rewritten in place, so a reader (the web app) or a
    crash in the middle saw a torn file. The new summary replaces the old one whole: a reader holding the
    old file still reads all of it, and no temporary file is left."""
    import ray

    from diprl.run.driver import Driver
    from diprl.run.rundir import Counters

    path = tmp_path / "league_summary.json"
    path.write_text(json.dumps({"matches": 1}))
    tracker = SimpleNamespace(close=lambda: None)
    driver = SimpleNamespace(
        run_dir=tmp_path,
        learning=SimpleNamespace(save_checkpoints=lambda: None),
        _log_serving=lambda: None,
        actors=SimpleNamespace(league=SimpleNamespace(summary=SimpleNamespace(remote=lambda: "summary"))),
        _main_rating=lambda: None,
        _log_league=lambda: None,
        journal=SimpleNamespace(log=lambda kind, values: None, tracker=tracker),
        counters=Counters(),
        config=SimpleNamespace(experiment="smoke"),
    )
    monkeypatch.setattr(ray, "get", lambda ref: {"matches": 2, "pool": ["main@v1"]})
    with path.open() as before:
        Driver._finish(driver)  # type: ignore[arg-type]
        assert json.loads(before.read()) == {"matches": 1}  # the old file, whole, for whoever had it open
    assert json.loads(path.read_text()) == {"matches": 2, "pool": ["main@v1"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["league_summary.json", "train_state.json"]


@pytest.mark.parametrize("budget_left", [True, False])
def test_the_loop_tells_the_evaluations_when_the_training_budget_is_spent(budget_left: bool) -> None:
    """What `EvalSchedule.fill` needs to start no crossplay and no superseded evaluation after the budget."""
    from diprl.run.driver import Driver

    calls: list[tuple[str, Any]] = []
    idle = SimpleNamespace(refs=lambda: [], fill=lambda: calls.append(("fill", None)))
    driver = SimpleNamespace(
        budget_left=lambda: budget_left,
        stop=SimpleNamespace(reason=None),
        matches=idle,
        learning=idle,
        evals=SimpleNamespace(refs=lambda: [], fill=lambda stopping, spent: calls.append(("evals", (stopping, spent)))),
        _stop_rollouts=lambda: calls.append(("stop_rollouts", None)),
        _maybe_chaos=lambda: None,
        watchdog=SimpleNamespace(poll=lambda: None),
    )
    Driver._loop(driver)  # type: ignore[arg-type]  # nothing in flight: one pass
    if budget_left:
        assert calls == [("fill", None), ("fill", None), ("evals", (False, False))]
    else:
        assert calls == [("stop_rollouts", None), ("evals", (False, True))]


def _learner_steps(run_dir: Path, name: str = "metrics.jsonl", policy: str = "main") -> list[int]:
    records = read_metrics(run_dir / name)  # trained steps (a restarted learner may log its publish, trained 0)
    return [r["step"] for r in records if r["kind"] == "learner" and r["policy"] == policy and r.get("trained", 1)]


def _start_train(args: list[str], out: Path) -> subprocess.Popen[bytes]:
    """`python -m diprl.train` in its own session: one signal to its process group reaches its local Ray too."""
    with out.open("wb") as fh, out.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "diprl.train", *args], stdout=fh, stderr=err, start_new_session=True
        )


def _wait_for_step(proc: subprocess.Popen[bytes], run_dir: Path, step: int, out: Path) -> None:
    """Until the run in `proc` logs learner step `step` (records from before it started do not count)."""
    since, deadline = time.time(), time.monotonic() + 420

    def reached() -> bool:
        # A record the resume recovered from the learner's own log is logged now but was taken before.
        records = read_metrics(run_dir / "metrics.jsonl")
        return any(
            r["kind"] == "learner" and r["time"] >= since and r["step"] >= step and not r.get("recovered")
            for r in records
        )

    while not reached():
        assert proc.poll() is None, f"the run ended early:\n{out.with_suffix('.err').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no learner step {step} in 7 minutes:\n{out.read_text()[-3000:]}"
        time.sleep(0.1)


def _wait_until_gone(group: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"processes of group {group} outlived SIGKILL"
        time.sleep(0.2)


@pytest.mark.slow
def test_smoke_run_survives_killed_actors_sigkill_and_sigterm_and_counts_every_step_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One run, stopped every way it can stop, resumed each time; every learner step counts exactly once.

    A step counts once its checkpoint is durable. Checkpoints every 3 steps (the default is 10; 3 keeps
    the test short, and nothing depends on the number): actors killed mid-run (the learner restarts
    from step 0 and takes step 1 again), a clean end at step 3, a resume SIGKILLed with its Ray after
    step 4 (published, not checkpointed), a resume that takes step 4 again and is stopped by SIGTERM:
    it drains and writes its final checkpoint, evaluation and summary.
    """
    run_dir = tmp_path / "run"
    common = ["+experiment=smoke", "train.dashboard=false", "learner.checkpoint_every=3"]
    # The league's evaluation side, off in the smoke experiment for time: one snapshot pinned, one crossplay pair.
    common += ["league.health.pin_every=1", "league.health.pin_max=1", "league.health.crossplay_pairs=1"]
    chaos = "[rollout-0,league,learner-main,policy-server,group-ledger]"
    port = "inference.port=0"
    assert main([*common, port, f"train.run_dir={run_dir}", f"train.chaos={chaos}", "train.max_steps=3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split())
    assert fields["train_steps"] == "3" and int(fields["adapter_versions"]) >= 3 and int(fields["groups"]) >= 3
    records = read_metrics(run_dir / "metrics.jsonl")
    killed = {r["killed"] for r in records if r["kind"] == "fault" and "killed" in r}
    assert killed == {"rollout-0", "league", "learner-main", "policy-server", "group-ledger"}
    # Every restart is on record (the watchdog sees each actor's new process), with what it replayed.
    restarted = {r["restarted"]: r for r in records if r["kind"] == "fault" and "restarted" in r}
    assert {"rollout-0", "league", "learner-main", "group-ledger"} <= set(restarted)
    assert restarted["rollout-0"]["pid"] != restarted["rollout-0"]["previous_pid"]
    # The learner Ray restarted took step 1 again from its step-0 checkpoint: the first step 1 left the file.
    assert any(r.get("learner_restored") == "main" for r in records if r["kind"] == "fault")
    assert _learner_steps(run_dir) == [1, 2, 3] and 1 in _learner_steps(run_dir, "metrics.superseded.jsonl")
    league = json.loads((run_dir / "league_summary.json").read_text())
    assert any(m["kind"] == "snapshot" for m in league["pool"]), "a snapshot joined the anchors"
    assert league["reported"]["matches"] >= 3 and any(m["games"] > 0 and m["mu"] != 25.0 for m in league["pool"])
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[0]["version"] == "main@v1" and evals[-1]["step"] == 3  # at the start and the end
    # A snapshot pinned into the evaluator's pool is played at the end; a crossplay round followed an evaluation.
    pins = [r["league/eval_pin"] for r in records if r["kind"] == "league" and "league/eval_pin" in r]
    assert pins and any(r["opponents"] in pins and r["eval/games"] == 7 for r in evals), (pins, evals)
    rounds = [r for r in records if r["kind"] == "league" and "league/crossplay" in r]
    assert rounds and all(r["league/crossplay_games"] == 7 for r in rounds), rounds
    assert Path(evals[-1]["eval/report"]).is_file()
    [start] = sorted((run_dir / "provenance").glob("*.json"))  # what made the run, recorded at its start
    assert json.loads(start.read_text())["code"]["commit"]
    assert (run_dir / "plots" / "learning_curves.png").is_file()

    # SIGKILL the driver and its Ray after step 4 was published, before the step-6 checkpoint.
    # W&B off in the child processes: they would join this process's W&B service, which holds the run id.
    resume = [*common, f"train.resume={run_dir}", "train.wandb=false"]
    out = tmp_path / "killed.log"
    second = compose_config(resume)  # composed beforehand: the kill follows step 4 within milliseconds
    proc = _start_train([*resume, "inference.port=0", "train.max_steps=100"], out)
    try:
        _wait_for_step(proc, run_dir, 4, out)
        with pytest.raises(ConfigError, match="in use by another train run"):  # locked while it runs
            prepare_run_dir(*second)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _wait_until_gone(proc.pid)  # its Ray (raylet, GCS, actors) died with it: nothing survives the kill
    logged = _learner_steps(run_dir)[3:]
    assert logged and logged[0] == 4
    # The steps after the newest checkpoint were lost with the kill. The learner may also have taken and
    # checkpointed a step whose log line was lost with the driver: the resume recovers that record.
    restored_at = CheckpointDir(run_dir / "checkpoints" / "main").newest_good().checkpoint
    assert restored_at is not None and restored_at.step % 3 == 0 and restored_at.step >= 3
    lost = [s for s in logged if s > restored_at.step]
    store = AdapterStore(run_dir / "adapters")
    published = [r.version for r in store.versions("main")]

    # Resume: step 3 restored, its weights published anew after every version the lost steps left.
    out = tmp_path / "resumed.log"
    proc = _start_train([*resume, "inference.port=0", "train.max_steps=100"], out)
    try:
        _wait_for_step(proc, run_dir, 5, out)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    last = out.read_text().strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split())
    assert fields["stopped"] == "signal_SIGTERM", out.read_text()[-3000:]
    steps = _learner_steps(run_dir)
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 5  # every step once, in order
    assert set(lost) <= set(_learner_steps(run_dir, "metrics.superseded.jsonl"))
    versions = [r.version for r in store.versions("main")]
    # Numbers only grow and none is reused (old ones may be pruned: learner.keep_versions).
    assert versions == sorted(set(versions)) and versions[-1] > max(published)
    newest = CheckpointDir(run_dir / "checkpoints" / "main").newest_good().checkpoint
    assert newest is not None and newest.step == steps[-1] == int(fields["train_steps"])  # the final checkpoint
    league = json.loads((run_dir / "league_summary.json").read_text())
    assert league["current"]["main"] == newest.meta["version"] == f"main@v{versions[-1]}"
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[-1]["step"] == steps[-1]  # the final evaluation ran after the signal


@pytest.mark.slow
def test_a_league_trained_by_one_learner_host_survives_its_kill_and_counts_each_role_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The three roles of `league=league` on one learner process (`learner.adapters_per_actor=3`), the host
    killed after main's first step: it restarts, each adapter resumes at its own checkpoint, and every
    role's steps are logged once, in order, all from one process at a time."""
    run_dir = tmp_path / "run"
    roles = ("main", "main_exploiter", "league_exploiter")
    host = "learners-" + "+".join(roles)
    args = ["+experiment=smoke", "league=league", "learner.adapters_per_actor=3", "train.dashboard=false"]
    args += ["inference.port=0", f"train.run_dir={run_dir}", f"train.chaos=[{host}]", "train.max_steps=4"]
    assert main(args) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert {r["killed"] for r in records if r["kind"] == "fault" and "killed" in r} == {host}
    steps = {role: _learner_steps(run_dir, policy=role) for role in roles}
    assert steps["main"] == [1, 2, 3, 4]
    for role in roles:
        assert steps[role] == list(range(1, len(steps[role]) + 1)), (role, steps)  # once each, in order
        assert (run_dir / "checkpoints" / role).is_dir()
    assert steps["main_exploiter"] or steps["league_exploiter"], "an exploiter stepped"
    # The watchdog saw every role's learner restart, into one and the same new process.
    restarted = {r["restarted"]: r["pid"] for r in records if r["kind"] == "fault" and "restarted" in r}
    assert {f"learner-{role}" for role in roles} <= set(restarted)
    assert len({restarted[f"learner-{role}"] for role in roles}) == 1, restarted
